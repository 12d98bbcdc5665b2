"""Self-speculative decoding: the acceptance rules and the cost model that picks the draft length.

Both passes share one KV cache (docs/architecture.md). A step, at committed length L with `tok` (the last
emitted token, not yet in the cache):
  1. draft:  for j < K: forward([prev], L + j, draft weights) -> d_{j+1}; writes provisional K/V
  2. verify: forward([tok, d1..dK], L, target weights) -> K+1 rows of logits; overwrites L..L+K
  3. accept: greedy -> the longest prefix with d_j == argmax row j-1, then the target's token;
             sampling -> Leviathan et al. 2023 rejection sampling (see _accept_sampled)
  4. commit: length = L + 1 + accepted (rollback of the rest = not counting it)
Greedy output equals plain greedy token for token because every op is batch-invariant: row j of
the verify pass is computed bit-identically to a one-row target step at position L + j.
The loop itself, for one draft level or a chain of them, is qspec/levels.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .sampling import SamplingParams, sample, warp

DRAFT_MAX_LIMIT = 32


@dataclass(frozen=True)
class DraftParams:
    draft_max: int | str = 4     # fixed K, or "auto" (cost model below)
    draft_min: int = 1           # never verify fewer drafted tokens than this (p_min cannot cut below)
    draft_p_min: float = 0.0     # stop drafting when the draft's top-1 probability is below this

    def __post_init__(self) -> None:
        k = self.draft_max
        if k != "auto" and (not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= DRAFT_MAX_LIMIT):
            raise ValueError(f"draft_max must be an integer in 1..{DRAFT_MAX_LIMIT} or 'auto', got {k!r}")
        if not isinstance(self.draft_min, int) or not 1 <= self.draft_min <= DRAFT_MAX_LIMIT:
            raise ValueError(f"draft_min must be an integer in 1..{DRAFT_MAX_LIMIT}, got {self.draft_min!r}")
        if k != "auto" and self.draft_min > k:
            raise ValueError(f"draft_min ({self.draft_min}) must not exceed draft_max ({k})")
        if not (0.0 <= self.draft_p_min <= 1.0):
            raise ValueError(f"draft_p_min must be in [0, 1], got {self.draft_p_min!r}")

    @property
    def k_cap(self) -> int:
        return DRAFT_MAX_LIMIT if self.draft_max == "auto" else int(self.draft_max)


class PerRound:
    """One decision a batch round: beside other sequences (a round given: SeqBackend.round) the
    first call of a round decides and the rest of that round get the same value, so the batch
    drafts in step (qspec/batch.py); alone (round None) every call decides."""

    def __init__(self):
        self.round: int | None = None
        self.value = None

    def get(self, round: int | None, decide: Callable[[], object]):
        if round is None or round != self.round:
            self.round, self.value = round, decide()
        return self.value


class CostModel:
    """Chooses K to maximise expected tokens per second (docs/benchmarking.md: speedup = tau / (K c + v(K))).

    Everything is measured on this machine, in seconds, and kept across generations (the engine
    holds one model per draft setting): t_d (one draft step) and the verify curve t_v(M) (an
    EMA per row count M seen; between seen counts it is interpolated piecewise-linearly, beyond
    them extended with the slope of the last two points), and the acceptance of each draft
    position j given that positions 1..j-1 were accepted, a_j (decayed counts; a position not
    tried yet takes the estimate of the one before it). Acceptance is bursty — a draft that got
    j tokens right is in an easy stretch and likely to get the next one too — so a_j grows with
    j, and one pooled per-token rate would under-rate long drafts. The verify cost is not a
    line: on AVX2 a few rows ride on the weight stream and then every row costs FMAs, with AMX
    tiles 16 rows cost about one. tau(K) = 1 + sum_{k<=K} prod_{j<=k} a_j; the K with the highest
    tau(K) / (K t_d + t_v(K+1)) wins. The first steps try a few K values so that t_v has points;
    after that, when the best K's neighbour K+1 was never verified, it is tried once, so the
    curve is measured where the choice is made. A skippable model (a draft level above the
    first, or an n-gram level) also weighs K = 0, the pass of the level below alone: 1 / t_v(1).
    """

    DECAY = 0.97  # ~30-step memory: acceptance drifts with the text being written
    PRIOR = 2.0   # trials' worth of weight each a_j takes from the position before it
    PROBE_EVERY = 8  # a skipping level drafts again after this many skipped steps, to keep a_j current
    SHARED_MARGIN = 1.25

    def __init__(self, byte_ratio: float, k_max: int, k_min: int, skippable: bool = False, shared_by: int = 1):
        """`shared_by`: the sequences that consult this model at once (a batch size class,
        qspec/batch.py); they take one K a round (choose)."""
        self.k_min, self.k_max = k_min, k_max
        # beside other sequences, drafting must beat the plain step by SHARED_MARGIN: the
        # shares it is fed leave out what a draft step costs everyone (one more rendezvous and
        # forward per step; measured on Zen 3 with 8 sequences: drafting at a predicted break-even
        # gave 15% less aggregate throughput than not drafting)
        self.margin = 1.0 if shared_by == 1 else self.SHARED_MARGIN
        self.byte_ratio = byte_ratio
        # skippable: choose() may return 0 (no drafting this step) when the pass alone, at
        # t_v(1) per token, beats the best K; K = 0 is then explored like the others
        self.skippable = skippable
        self._skips = 0
        self._per_round = PerRound()
        self.hits, self.trials = 7.0, 10.0  # pooled: prior a = 0.7, worth ten trials
        self.pos_hits = [0.0] * k_max      # per draft position j (index j - 1)
        self.pos_trials = [0.0] * k_max
        self.t_draft: float | None = None
        self.t_verify: dict[int, float] = {}  # rows M -> seconds (EMA)
        self._explore = ([k for k in (1, 2, 4, 3) if k_min <= k <= k_max] or [k_min]) + ([0] if skippable else [])

    @staticmethod
    def _ema(old: float | None, new: float, w: float = 0.25) -> float:
        return new if old is None else (1 - w) * old + w * new

    def observe(self, drafted: int, accepted: int, draft_s: float, verify_s: float, rows: int | None = None) -> None:
        """One step: `drafted` tokens proposed, `accepted` of them kept, and the verify pass of
        `rows` rows (default drafted + 1; more when prompt-lookup candidates joined it)."""
        if drafted:
            self.hits = self.DECAY * self.hits + accepted
            self.trials = self.DECAY * self.trials + accepted + (accepted < drafted)
            for j in range(self.k_max):  # positions 1..accepted hit, accepted+1 missed (if drafted)
                tried = j < min(accepted + 1, drafted)
                self.pos_hits[j] = self.DECAY * self.pos_hits[j] + (j < accepted)
                self.pos_trials[j] = self.DECAY * self.pos_trials[j] + tried
            self.t_draft = self._ema(self.t_draft, draft_s / drafted)
        m = drafted + 1 if rows is None else rows
        self.t_verify[m] = self._ema(self.t_verify.get(m), verify_s)

    def acceptance(self) -> list[float]:
        """a_j for j = 1..k_max: each shrunk toward the one before it (a_1 toward the pooled rate)."""
        out, prev = [], self.hits / self.trials
        for h, t in zip(self.pos_hits, self.pos_trials):
            prev = min(max((h + self.PRIOR * prev) / (t + self.PRIOR), 0.0), 0.995)
            out.append(prev)
        return out

    def verify_seconds(self, m: int) -> float:
        """t_v(m): measured, else interpolated between the nearest measured row counts, else
        extended from the two nearest (never decreasing with m; one point: +10% per row)."""
        if m in self.t_verify:
            return self.t_verify[m]
        pts = sorted(self.t_verify.items())
        if len(pts) == 1:
            m0, t0 = pts[0]
            return t0 * max(0.1, 1 + 0.1 * (m - m0))
        lo = [p for p in pts if p[0] < m]
        hi = [p for p in pts if p[0] > m]
        (m0, t0), (m1, t1) = (lo[-1], hi[0]) if lo and hi else (pts[-2], pts[-1]) if lo else (pts[0], pts[1])
        slope = max(0.0, (t1 - t0) / (m1 - m0))
        return max(1e-9, t0 + slope * (m - m0))

    def choose(self, round: int | None = None) -> int:
        """K for the next draft; beside other sequences one K a batch `round` (PerRound), so the
        batch explores, skips and probes once a round."""
        return self._per_round.get(round, self._choose)

    def _choose(self) -> int:
        if self._explore or not self.t_verify:
            return self._explore.pop(0) if self._explore else self.k_min
        t_d = self.t_draft if self.t_draft is not None else self.byte_ratio * self.verify_seconds(1)
        best_k, best = self.k_min, -1.0
        tau, reach = 1.0, 1.0
        for k, a in enumerate(self.acceptance(), start=1):
            reach *= a  # P(the first k drafts are all accepted)
            tau += reach
            if k >= self.k_min:
                rate = tau / (k * t_d + self.verify_seconds(k + 1))
                if rate > best:
                    best_k, best = k, rate
        if self.skippable and best * self.verify_seconds(1) < self.margin and self._skips < self.PROBE_EVERY:
            self._skips += 1
            return 0
        self._skips = 0
        if best_k < self.k_max and best_k + 2 not in self.t_verify:
            return best_k + 1  # the curve just past the choice was never measured: measure it
        return best_k


def _accept_sampled(drafts: list[int], qs: list[np.ndarray | None], p_rows: np.ndarray,
                    params: SamplingParams, gen: np.random.Generator,
                    warped: list | None = None) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al. 2023, Chen et al. 2023): returns (accepted, next).

    Draft token x ~ q is kept with probability min(1, p(x)/q(x)); at the first rejection the
    replacement is drawn from normalize(max(0, p - q)); after K acceptances the bonus token is
    drawn from p of the last row. The emitted tokens are then distributed exactly as p.
    A q of None is a deterministic proposal (q = one-hot at x, e.g. an n-gram's): x is kept with
    probability p(x), and the replacement is drawn from p without x.
    `warped`, when given, receives p of each row used (accepted + 1 rows): the distributions of
    the emitted tokens, which a level that drafts for another passes down as its q.
    """
    for j, (x, q) in enumerate(zip(drafts, qs)):
        p = warp(p_rows[j], params)
        if warped is not None:
            warped.append(p)
        u = gen.random()
        if u * (1.0 if q is None else float(q[x])) < float(p[x]):  # u < p/q without dividing by a zero q
            continue
        if q is None:
            residual = p.copy()
            residual[x] = 0.0
        else:
            residual = np.maximum(p - q, 0.0)
        total = float(residual.sum())
        return j, sample(residual / total if total > 0 else p, gen)
    p = warp(p_rows[len(drafts)], params)
    if warped is not None:
        warped.append(p)
    return len(drafts), sample(p, gen)
