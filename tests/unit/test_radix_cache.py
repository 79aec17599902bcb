"""Unit tests for serve_app/engine/radix_cache.py (prefix cache over the paged slot allocator)."""
from __future__ import annotations

import random

import pytest
import torch

from actors.worker.kv_cache import SlotAllocator
from serve_app.engine.radix_cache import MatchResult, RadixCache


class CheckedAllocator(SlotAllocator):
    """SlotAllocator that tracks outstanding pages and fails on double/foreign/partial frees."""

    def __init__(self, num_slots: int, page_size: int = 1):
        super().__init__(num_slots, page_size)
        self.outstanding: set[int] = set()  # page ids handed out and not yet freed

    def alloc(self, num_slots):
        out = super().alloc(num_slots)
        if out is not None:
            pages = set((out.view(-1, self.page_size)[:, 0] // self.page_size).tolist())
            assert not pages & self.outstanding, "allocator handed out a page twice"
            self.outstanding |= pages
        return out

    def free(self, slots):
        ps = self.page_size
        rows = slots.reshape(-1, ps).tolist() if slots.numel() else []
        pages = []
        for row in rows:
            assert row[0] % ps == 0 and row == list(range(row[0], row[0] + ps)), \
                f"free() of a non-page {row}"
            pages.append(row[0] // ps)
        assert len(set(pages)) == len(pages), "page freed twice in one call"
        missing = set(pages) - self.outstanding
        assert not missing, f"double free / free of unallocated pages {sorted(missing)}"
        self.outstanding -= set(pages)
        super().free(slots)

    def outstanding_slots(self) -> set[int]:
        ps = self.page_size
        return {p * ps + i for p in self.outstanding for i in range(ps)}


def make(page_size: int, num_pages: int = 64, enabled: bool = True):
    alloc = CheckedAllocator(num_pages * page_size, page_size)
    return alloc, RadixCache(alloc, page_size, enabled=enabled)


def tree_pages(cache: RadixCache) -> dict[tuple[int, ...], list[int]]:
    """page-aligned prefix tuple (ending with a page) -> that page's slots, for every page
    the tree holds. (Per page, not per token: with page_size > 1 two sibling pages may share
    leading tokens and then each holds its own copy of their KV.)"""
    ps = cache.page_size
    out: dict[tuple[int, ...], list[int]] = {}
    stack = [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            p = prefix
            vals = child.value.tolist()
            for i in range(0, len(child.key), ps):
                p = p + tuple(child.key[i:i + ps])
                assert p not in out, "page cached twice"
                out[p] = vals[i:i + ps]
            stack.append((child, p))
    return out


def tree_contents(cache: RadixCache) -> set[tuple[int, ...]]:
    """Page-aligned prefixes the tree holds."""
    return set(tree_pages(cache))


def expected_match(cache: RadixCache, tokens: list[int], limit: int) -> int:
    """Longest page-aligned k <= limit with tokens[:k] held by the tree (reference model)."""
    held = tree_pages(cache)
    ps = cache.page_size
    best = 0
    for k in range(ps, limit + 1, ps):
        if tuple(tokens[:k]) in held:
            best = k
    return best


def insert_fresh(alloc, cache, tokens):
    """Allocate fresh slots for `tokens` (as a request would), insert, free the tail."""
    n = alloc.round_up(len(tokens))
    slots = alloc.alloc(n)
    assert slots is not None
    ret = cache.insert(tokens, slots[:len(tokens)])
    alloc.free(slots[cache.aligned(len(tokens)):])
    return ret, slots


# ----------------------------------------------------------------------------- basics

@pytest.mark.parametrize("ps", [1, 4])
def test_empty_cache_and_miss(ps):
    alloc, cache = make(ps)
    for toks in ([], [1], [1, 2, 3, 4, 5, 6, 7, 8, 9]):
        m = cache.match_prefix(toks)
        assert isinstance(m, MatchResult)
        assert m.length == 0 and m.slots.numel() == 0 and m.slots.dtype == torch.int64
        assert m.node is cache.root
        cache.lock(m.node)
        cache.unlock(m.node)
    assert cache.total_slots == cache.evictable_slots == 0
    assert cache.evict(100) == 0


@pytest.mark.parametrize("ps", [1, 4])
def test_match_never_returns_full_input(ps):
    alloc, cache = make(ps)
    seq = list(range(10, 10 + 3 * ps))  # 3 pages
    _, slots = insert_fresh(alloc, cache, seq)
    # exact input: must leave >= 1 token to compute -> drop the last page
    m = cache.match_prefix(seq)
    assert m.length == 2 * ps < len(seq)
    assert m.slots.tolist() == slots[:2 * ps].tolist()
    # one more token: the whole cached key matches
    m = cache.match_prefix(seq + [99])
    assert m.length == 3 * ps
    assert m.slots.tolist() == slots[:3 * ps].tolist()
    # any prefix of the key: always strictly shorter than the input, page aligned
    for n in range(0, len(seq) + 1):
        m = cache.match_prefix(seq[:n])
        assert m.length == cache.aligned(max(n - 1, 0)), n
        assert m.length < max(n, 1)
        assert m.length % ps == 0
    cache.check_invariants()


def test_page_alignment_of_insert_and_match():
    ps = 4
    alloc, cache = make(ps)
    seq = list(range(1, 11))  # 10 tokens -> 2 whole pages
    free0 = alloc.free_slots
    ret, slots = insert_fresh(alloc, cache, seq)  # tail slots[8:12] freed by the caller
    assert ret == 0
    assert cache.total_slots == 8
    assert alloc.free_slots == free0 - 8
    assert alloc.free_slots + cache.total_slots == alloc.capacity
    # a match that diverges inside a page only returns whole pages
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 0, 0, 0])
    assert m.length == 4 and m.slots.tolist() == slots[:4].tolist()
    # a key shorter than a page is not cached at all; insert takes nothing
    short = alloc.alloc(4)
    assert cache.insert([7, 7, 7], short[:3]) == 0
    assert cache.total_slots == 8
    alloc.free(short)  # caller still owns it
    cache.check_invariants()


@pytest.mark.parametrize("ps", [1, 4])
def test_split_on_match_and_insert(ps):
    alloc, cache = make(ps)
    a = [1] * ps + [2] * ps + [3] * ps + [4] * ps
    _, sa = insert_fresh(alloc, cache, a)
    # diverge after 2 pages: split at the page boundary
    q = a[:2 * ps] + [9] * (2 * ps)
    m = cache.match_prefix(q)
    assert m.length == 2 * ps and m.slots.tolist() == sa[:2 * ps].tolist()
    assert len(m.node.key) == 2 * ps and m.node.parent is cache.root
    assert len(cache.root.children) == 1 and len(m.node.children) == 1
    cache.check_invariants()
    # insert the diverging key: first 2 pages already present
    cache.lock(m.node)
    new = alloc.alloc(4 * ps)
    row = torch.cat([m.slots, new[:2 * ps]])
    assert cache.insert(q, row) == 2 * ps
    alloc.free(new[2 * ps:])
    cache.unlock(m.node)
    assert cache.total_slots == 6 * ps
    assert len(m.node.children) == 2
    assert cache.match_prefix(q + [5]).slots.tolist() == row.tolist()
    assert cache.match_prefix(a + [5]).slots.tolist() == sa[:4 * ps].tolist()
    assert alloc.free_slots + cache.total_slots == alloc.capacity
    cache.check_invariants()


# ----------------------------------------------------------------------------- duplicates

@pytest.mark.parametrize("ps", [1, 4])
def test_duplicates_freed(ps):
    alloc, cache = make(ps)
    seq = list(range(3 * ps))
    insert_fresh(alloc, cache, seq)
    assert cache.total_slots == 3 * ps
    free_before = alloc.free_slots
    # a second request computed the same prefix independently (it missed the cache),
    # then went further by one page
    slots2 = alloc.alloc(4 * ps)
    assert alloc.free_slots == free_before - 4 * ps
    ret = cache.insert(seq + [77] * ps, slots2)
    assert ret == 3 * ps
    # its 3 duplicate pages went back; the 4th page is now the tree's
    assert alloc.free_slots == free_before - ps
    assert cache.total_slots == 4 * ps
    held = tree_pages(cache)
    assert held[tuple(seq + [77] * ps)] == slots2[3 * ps:].tolist()
    assert not set(slots2[:3 * ps].tolist()) & {s for v in held.values() for s in v}
    assert alloc.free_slots + cache.total_slots == alloc.capacity
    cache.check_invariants()


@pytest.mark.parametrize("ps", [1, 4])
def test_same_slots_not_freed(ps):
    alloc, cache = make(ps)
    seq = list(range(2 * ps))
    _, s1 = insert_fresh(alloc, cache, seq)
    m = cache.match_prefix(seq + [5] * ps)
    assert m.length == 2 * ps
    cache.lock(m.node)
    extra = alloc.alloc(ps)
    free_before = alloc.free_slots
    row = torch.cat([m.slots, extra])
    # the matched slots are the tree's own: must not be freed (CheckedAllocator would
    # raise on the double free later, and the count would change now)
    assert cache.insert(seq + [5] * ps, row) == 2 * ps
    assert alloc.free_slots == free_before
    cache.unlock(m.node)
    assert cache.total_slots == 3 * ps
    assert alloc.free_slots + cache.total_slots == alloc.capacity
    assert cache.evict(alloc.capacity) == 3 * ps
    assert alloc.free_slots == alloc.capacity


def test_partial_page_overlap_rejected():
    ps = 4
    alloc, cache = make(ps)
    _, s = insert_fresh(alloc, cache, [1, 2, 3, 4])
    bogus = s[:4].clone()
    bogus[3] = 999
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3, 4], bogus)


