"""Continuous batching: the forwards of concurrent generations run together, one pass per weight set.

Every generation (Engine.tokens, in whatever thread calls it) runs as a `Seq`: its own paged KV
cache (qspec/kv_cache.py) over the model's pool, and a backend view whose `forward` is handed to
the model's Batcher instead of running at once. The speculation code (chains, levels, trees) is
the same for one sequence as for many: it calls forward and gets its logits back.

The Batcher runs a step as soon as every admitted sequence is waiting for a forward (or paused,
its generator suspended at a yield): the waiting passes are grouped by weight set (the target,
each MX draft) and each group is one native forward over a ragged batch (csrc/model.cpp), so
the GEMMs stream the weights once for all of its rows. While any sequence still drafts, a step
runs only the cheapest draft level's passes and the target's wait: the sequences draft in step
and verify in one forward a round (a target forward streams ~3.7x an MXFP4 draft's bytes), and
beside others each takes one draft length and tree shape a round (SeqBackend.round): `qspec
bench batch` (README, "Speculation beside other sequences"). Sequences join (admission, when the
pool has pages for the prompt and a slot is free) and leave at step boundaries. Every op of a pass is
batch-invariant (docs/architecture.md), so a sequence's rows, hence its greedy output, are the same
whatever else runs in the step.

Prompts are prefilled in chunks when other sequences are running (`prefill_chunk`): a chunk
costs about one step and rides with the target's passes (not with draft passes), so a long prompt
adds about one step to each speculation round of the running streams instead of stalling them. When a sequence needs a
page and the pool's budget is spent, the newest sequence is preempted: its pages are freed and
it starts again later from its prompt and the tokens it already produced (greedy: the same
tokens follow).
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from .kv_cache import KVCache, Preempted

MIN_CHUNK = 8  # prefill rows per step at least, with other sequences running
# Prompt rows per pass at most, also alone: a pass's activations grow with its rows (~130 KB a
# row for Qwen2.5-Coder-1.5B: a 32k-token prompt in one pass held ~4 GB of them), while the
# GEMMs run at their full rate from a few hundred rows on and chunks keep every row's bits.
PREFILL_ROWS = 2048


@dataclass(eq=False)
class Pass:
    """One sequence's rows for a forward of one weight set."""

    kv: KVCache
    tokens: np.ndarray
    start_pos: int
    all_logits: bool
    tree: tuple | None
    draft_q8: bool = False
    target_rows: bool = False  # rows of the target, recorded for the prefix cache once written
    prefill: bool = False
    weight_set: int = 0
    cost: float = 0.0  # seconds: its rows' share of its weight set's forward + its share of the gap
    out: np.ndarray | None = None
    error: BaseException | None = None


@dataclass(eq=False)
class Seq:
    """A generation admitted to the batcher."""

    kv: KVCache
    order: int
    state: str = "running"  # running (its Python), waiting (a forward), paused (at a yield)
    passes: list = field(default_factory=list)


