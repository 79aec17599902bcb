"""Structured outputs on a rank: one grammar matcher per request row that has a grammar.

The front end compiles each grammar (serve_app/text/grammar.py, off the step loop) and the
scheduler ships it serialized when it admits the request, with the tokens the request
has emitted so far (a preempted one comes back with them). The matchers live here, beside
the logits, because under speculation the masks depend on the draft tree, which exists
only inside the step: each tree node's target logits are masked by the grammar state
after that node's path (xgrammar walks the tree, accepting and rolling back), so the
token verify accepts at a node is the one plain decoding would pick there. Draft tokens
the grammar forbids are never accepted, as the masked target never picks them.

Rows without a matcher are unconstrained. A matcher that has terminated (its stop token
accepted) masks nothing: the scheduler ends that request on the token, and a plan sent
before it learnt so may still hold the row.

The host work of a step is kept off the device's path. Step N+1 is launched before step
N has finished (actors/worker/step_channel.py), grammar rows or not: the rank hands each launched
step here (`launched`), and its emitted tokens are accepted by the matchers only when a
later step needs masks, after that step's forward is queued (so on the GPU the wait for
N's tokens and the matchers' work run beside N+1's forward, not between steps), or when
N finishes, whichever comes first (`settle`): once each, in launch order. Masks are
filled into one pinned buffer (all matchers at once, BatchGrammarMatcher) and go up in
one copy that does not wait for the device.
"""
from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Protocol

import torch

log = logging.getLogger("kestrel.grammar")


# Compiled grammars kept deserialized, by their serialized form: a JSON schema's takes
# 1.7-2.4 ms to deserialize on the development CPU, on the step thread, so a burst of 64
# requests with one schema would stall a step by 0.1 s.
_KEPT_GRAMMARS = 64


def _xgrammar():
    import xgrammar
    return xgrammar


class Launched(Protocol):
    """A launched step as the matchers need it (actors/worker/launched_step.py LaunchedStep)."""

    def tokens(self) -> list[list[int]]:
        """Each plan row's emitted tokens, waiting for the device the first time."""


def _feed(m, tokens) -> tuple[bool, bool]:
    """Feed `tokens` to matcher `m`, up to its end: tokens after its stop token are not
    offered (a row planned before the scheduler learnt that its request ended, or one
    that ignores EOS, emits them; xgrammar would refuse each with a warning) -> (ok: False
    when it rejected one; ended: it has accepted its stop token)."""
    for t in tokens:
        if not m.accept_token(int(t)):
            return False, False
        if m.is_terminated():
            return True, True
    return True, False