def test_insert_length_mismatch_rejected():
    alloc, cache = make(1)
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], torch.tensor([5, 6]))


def test_insert_copies_slots():
    """The tree must not alias the caller's tensor (e.g. a req_to_token row view)."""
    alloc, cache = make(1)
    row = alloc.alloc(4)
    cache.insert([1, 2, 3, 4], row)
    expect = row.tolist()
    row.fill_(0)  # the request row gets reused
    assert cache.match_prefix([1, 2, 3, 4, 5]).slots.tolist() == expect
    # and the match result is the caller's to modify
    cache.match_prefix([1, 2, 3, 4, 5]).slots.fill_(0)
    assert cache.match_prefix([1, 2, 3, 4, 5]).slots.tolist() == expect


# ----------------------------------------------------------------------------- locking / eviction

@pytest.mark.parametrize("ps", [1, 4])
def test_lock_prevents_eviction(ps):
    alloc, cache = make(ps)
    a = [1] * (3 * ps)
    b = [1] * ps + [2] * (2 * ps)  # shares the first page with a
    _, sa = insert_fresh(alloc, cache, a)
    insert_fresh(alloc, cache, b)
    assert cache.total_slots == 5 * ps  # b's first page was a duplicate
    # lock a 2-page prefix of a: matching it splits a's edge below the shared page
    m = cache.match_prefix(a[:2 * ps] + [9])
    assert m.length == 2 * ps
    cache.lock(m.node)
    assert cache.evictable_slots == 3 * ps  # a's 3rd page + b's 2 own pages
    cache.check_invariants()
    # another match splitting above the locked node copies its lock count
    m2 = cache.match_prefix([1] * ps + [5])
    assert m2.length == ps
    cache.check_invariants()
    assert cache.evictable_slots == 3 * ps
    freed = cache.evict(alloc.capacity)
    assert freed == 3 * ps
    assert cache.total_slots == cache.locked_slots == 2 * ps
    assert cache.evictable_slots == 0
    assert cache.evict(alloc.capacity) == 0
    # locked KV still intact and matchable
    assert cache.match_prefix(a + [0]).slots.tolist() == sa[:2 * ps].tolist()
    # nested locks: two requests on the same node
    cache.lock(m.node)
    cache.unlock(m.node)
    assert cache.evict(1) == 0
    cache.unlock(m.node)
    assert cache.evictable_slots == 2 * ps
    assert cache.evict(alloc.capacity) == 2 * ps
    assert cache.total_slots == 0 and alloc.free_slots == alloc.capacity
    with pytest.raises(RuntimeError):
        cache.unlock(m.node)  # m.node is gone; its path is no longer locked