class Batcher:
    """Runs the forwards of a backend's concurrent sequences together (see the module doc).

    `max_seqs`: sequences admitted at once (1 serializes generations: helper levels and tensor
    parallelism keep caches that are not per sequence). `min_free_pages`: pages a new sequence
    needs free beyond its prompt's to be admitted."""

    def __init__(self, backend, max_seqs: int = 16, min_free_pages: int = 4):
        self.backend = backend
        self.pool = backend.pool
        self.cv = threading.Condition(self.pool.lock)
        self.max_seqs = max_seqs
        self.min_free_pages = min_free_pages
        self.live: list[Seq] = []
        self._order = itertools.count()
        self.steps = 0
        self.rounds = 0  # steps that ran target decode passes (verifies, plain steps)
        # step cost: an EMA of a step without prefill rows, and of one prefill row (seconds)
        self._step_s: float | None = None
        self._row_s: float | None = None
        self._last_end: float | None = None

    # ---------------------------------------------------------------- admission
    def open(self, prompt_tokens: int) -> Seq:
        """Admit a new sequence once a slot is free and the pool has pages for `prompt_tokens`
        (waits; a sequence running alone is always admitted)."""
        need = -(-prompt_tokens // self.pool.page_size) + self.min_free_pages
        with self.cv:
            while len(self.live) >= self.max_seqs or (self.live and self.pool.free_pages() < need):
                self.cv.wait(0.5)
            seq = Seq(KVCache(self.pool), next(self._order))
            seq.kv.on_exhausted = self._exhausted
            self.live.append(seq)
            return seq

    def close(self, seq: Seq) -> None:
        """The sequence leaves: its pages go back to the pool (indexed prefixes stay listed)."""
        with self.cv:
            seq.kv.release()
            if seq in self.live:
                self.live.remove(seq)
            self.cv.notify_all()

    def pause(self, seq: Seq) -> None:
        with self.cv:
            seq.state = "paused"
            self.cv.notify_all()

    def resume(self, seq: Seq) -> None:
        with self.cv:
            seq.state = "running"

    def others(self, seq: Seq) -> int:
        return sum(1 for s in self.live if s is not seq)

    def prefill_chunk(self, seq: Seq) -> int:
        """Prompt rows `seq` should send in its next pass: PREFILL_ROWS when it runs alone, else
        about one step's worth of rows (measured), at least MIN_CHUNK and at most PREFILL_ROWS."""
        if not self.others(seq):
            return PREFILL_ROWS
        if self._step_s is None or self._row_s is None:
            return MIN_CHUNK  # until a step and a prefill row are measured
        return min(PREFILL_ROWS, max(MIN_CHUNK, int(self._step_s / self._row_s) // 8 * 8))

    def _exhausted(self, kv: KVCache) -> None:
        """kv needs a page and the budget is spent: preempt the newest sequence (kv's own when it
        is the newest: Preempted)."""
        victim = max(self.live, key=lambda s: s.order, default=None)
        if victim is None or victim.kv is kv:
            raise Preempted("the KV cache is full")
        victim.kv.preempt()
        for p in victim.passes:
            p.error = Preempted("preempted for an older sequence")
        victim.passes = []
        self.live.remove(victim)  # its thread starts it again (Engine._tokens)
        self.cv.notify_all()

    # ---------------------------------------------------------------- steps
    def submit(self, seq: Seq, p: Pass, weight_set: int) -> np.ndarray:
        """Queue a pass and wait for its logits; runs the step when this is the last one."""
        with self.cv:
            seq.kv._check()
            p.weight_set = weight_set
            seq.passes.append(p)
            seq.state = "waiting"
            try:
                while p.out is None and p.error is None:
                    if self._ready():
                        self._step()
                    else:
                        self.cv.wait()
            finally:
                seq.state = "running"
                if p in seq.passes:
                    seq.passes.remove(p)
        if p.error is not None:
            raise p.error
        return p.out

    def _ready(self) -> bool:
        return any(s.passes for s in self.live) and all(s.state != "running" for s in self.live)

    def _step(self) -> None:
        """One step: every waiting pass, one native forward per weight set (under the pool lock,
        so no page moves while it runs)."""
        passes = [p for s in self.live for p in s.passes]
        top = max((p.weight_set for p in passes if not p.prefill), default=0)
        if top:
            # only the passes of the cheapest draft level waiting: the passes of the levels below
            # (the target's verifies, prompt chunks) wait until every sequence has drafted, so the
            # sequences stay in step (one verify forward a round for all, each draft forward
            # holding all their rows) however their prompts, draft lengths or trees differ
            passes = [p for p in passes if not p.prefill and p.weight_set == top]
        for s in self.live:
            if any(p in passes for p in s.passes):
                s.state = "running"  # its thread runs as soon as it wakes: no step without it
            s.passes = [p for p in s.passes if p not in passes]
        t0 = time.perf_counter()
        # the sequences' own time since the last step (acceptance, sampling, the rendezvous),
        # one share per pass, is part of what each pass costs (SeqBackend.clock)
        gap = t0 - self._last_end if self._last_end is not None else 0.0
        for weight_set in sorted({p.weight_set for p in passes}):
            group = [p for p in passes if p.weight_set == weight_set]
            t = time.perf_counter()
            try:
                for p, out in zip(group, self.backend.run(group, weight_set)):
                    p.out = out
                rows, t = sum(len(p.tokens) for p in group), time.perf_counter() - t
                for p in group:
                    p.cost = t * len(p.tokens) / rows + gap / len(passes)
            except Exception:  # noqa: BLE001 - each pass alone: only the one at fault fails
                for p in group:
                    try:
                        p.out = self.backend.run([p], weight_set)[0]
                    except Exception as e:  # noqa: BLE001 - raised in its sequence's thread
                        p.error = e
        self._last_end = time.perf_counter()
        self.rounds += any(p.weight_set == 0 and not p.prefill for p in passes)
        self._observe(passes, self._last_end - t0)
        self.steps += 1
        self.cv.notify_all()

    def _observe(self, passes: list[Pass], seconds: float) -> None:
        prefill = sum(len(p.tokens) for p in passes if p.prefill)
        ema = lambda old, new: new if old is None else 0.8 * old + 0.2 * new  # noqa: E731
        if not prefill:
            self._step_s = ema(self._step_s, seconds)
        elif self._step_s is not None and seconds > self._step_s:
            self._row_s = ema(self._row_s, (seconds - self._step_s) / prefill)


class SeqBackend:
    """A backend as one sequence sees it: its own cache (`kv`); forwards go through the Batcher.
    Everything else (weight sets, bytes, kernel path, ...) is the model backend's."""

    def __init__(self, batcher: Batcher, seq: Seq):
        self._batcher, self._seq = batcher, seq
        self.kv = seq.kv
        self._cost = 0.0

    def clock(self) -> float:
        """Seconds for the cost models: the sum of this sequence's shares of the steps it took
        part in (each forward's time split by rows, the time between steps split by passes), so
        that beside other sequences a draft length is weighed by what its rows and round trips
        cost the batch, not by the waits for the other sequences' passes. Alone, a step is all
        its own: the clock runs as wall time does, from step to step."""
        return self._cost

    def batch(self) -> int:
        """The batch size class now: 1, 2, 4, 8, .. sequences (the live ones, rounded up)."""
        return 1 << self._batcher.others(self._seq).bit_length()

    @property
    def round(self) -> int | None:
        """Beside other sequences, the batch's round (target steps so far): the sequences of a
        batch size class take one draft length and tree shape a round (CostModel.choose,
        TreeCost.arm), so they draft in step and verify in one forward; None alone."""
        return self._batcher.rounds if self._batcher.others(self._seq) else None

    def __getattr__(self, name):
        return getattr(self._batcher.backend, name)

    def forward(self, tokens, start_pos: int, *, all_logits: bool = False, draft: bool | int = False,
                tree=None, prefill: bool = False) -> np.ndarray:
        """As the model backend's forward, for this sequence's rows (pages are added as needed)."""
        be = self._batcher.backend
        p = be.prepare(self.kv, tokens, start_pos, all_logits=all_logits, draft=draft, tree=tree)
        p.prefill = prefill
        out = self._batcher.submit(self._seq, p, int(draft))  # [m or 1, vocab rows], as asked
        self._cost += p.cost
        return out