class GrammarRows:
    def __init__(self, threads: int = 1):
        self.info = None  # xgrammar.TokenizerInfo (set_vocab)
        self._vocab_json: str | None = None
        self._compiled: dict[str, object] = {}  # serialized -> xgrammar.CompiledGrammar, LRU
        self.threads = threads
        self._batch = None  # xgrammar.BatchGrammarMatcher
        self._pool: ThreadPoolExecutor | None = None  # the tree walks' threads, with threads > 1
        self.matchers: dict[int, object] = {}  # row -> xgrammar.GrammarMatcher
        # Rows whose matcher has accepted its stop token, noted as it is accepted: asking
        # every live matcher again each step cost 64 calls (23 us on the development CPU).
        self._ended: set[int] = set()
        # Launched steps whose tokens the matchers have not accepted yet, oldest first, each
        # with (plan position, row, matcher) of its grammar rows at launch. Held by matcher,
        # not by row: a later plan may reset the row for another request before they settle.
        self._unsettled: deque[tuple[Launched, list[tuple[int, int, object]]]] = deque()
        # Called when masks had to wait for steps before (their tokens are now on the host):
        # the step channel answers those steps then, not after this launch, so the engine
        # plans the step after next while the masks are walked (RankWorker.on_steps_back).
        self.on_settled: Callable[[], None] | None = None
        self._host: torch.Tensor | None = None  # [L, W] int32 pinned on a GPU rank, grown as needed
        self._uploaded = None  # torch.cuda.Event after the last copy out of _host

    @staticmethod
    def preload() -> None:
        """Import xgrammar now (start-up): 0.8 s on the development CPU, 1.4-2 s on the
        H200's host, which the first grammar request's step spent with every stream of
        the rank waiting. Without xgrammar installed (a training machine) this says so;
        a grammar that reaches the rank then fails on the same import."""
        try:
            _xgrammar()
        except ModuleNotFoundError as e:
            log.warning("structured outputs unavailable: %s", e)

    def set_vocab(self, vocab_json: str) -> None:
        """The tokenizer as xgrammar knows it: at start-up from a served replica, or with
        the first grammar plan of an engine whose workers were not given it. The same
        vocabulary again is kept, with the compiled grammars deserialized for it."""
        if vocab_json == self._vocab_json:
            return
        self.info = _xgrammar().TokenizerInfo.deserialize_json(vocab_json)
        self._vocab_json = vocab_json
        self._compiled.clear()

    def _grammar(self, compiled: str):
        """The deserialized compiled grammar, kept for the next request that brings it."""
        g = self._compiled.pop(compiled, None)
        if g is None:
            g = _xgrammar().CompiledGrammar.deserialize_json(compiled, self.info)
            if len(self._compiled) >= _KEPT_GRAMMARS:
                self._compiled.pop(next(iter(self._compiled)))
        self._compiled[compiled] = g  # most recent last
        return g

    def reset(self, row: int, compiled: str | None, tokens) -> None:
        """Row `row` starts a request: its serialized compiled grammar (None: none) and the
        tokens it has emitted before (replayed into the fresh matcher)."""
        self.matchers.pop(row, None)
        self._ended.discard(row)
        if compiled is None:
            return
        if self.info is None:
            raise RuntimeError("a grammar arrived before the grammar vocabulary")
        m = _xgrammar().GrammarMatcher(self._grammar(compiled))
        ok, ended = _feed(m, tokens)
        if not ok:
            raise RuntimeError(f"row {row}: the grammar rejects its own earlier tokens")
        self.matchers[row] = m
        if ended:
            self._ended.add(row)

    def any(self, rows: list[int]) -> bool:
        return bool(self.matchers) and any(r in self.matchers for r in rows)

    def launched(self, step: Launched, rows: list[int]) -> None:
        """`step` was launched for `rows` (after its plan's resets): the matchers those rows
        hold now are to accept its tokens (settle)."""
        if self.matchers:
            held = [(i, row, self.matchers[row]) for i, row in enumerate(rows) if row in self.matchers]
            if held:
                self._unsettled.append((step, held))

    def settle(self, through: Launched | None = None) -> None:
        """Accept the tokens of launched steps not settled yet, oldest first (waiting for the
        device where they are not back yet): all of them (a step about to fill its masks,
        which is not among them yet), or those up to `through` (a step that finished;
        nothing when it has settled already)."""
        if through is not None and all(step is not through for step, _ in self._unsettled):
            return
        while self._unsettled:
            step, held = self._unsettled.popleft()
            tokens = step.tokens()
            for i, row, m in held:
                if self.matchers.get(row) is not m or row in self._ended:
                    continue  # its request has ended or left the row: the matcher masks no more
                ok, ended = _feed(m, tokens[i])
                if not ok:
                    log.error("row %d: the grammar rejected an emitted token; unconstrained from here", row)
                    del self.matchers[row]
                elif ended:
                    self._ended.add(row)
            if step is through:
                return

    def _live(self, rows: list[int]) -> list[tuple[int, object]]:
        """(position in rows, matcher) of the rows whose grammar still constrains them, after
        every step launched before has been settled."""
        waited = bool(self._unsettled)
        self.settle()
        if waited and self.on_settled is not None:
            self.on_settled()
        return [(i, self.matchers[row]) for i, row in enumerate(rows)
                if row in self.matchers and row not in self._ended]

    def _buffer(self, rows: int, device: torch.device, ones: list[int] | None = None) -> torch.Tensor:
        """[rows, W] int32 host buffer, free to write: the copy out of it that an earlier step
        queued has run. Rows `ones` (all when None) are all ones: every id allowed."""
        if self._uploaded is not None:
            # Done by now: the step that queued it has finished, or settled (its tokens
            # came down behind it) before these masks.
            self._uploaded.synchronize()
        W = _xgrammar().get_bitmask_shape(1, self.info.vocab_size)[1]
        if self._host is None or self._host.shape[0] < rows:
            self._host = torch.empty((rows, W), dtype=torch.int32, pin_memory=device.type == "cuda")
        host = self._host[:rows]
        # numpy's fill is a plain memset on this thread. torch's fill_ (the rank's intra-op
        # threads) was where py-spy found a third of a plain batch-64 grammar step on the
        # H200 host.
        if ones is None:
            host.numpy().fill(-1)
        elif ones:
            host.numpy()[ones] = -1
        return host

    def _upload(self, host: torch.Tensor, out: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        """The filled host masks on `device` (into `out` when given), without waiting."""
        if device.type != "cuda":
            return host.clone() if out is None else out.copy_(host)
        out = torch.empty(host.shape, dtype=host.dtype, device=device) if out is None else out
        out.copy_(host, non_blocking=True)
        self._uploaded = torch.cuda.Event()
        self._uploaded.record()
        return out

    def next_masks(self, rows: list[int], device: torch.device) -> torch.Tensor | None:
        """The next token's bitmask per row -> [B, W] int32 on `device` (all ones for rows
        without a live grammar), or None when no row has one."""
        live = self._live(rows) if self.any(rows) else []
        if not live:
            return None
        filled = {i for i, _ in live}  # the batch fill writes these rows whole
        host = self._buffer(len(rows), device, [i for i in range(len(rows)) if i not in filled])
        if self._batch is None:
            self._batch = _xgrammar().BatchGrammarMatcher(self.threads)
        self._batch.batch_fill_next_token_bitmask([m for _, m in live], host, [i for i, _ in live])
        return self._upload(host, None, device)

    def copy_tree(self, rows: list[int], tokens: torch.Tensor, first_child: torch.Tensor,
                  next_sibling: torch.Tensor):
        """Start moving the tree of the rows to the host (tokens / first_child / next_sibling
        [B, N] int64, B >= len(rows): padded lanes after them; node 0 is the root, the
        request's last emitted token, which its matcher has accepted), or None when no row
        has a grammar. The copy is queued behind the draft, so the walk (tree_masks) can
        run on the host while the target's verify forward runs on the device."""
        if not self.any(rows):
            return None
        stacked = torch.stack([tokens[:len(rows)], first_child[:len(rows)],
                               next_sibling[:len(rows)]])  # [3, b, N] int64
        if stacked.is_cuda:
            host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
            host.copy_(stacked, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        else:
            host, done = stacked, None
        return rows, tokens.shape[1], host, done, tokens.device

    def fits(self, words: int) -> bool:
        """Whether masks fit a buffer of `words` int32 per node (the model's vocabulary may be
        wider than the tokenizer's, never narrower)."""
        return self.info is not None and _xgrammar().get_bitmask_shape(1, self.info.vocab_size)[1] <= words

    def tree_masks(self, copied, lanes: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """Per tree node, the bitmask of the token after the node's path -> [lanes, N, W]
        int32 on the device (lanes: the rows', or more for padded lanes), into `out` when
        given (copy_tree's handle; None -> None). Nodes the walk does not reach (a forbidden
        token on their path), rows without a live grammar and padded lanes stay all ones:
        verify never accepts the first, the others are free. An `out` wider than the masks
        gets zeros past them: ids past the tokenizer's are disallowed, as
        mask_logits_ does for a narrower mask."""
        if copied is None:
            return None
        rows, N, host, done, device = copied
        live = self._live(rows)  # the steps before accepted while the draft and verify run
        lanes = lanes or len(rows)
        masks = self._buffer(lanes * N, device).view(lanes, N, -1)  # int32
        if done is not None:
            done.synchronize()
        # numpy views per row: a torch index costs about 2 us, and four per row were 40% of a
        # batch-64 walk (64 trees of 8 nodes: 1.34 ms with torch views, 0.83 with numpy's).
        tree, out_np = host.numpy(), masks.numpy()  # [3, b, N] int64, [lanes, N, W] int32
        walk = lambda i, m: m.traverse_draft_tree(tree[1, i], tree[2, i], tree[0, i], out_np[i])
        if self.threads > 1 and len(live) > 1:
            # xgrammar's walk releases the GIL: rows split over threads walk in parallel
            # (64 trees of 8 nodes, regex: 1.85 ms on one thread, 1.01 on two, 2-core CPU).
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kestrel-grammar")
            chunks = [live[k::self.threads] for k in range(self.threads)]
            list(self._pool.map(lambda chunk: [walk(i, m) for i, m in chunk], chunks))
        else:
            for i, m in live:
                walk(i, m)
        if out is not None and out.shape[-1] > masks.shape[-1]:
            out[..., masks.shape[-1]:] = 0
            out = out[..., :masks.shape[-1]]
        return self._upload(masks, out, device)