@pytest.mark.parametrize("ps", [1, 4])
def test_lru_order(ps):
    alloc, cache = make(ps)
    keys = {name: [v] * (2 * ps) for name, v in (("A", 1), ("B", 2), ("C", 3))}
    for k in keys.values():
        insert_fresh(alloc, cache, k)
    cache.match_prefix(keys["A"] + [0])  # touch A: order is now B, C, A

    def present():
        return {n for n, k in keys.items() if cache.match_prefix(k + [0]).length == 2 * ps}

    # present() touches keys itself (A before C), so it is only used once the order is moot
    assert cache.evict(1) == 2 * ps  # whole oldest leaf (B)
    assert {n for n, k in keys.items() if tuple(k) in tree_contents(cache)} == {"A", "C"}
    assert cache.evict(1) == 2 * ps  # C
    assert present() == {"A"}
    assert cache.evict(1) == 2 * ps
    assert present() == set()
    assert alloc.free_slots == alloc.capacity


def test_lru_leaves_before_parents_and_touch_by_insert():
    alloc, cache = make(1)
    insert_fresh(alloc, cache, [1, 2, 3, 4])
    insert_fresh(alloc, cache, [1, 2, 3, 5])   # edges: [1,2,3] -> {[4], [5]}
    insert_fresh(alloc, cache, [7, 7])
    insert_fresh(alloc, cache, [1, 2, 3, 4])   # re-insert touches [1,2,3,4] (dup freed)
    assert cache.total_slots == 7
    # LRU leaf is [5] (inner node [1,2,3] is not a leaf), then [7,7], then [4], then [1,2,3]
    assert cache.evict(1) == 1
    assert set(tree_contents(cache)) == {(1,), (1, 2), (1, 2, 3), (1, 2, 3, 4), (7,), (7, 7)}
    assert cache.evict(1) == 2
    assert set(tree_contents(cache)) == {(1,), (1, 2), (1, 2, 3), (1, 2, 3, 4)}
    assert cache.evict(2) == 4  # [4] then its parent [1,2,3] (whole nodes)
    assert cache.total_slots == 0 and alloc.free_slots == alloc.capacity


