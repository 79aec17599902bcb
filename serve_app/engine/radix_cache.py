"""Prefix cache: a radix tree over token ids whose edges carry KV slot ids.

The scheduler (CPU) uses it to share the KV of common prompt prefixes between requests
(docs/design.md, "KV cache and prefix cache"). Everything works at *page* granularity: every edge of the tree
holds a whole number of pages (``page_size`` tokens and their ``page_size`` slots), keys are
truncated down to a multiple of ``page_size``, and matches/splits happen only at page
boundaries. A node's children are keyed by the first page of their edge, so siblings never
share a first page.

Ownership: slots held by the tree belong to the tree; it frees them to the
``SlotAllocator`` when it evicts them (or on ``reset``). Slots handed to ``insert`` are owned
by the tree afterwards *up to the page-aligned length of the key*; the tail beyond it stays
with the caller.

Typical scheduler use::

    m = cache.match_prefix(prompt)            # m.length < len(prompt), page aligned
    cache.lock(m.node)                        # matched KV can't be evicted while we run
    row_slots[:m.length] = m.slots            # reuse; allocate the rest (evict() on OOM)
    ...                                       # request runs, computes KV for `valid` tokens
    cache.insert(seq[:valid], row_slots[:valid])   # takes row_slots[:aligned(valid)]
    allocator.free(row_slots[cache.aligned(valid):allocated])   # tail not taken by insert
    cache.unlock(m.node)

``valid`` must be >= ``m.length`` (the request never gives back part of its match); the
caller must free exactly ``row_slots[cache.aligned(valid):]`` (all its slots past the
page-aligned inserted length) and nothing before it: ``insert`` already freed the caller's
duplicate copies of KV the tree held.

Eviction granularity: whole nodes. ``evict`` repeatedly frees the least-recently-used
unlocked leaf (its whole edge); a parent whose last child went becomes a leaf and competes
by its own access time. It may free a bit more than asked. Candidates wait in a heap that
lives with the tree (a full KV pool evicts at nearly every allocation, and the tree of a
long run holds thousands of leaves): a node is pushed whenever it may have become an
unlocked leaf or its access time moved, and entries that no longer describe it are
dropped when they surface.

Recency: a logical clock; ``match_prefix`` and ``insert`` stamp every node on the path they
walk (so a parent is never older than its children).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Optional

import torch

from actors.worker.kv_cache import SlotAllocator

_EMPTY = torch.empty(0, dtype=torch.int64)


class RadixNode:
    """One edge of the tree (the edge into this node) plus its children.

    ``key`` (token ids) and ``value`` ([len(key)] int64 slot ids, CPU) have equal length, a
    multiple of page_size (both empty for the root). ``lock_ref`` counts the locks of
    requests whose matched path passes through this node.
    """

    __slots__ = ("key", "value", "parent", "children", "lock_ref", "last_access", "gen")

    def __init__(self, key: list[int], value: torch.Tensor, parent: Optional["RadixNode"],
                 gen: int, last_access: int = 0):
        self.key = key
        self.value = value
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.lock_ref = 0
        self.last_access = last_access
        self.gen = gen

    def __len__(self) -> int:
        return len(self.key)

    def __repr__(self) -> str:
        return (f"RadixNode(len={len(self.key)}, lock_ref={self.lock_ref}, "
                f"children={len(self.children)}, last_access={self.last_access})")


@dataclass
class MatchResult:
    """``slots``: [length] int64 KV slots of the matched prefix; ``node``: handle for
    ``lock``/``unlock`` (the deepest matched node; the root if nothing matched)."""

    slots: torch.Tensor
    node: RadixNode
    length: int


class RadixCache:
    def __init__(self, allocator: SlotAllocator, page_size: int, enabled: bool = True):
        if page_size < 1:
            raise ValueError(f"page_size={page_size} must be >= 1")
        if getattr(allocator, "page_size", page_size) != page_size:
            raise ValueError(f"allocator page_size={allocator.page_size} != {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.enabled = enabled
        self._gen = 0
        self._init_tree()

    # ------------------------------------------------------------------ public API

    def aligned(self, n: int) -> int:
        """``n`` rounded down to a multiple of page_size (the length ``insert`` takes)."""
        return n // self.page_size * self.page_size

    @property
    def total_slots(self) -> int:
        """Slots held by the tree (locked or not)."""
        return self._total

    @property
    def evictable_slots(self) -> int:
        """Slots held by unlocked nodes (all of which ``evict`` can free)."""
        return self._evictable

    @property
    def locked_slots(self) -> int:
        return self._total - self._evictable

    def match_prefix(self, token_ids: list[int]) -> MatchResult:
        """Longest cached page-aligned prefix of ``token_ids``, shorter than the input.

        The match is capped at ``aligned(len(token_ids) - 1)`` so the caller always has at
        least one token to compute. A match ending inside an edge splits that edge (at a page
        boundary) so the returned node covers exactly the match.
        """
        if not self.enabled or len(token_ids) <= 1:
            return MatchResult(_EMPTY, self.root, 0)
        limit = self.aligned(len(token_ids) - 1)
        node, pos, pieces, _ = self._walk(token_ids, limit)
        if not pieces:
            return MatchResult(_EMPTY, self.root, 0)
        # a fresh tensor: the caller may write into it without touching the tree
        slots = pieces[0].clone() if len(pieces) == 1 else torch.cat(pieces)
        return MatchResult(slots, node, pos)

    def lock(self, node: Optional[RadixNode]) -> None:
        """Protect ``node`` and its ancestors from eviction (reference counted)."""
        if node is None or node.gen != self._gen:
            return
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.value)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Optional[RadixNode]) -> None:
        """Undo one ``lock(node)``. A handle from before ``reset()`` is ignored."""
        if node is None or node.gen != self._gen:
            return
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("unlock() of a node that is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.value)
                self._push_candidate(node)
            node = node.parent

    def insert(self, token_ids: list[int], slots: torch.Tensor) -> int:
        """Cache the page-aligned prefix of (token_ids, slots); return how many leading
        tokens (a page multiple) the tree already held.

        ``slots`` ([len(token_ids)] int, any device) must be valid KV for ``token_ids``.
        The tree takes ``slots[:aligned(len(token_ids))]``: slots for the part it already
        held are freed to the allocator unless they are the very same slot ids (KV the
        request got from ``match_prefix``); the rest becomes new tree nodes. The tail
        ``slots[aligned(len):]`` is NOT taken: the caller frees it.
        """
        if len(slots) != len(token_ids):
            raise ValueError(f"len(slots)={len(slots)} != len(token_ids)={len(token_ids)}")
        n = self.aligned(len(token_ids))
        if n == 0:
            return 0
        slots = slots[:n].to(device="cpu", dtype=torch.int64)
        if not self.enabled:
            self.allocator.free(slots)
            return 0
        node, pos, _, dups = self._walk(token_ids, n, dup_slots=slots)
        if dups:
            self.allocator.free(torch.cat(dups))
        if pos < n:
            leaf = RadixNode(list(token_ids[pos:n]), slots[pos:n].clone(), node, self._gen,
                             self._tick)  # same stamp as the path just walked
            node.children[self._page_key(leaf.key, 0)] = leaf
            self._total += n - pos
            self._evictable += n - pos
            self._push_candidate(leaf)
        return pos

    def evict(self, num_slots: int) -> int:
        """Free LRU unlocked leaves (whole nodes) until >= ``num_slots`` slots were freed or
        nothing evictable is left. Returns the number of slots freed."""
        if num_slots <= 0 or self._evictable == 0:
            return 0
        heap = self._candidates
        freed = 0
        to_free: list[torch.Tensor] = []
        while freed < num_slots and heap:
            entry = heapq.heappop(heap)
            if not self._is_candidate(entry):
                continue
            node = entry[2]
            parent = node.parent
            del parent.children[self._page_key(node.key, 0)]
            to_free.append(node.value)
            size = len(node.value)
            freed += size
            self._total -= size
            self._evictable -= size
            node.parent = None
            self._push_candidate(parent)
        if to_free:
            self.allocator.free(torch.cat(to_free))
        return freed

    def reset(self, free_slots: bool = True) -> None:
        """Drop the whole tree. With ``free_slots`` its slots go back to the allocator, which
        is refused while any node is locked (a running request still reads that KV); pass
        ``free_slots=False`` when the allocator is being reset too. Handles from before the
        reset become inert for ``lock``/``unlock``."""
        if free_slots:
            if self._total != self._evictable:
                raise RuntimeError("reset(free_slots=True) while nodes are locked")
            values = [n.value for n in self._iter_nodes()]
            if values:
                self.allocator.free(torch.cat(values))
        self._gen += 1
        self._init_tree()

    def check_invariants(self) -> None:
        """Debug/test helper: recompute the counters and check the tree's structure."""
        total = evictable = 0
        seen: set[int] = set()
        for node in self._iter_nodes():
            assert len(node.key) == len(node.value) > 0, node
            assert len(node.key) % self.page_size == 0, node
            assert node.parent is not None and node.parent.children.get(
                self._page_key(node.key, 0)) is node, node
            assert node.lock_ref >= 0, node
            assert node.parent is self.root or node.parent.lock_ref >= node.lock_ref, node
            assert node.parent is self.root or node.parent.last_access >= node.last_access
            total += len(node.value)
            if node.lock_ref == 0:
                evictable += len(node.value)
            vals = node.value.tolist()
            assert not seen.intersection(vals), "slot held twice by the tree"
            seen.update(vals)
            ps = self.page_size
            for i in range(0, len(vals), ps):
                assert vals[i] % ps == 0 and vals[i:i + ps] == list(range(vals[i], vals[i] + ps))
        assert total == self._total, (total, self._total)
        assert evictable == self._evictable, (evictable, self._evictable)
        queued = {id(e[2]) for e in self._candidates if self._is_candidate(e)}
        for node in self._iter_nodes():
            if not node.children and node.lock_ref == 0:
                assert id(node) in queued, f"{node} is evictable but not in the heap"

    # ------------------------------------------------------------------ internals

    def _init_tree(self) -> None:
        self.root = RadixNode([], _EMPTY, None, self._gen)
        self.root.lock_ref = 1  # never evicted
        self._total = 0
        self._evictable = 0
        self._tick = 0
        # (last_access, id, node) of unlocked leaves, plus stale entries (see the top)
        self._candidates: list[tuple[int, int, RadixNode]] = []

    def _push_candidate(self, node: RadixNode) -> None:
        if node is self.root or node.children or node.lock_ref:
            return
        heap = self._candidates
        # Stale entries pile up (every match pushes one): keep them a bounded share.
        if len(heap) > 64 + 4 * (self._total // self.page_size):
            heap[:] = [e for e in heap if self._is_candidate(e)]
            heapq.heapify(heap)
        heapq.heappush(heap, (node.last_access, id(node), node))

    @staticmethod
    def _is_candidate(entry: tuple[int, int, RadixNode]) -> bool:
        """Whether a heap entry still describes its node: in the tree, an unlocked leaf,
        last used when the entry was pushed."""
        last_access, _, node = entry
        return (node.parent is not None and not node.children and node.lock_ref == 0
                and node.last_access == last_access)

    def _page_key(self, tokens: list[int], start: int) -> tuple[int, ...]:
        return tuple(tokens[start:start + self.page_size])

    def _iter_nodes(self):
        """All nodes but the root."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _common_len(self, key: list[int], tokens: list[int], start: int, limit: int) -> int:
        """Page-aligned length of the common prefix of ``key`` and ``tokens[start:limit]``."""
        n = min(len(key), limit - start)
        if key[:n] == tokens[start:start + n]:  # fast path: whole edge (or rest) matches
            return self.aligned(n)
        i = 0
        while i < n and key[i] == tokens[start + i]:
            i += 1
        return self.aligned(i)

    def _split(self, node: RadixNode, at: int) -> RadixNode:
        """Split ``node``'s edge at ``at`` (page multiple, 0 < at < len): a new node takes
        the first ``at`` tokens and becomes ``node``'s parent. ``node`` keeps its identity
        (handles held by requests stay valid) and its lock count is copied to the new node,
        since every lock through ``node`` also passes through it."""
        upper = RadixNode(node.key[:at], node.value[:at], node.parent, self._gen,
                          node.last_access)
        upper.lock_ref = node.lock_ref
        node.parent.children[self._page_key(node.key, 0)] = upper
        node.key = node.key[at:]
        node.value = node.value[at:]
        node.parent = upper
        upper.children[self._page_key(node.key, 0)] = node
        return upper

    def _walk(self, tokens: list[int], limit: int,
              dup_slots: Optional[torch.Tensor] = None):
        """Follow ``tokens[:limit]`` (limit page aligned) down the tree, stamping the path.

        Returns (deepest node, matched length, matched slot pieces, duplicate pages of
        ``dup_slots`` to free). A match ending inside an edge splits it.
        """
        self._tick += 1
        tick = self._tick
        ps = self.page_size
        node, pos = self.root, 0
        pieces: list[torch.Tensor] = []
        dups: list[torch.Tensor] = []
        while pos + ps <= limit:
            child = node.children.get(self._page_key(tokens, pos))
            if child is None:
                break
            c = self._common_len(child.key, tokens, pos, limit)
            if c < len(child.key):
                child = self._split(child, c)
            child.last_access = tick
            pieces.append(child.value)
            # Equal slots (the usual case: KV the request got from match_prefix) need no
            # page-by-page look.
            if dup_slots is not None and not torch.equal(dup_slots[pos:pos + c], child.value):
                mine = dup_slots[pos:pos + c].view(-1, ps)
                eq = (mine == child.value.view(-1, ps))
                same_page = eq.all(dim=1)
                if bool((eq.any(dim=1) & ~same_page).any()):
                    raise ValueError("insert(): slots partially overlap cached pages")
                if not bool(same_page.all()):
                    dups.append(mine[~same_page].reshape(-1))
            node = child
            pos += c
        self._push_candidate(node)  # its access time moved (the path above has children)
        return node, pos, pieces, dups