def test_evict_stops_when_enough():
    alloc, cache = make(1)
    for v in range(5):
        insert_fresh(alloc, cache, [v, v, v])
    assert cache.evict(4) == 6  # two whole 3-slot leaves
    assert cache.total_slots == 9
    assert cache.evict(0) == 0
    assert cache.total_slots == 9


# ----------------------------------------------------------------------------- disabled / reset

@pytest.mark.parametrize("ps", [1, 4])
def test_disabled(ps):
    alloc, cache = make(ps, enabled=False)
    seq = list(range(3 * ps + ps // 2))  # 3 whole pages (+ a partial one when ps > 1)
    slots = alloc.alloc(alloc.round_up(len(seq)))
    free0 = alloc.free_slots
    assert cache.insert(seq, slots[:len(seq)]) == 0
    assert alloc.free_slots == free0 + 3 * ps  # everything page aligned went back
    alloc.free(slots[3 * ps:])  # the tail is still the caller's
    m = cache.match_prefix(seq + [1])
    assert m.length == 0 and m.slots.numel() == 0
    cache.lock(m.node)
    cache.unlock(m.node)
    assert cache.total_slots == cache.evictable_slots == 0
    assert cache.evict(100) == 0
    assert alloc.free_slots == alloc.capacity
    cache.reset()


@pytest.mark.parametrize("ps", [1, 4])
def test_reset(ps):
    alloc, cache = make(ps)
    insert_fresh(alloc, cache, list(range(2 * ps)))
    insert_fresh(alloc, cache, [5] * (3 * ps))
    m = cache.match_prefix(list(range(2 * ps)) + [0])
    cache.lock(m.node)
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.unlock(m.node)
    cache.lock(m.node)
    cache.reset(free_slots=False)  # allocator untouched
    assert cache.total_slots == 0 and alloc.free_slots == alloc.capacity - 5 * ps
    cache.unlock(m.node)  # stale handle: ignored
    assert cache.match_prefix([5] * (4 * ps)).length == 0
    cache2 = RadixCache(alloc, ps)
    insert_fresh(alloc, cache2, [3] * (2 * ps))
    cache2.reset()
    assert cache2.total_slots == 0
    assert alloc.free_slots == alloc.capacity - 5 * ps


# ----------------------------------------------------------------------------- scheduler use

def test_scheduler_walkthrough():
    """The admission -> run -> finish protocol the scheduler follows, step by step."""
    ps = 4
    alloc, cache = make(ps, num_pages=16)  # capacity 60 slots
    cap = alloc.capacity

    def admit(prompt, max_new):
        m = cache.match_prefix(prompt)
        cache.lock(m.node)
        need = alloc.round_up(len(prompt) + max_new) - m.length
        new = alloc.alloc(need)
        if new is None:
            cache.evict(need - alloc.free_slots)
            new = alloc.alloc(need)
        assert new is not None
        return m, torch.cat([m.slots, new])

    def finish(m, seq, row, valid):
        cache.insert(seq[:valid], row[:valid])
        alloc.free(row[cache.aligned(valid):])
        cache.unlock(m.node)

    # request A: cold cache
    pa = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    ma, ra = admit(pa, 6)
    assert ma.length == 0 and ra.numel() == 16
    sa = pa + [11, 12, 13, 14, 15]
    finish(ma, sa, ra, len(sa) - 1)  # KV valid for 14 tokens -> 12 cached
    assert cache.total_slots == 12 and alloc.free_slots + cache.total_slots == cap

    # request B shares 9 tokens with A -> 8 (2 pages) reused
    pb = pa[:9] + [40, 41]
    mb, rb = admit(pb, 3)
    assert mb.length == 8 and mb.slots.tolist() == ra[:8].tolist()
    assert cache.locked_slots == 8
    # request C, identical prompt to D, admitted together: neither matches the other
    pc = [20] * 9
    mc, rc = admit(pc, 3)
    md, rd = admit(pc, 3)
    assert mc.length == md.length == 0
    in_use = alloc.capacity - alloc.free_slots - cache.total_slots  # private to requests
    assert in_use == (16 - 8) + 12 + 12
    # B finishes: its first 8 slots are the tree's own, nothing freed twice
    sb = pb + [42, 43]
    finish(mb, sb, rb, len(sb) - 1)
    # C finishes, then D: D's copy of the shared 8 tokens is a duplicate -> freed
    sc = pc + [21, 22]
    finish(mc, sc, rc, len(sc) - 1)
    free_before = alloc.free_slots
    total_before = cache.total_slots
    sd = pc + [21, 23]
    finish(md, sd, rd, len(sd) - 1)
    assert cache.total_slots == total_before  # D added nothing new (10 valid -> 8 aligned)
    assert alloc.free_slots == free_before + 12  # 8 duplicates + its 4-slot tail
    # invariants after all requests finished
    assert cache.locked_slots == 0
    assert alloc.free_slots + cache.total_slots == cap
    cache.check_invariants()
    total = cache.total_slots
    assert cache.evict(cap) == total
    assert cache.total_slots == 0 and alloc.free_slots == cap


# ----------------------------------------------------------------------------- randomized

class _Req:
    def __init__(self, prompt, match, row, seq, valid):
        self.prompt, self.match, self.row, self.seq, self.valid = prompt, match, row, seq, valid


@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_shared_prefixes(ps, seed):
    """Many random requests over a tiny vocab (prefixes collide). Every matched/cached slot
    must hold the KV of exactly its own prefix; allocator accounting must balance."""
    rng = random.Random(seed * 10 + ps)
    num_pages = 48 if ps == 4 else 120
    alloc, cache = make(ps, num_pages=num_pages)
    cap = alloc.capacity
    content: dict[int, tuple[int, ...]] = {}  # slot -> the prefix whose KV it holds
    active: list[_Req] = []
    stats = dict(hits=0, dup_freed=0, evicted=0, skipped=0, finished=0)

    def private_slots():
        s: set[int] = set()
        for r in active:
            s |= set(r.row[r.match.length:].tolist())
        return s

    def check_state():
        cache.check_invariants()
        held = tree_pages(cache)
        tree_slots = {s for v in held.values() for s in v}
        assert len(tree_slots) == len(held) * ps == cache.total_slots
        # every slot in the tree holds the KV of its own path
        for prefix, page in held.items():
            for j, slot in enumerate(page):
                assert content.get(slot) == prefix[:len(prefix) - ps + j + 1]
        priv = private_slots()
        assert not tree_slots & priv
        assert tree_slots | priv == alloc.outstanding_slots()
        assert alloc.free_slots + cache.total_slots + len(priv) == cap
        # everything a running request matched is still cached (locks hold)
        for r in active:
            assert set(r.match.slots.tolist()) <= tree_slots
        assert cache.locked_slots >= max((r.match.length for r in active), default=0)

    def start():
        plen = rng.randint(1, 6 * ps)
        prompt = [rng.randrange(2) for _ in range(plen)]
        m = cache.match_prefix(prompt)
        limit = cache.aligned(len(prompt) - 1)
        assert m.length == expected_match(cache, prompt, limit)
        assert m.length < len(prompt) and m.length % ps == 0
        assert m.slots.numel() == m.length
        for i, s in enumerate(m.slots.tolist()):
            assert content[s] == tuple(prompt[:i + 1]), "slot of another key returned"
        stats["hits"] += m.length > 0
        cache.lock(m.node)
        out = [rng.randrange(2) for _ in range(rng.randint(0, 2 * ps))]
        seq = prompt + out
        need = alloc.round_up(len(seq)) - m.length
        new = alloc.alloc(need)
        if new is None:
            short = need - alloc.free_slots
            ev_before = cache.evictable_slots
            freed = cache.evict(short)
            assert freed <= ev_before
            assert freed >= min(short, ev_before)
            stats["evicted"] += freed
            new = alloc.alloc(need)
            if new is None:
                assert alloc.free_slots + cache.evictable_slots < need
                cache.unlock(m.node)
                stats["skipped"] += 1
                return
        row = torch.cat([m.slots, new])
        valid = rng.randint(m.length, len(seq))
        # "compute" KV for positions [m.length, valid); the rest of the row is garbage
        for i in range(m.length, len(row)):
            s = row[i].item()
            if i < valid:
                content[s] = tuple(seq[:i + 1])
            else:
                content.pop(s, None)
        active.append(_Req(prompt, m, row, seq, valid))

    def finish(r: _Req):
        active.remove(r)
        held = tree_pages(cache)
        n = cache.aligned(r.valid)
        exp_present = expected_match(cache, r.seq, n)
        dup = sum(ps for k in range(ps, exp_present + 1, ps)
                  if held[tuple(r.seq[:k])] != r.row[k - ps:k].tolist())
        free_before = alloc.free_slots
        total_before = cache.total_slots
        ret = cache.insert(r.seq[:r.valid], r.row[:r.valid])
        assert ret == exp_present
        assert alloc.free_slots - free_before == dup
        assert cache.total_slots - total_before == n - ret
        stats["dup_freed"] += dup
        alloc.free(r.row[n:])
        cache.unlock(r.match.node)
        stats["finished"] += 1

    for _ in range(600):
        x = rng.random()
        if x < 0.5 and len(active) < 6:
            start()
        elif x < 0.92 and active:
            finish(rng.choice(active))
        else:
            ev_before = cache.evictable_slots
            k = rng.randint(1, 4 * ps)
            freed = cache.evict(k)
            assert freed <= ev_before and freed >= min(k, ev_before)
            stats["evicted"] += freed
        check_state()

    while active:
        finish(active[0])
        check_state()
    assert cache.locked_slots == 0
    assert alloc.free_slots + cache.total_slots == cap
    total = cache.total_slots
    assert cache.evict(cap) == total
    assert cache.total_slots == 0 and alloc.free_slots == cap and not alloc.outstanding
    # the run actually exercised sharing, duplicate freeing and eviction
    assert stats["hits"] > 20, stats
    assert stats["dup_freed"] > 0, stats
    assert stats["evicted"] > 0, stats
    assert stats["finished"] > 100, stats
