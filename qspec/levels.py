"""Multi-level drafting: a chain of drafters above the target, each drafting for the one below.

Level 0 is the BF16 target; level i >= 1 drafts for level i-1. A level with weights (the target,
an MX cast of the target's own weights) runs one batched pass over [last, d1..dm] to check the m
tokens the level above it drafted (M = m + 1 rows), exactly as the target verifies level 1:
greedy keeps the longest prefix it agrees with plus its own next token; sampling applies the
rejection rule of `_accept_sampled`, so what a level passes down is an exact sample of its own
distribution, together with its probability rows (the q of the level below's test). The top
level steps one token at a time, or, for the n-gram drafter, proposes a whole continuation at
once. Only the target's verdict is emitted, so greedy output is plain greedy output token for
token whatever the chain (the target's pass depends only on the committed rows and its own
tokens); the intermediate levels' choices change acceptance, never the output.

Every MX level shares the target's KV cache (docs/architecture.md): a level's pass at position
p writes provisional rows from p on, the level below overwrites them with its own when it checks
those tokens, and the target's verify finally writes its own rows over everything it commits.
A helper model (another model with the same vocabulary, qspec/helper.py) keeps a cache of its
own and catches up on the tokens below it before each pass.

Each level's draft length comes from its own CostModel (its "draft step" is the time the level
takes per token it proposes, its "verify" the pass of the level below), or is fixed. A level
above the first, and an n-gram level anywhere, may propose nothing in a round: when the cost
model finds that drafting costs more than it saves, or when no n-gram matches; the level below
then takes a single step of its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from .draft import DRAFT_FORMATS
from .sampling import SamplingParams, argmax, sample, top1_prob, warp
from .speculative import CostModel, DraftParams, _accept_sampled

NGRAM = "ngram"
LEVEL_NAMES = (NGRAM,) + DRAFT_FORMATS
MAX_LEVELS = 4     # drafting levels above the target
MAX_MX_LEVELS = 3  # of them, MX casts of the target: the native model holds the target + 3 MX sets
LEVEL_HELP = (f"{', '.join(LEVEL_NAMES)} (ngram: top level only), or a helper model: a known name or a "
              "model directory with the target's tokenizer, :FORMAT for its MX cast")


class MXLevel:
    """A weight set of the backend over the target's KV cache: 0 = the target, i = MX draft set i."""

    def __init__(self, backend, weight_set: int, name: str):
        self.backend, self.weight_set, self.name = backend, weight_set, name
        self.bytes = backend.set_bytes[weight_set] if hasattr(backend, "set_bytes") else backend.target_bytes

    def bind(self, backend) -> "MXLevel":
        """This level over another view of the same model: a sequence's (qspec/batch.py)."""
        return MXLevel(backend, self.weight_set, self.name)

    def score(self, tokens: Sequence[int], pos: int, context: Sequence[int] = (), tree=None) -> np.ndarray:
        """Logits of every row of `tokens` run at positions pos.. (writing their K/V rows); the
        rows before pos are the shared cache's (`context`, the tokens they hold, is not needed).
        `tree` = (prefix, parents): a tree pass (qspec/tree.py; the rows are tree slots)."""
        kw = {} if tree is None else {"tree": tree}
        if self.weight_set == 0:  # the Backend protocol: a target-only backend has no `draft`
            return self.backend.forward(tokens, pos, all_logits=True, **kw)
        return self.backend.forward(tokens, pos, all_logits=True, draft=self.weight_set, **kw)


class NgramLevel:
    """Prompt lookup: proposes the tokens that followed the most recent earlier occurrence of the
    last n tokens of the context (prompt + text so far), n from n_max down to n_min; nothing when
    no n-gram recurs. No weights, no cache; a deterministic proposal (q = one-hot)."""

    name = NGRAM
    bytes = 0

    def __init__(self, n_max: int = 4, n_min: int = 1):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"n-gram sizes must satisfy 1 <= n_min <= n_max, got {n_min}..{n_max}")
        self.n_max, self.n_min = n_max, n_min

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        return self.match(context, k)[0]

    def match(self, context: Sequence[int], k: int) -> tuple[list[int], int]:
        """(up to k proposed tokens, the length n of the n-gram that matched; 0: none)."""
        ctx = np.asarray(context, dtype=np.int64)
        size = len(ctx)
        for n in range(min(self.n_max, size - 1), self.n_min - 1, -1):
            # starts s < size - n: the n-gram at s is earlier than the context's own last n tokens
            hits = np.ones(size - n, dtype=bool)
            for t in range(n):
                hits &= ctx[t:t + size - n] == ctx[size - n + t]
            found = np.flatnonzero(hits)
            if found.size:
                s = int(found[-1]) + n
                return ctx[s:s + k].tolist(), n
        return [], 0


def is_helper(name: str) -> bool:
    """A level name that is not an MX format or ngram names a helper model: a known model name or
    a model directory, optionally ":FORMAT" for its MX cast (qspec/helper.py)."""
    return name not in LEVEL_NAMES


def parse_chain(draft: str | None, draft_levels: Sequence[str]) -> list[str]:
    """The level names of a chain (level 1 = `draft`, then `draft_levels`), checked before anything
    is loaded: ValueError for an unknown name, a chain that is too long, n-gram below another level,
    or levels above no draft. `draft` may still be "auto" (resolved once the model's size is known)."""
    from .fetch import MODELS
    from .helper import split_helper

    if isinstance(draft_levels, str):
        draft_levels = [draft_levels]
    names = list(draft_levels)
    for name in names:
        if not isinstance(name, str) or not name:
            raise ValueError(f"unknown draft level {name!r}")
        model = split_helper(name)[0]
        if is_helper(name) and model.lower() not in MODELS and not any(c in model for c in "/\\.~") \
                and not Path(model).exists():
            raise ValueError(f"unknown draft level {name!r} (choose from {', '.join(LEVEL_NAMES)}, or a helper "
                             "model: a known model name or a model directory, optionally :FORMAT)")
    if names and draft is None:
        raise ValueError("draft levels need a draft at level 1 (draft is none)")
    chain = ([draft] if draft is not None else []) + names
    if len(chain) > MAX_LEVELS:
        raise ValueError(f"a draft chain has at most {MAX_LEVELS} levels, got {len(chain)}")
    if NGRAM in chain[:-1]:
        raise ValueError("ngram can only be the top draft level (it has no weights to check drafts with)")
    return chain


def check_formats(chain: Sequence[str]) -> None:
    """Each MX format (and helper) at most once in a chain (a level drafting for its own copy gains
    nothing), and at most MAX_MX_LEVELS MX casts of the target."""
    for i, name in enumerate(chain):
        if name in chain[:i]:
            raise ValueError(f"draft level {i + 1} repeats level {chain.index(name) + 1} ({name})")
    if sum(name in DRAFT_FORMATS for name in chain) > MAX_MX_LEVELS:
        raise ValueError(f"a draft chain holds at most {MAX_MX_LEVELS} MX casts of the target")


def _accept_linear(toks: list[int], rows: np.ndarray) -> list[int]:
    """Greedy acceptance of a linear pass over toks = [last, d1..dm]: the drafts up to the first one
    that is not the target's argmax at the row before it, then the target's next token."""
    best = argmax(rows)
    m = next((j for j in range(1, len(toks)) if toks[j] != best[j - 1]), len(toks))
    return toks[1:m] + [best[m - 1]]


@dataclass
class LevelStats:
    drafted: int = 0      # tokens this level proposed to the level below
    accepted: int = 0     # of them, kept by the level below
    draft_s: float = 0.0  # time producing them (the levels above included)
    verify_s: float = 0.0  # time of the level below's passes over them
    rounds: int = 0       # passes of the level below that had room for drafts of this level
    skipped: int = 0      # of them, those in which this level proposed nothing


class Chain:
    """One generation's decoding over a chain: `levels[0]` the target (MXLevel of set 0), then the
    drafting levels; `ks[i]` level i's fixed draft length or None with `costs[i]` (i >= 1), a
    function giving level i's CostModel for the batch size class of the moment (Engine)."""

    def __init__(self, levels: list, ks: list[int | None], costs: list[Callable[[], CostModel] | None],
                 params: SamplingParams, dp: DraftParams, tree=None, lookup=None):
        """`tree`: a (TreeParams, function giving the TreeCost, or None) pair: level 1 drafts trees
        (qspec/tree.py). `lookup`: greedy, a function giving the Lookup (qspec/lookup.py) whose
        prompt-lookup candidates the target verifies beside level 1's drafts, or None."""
        self.levels, self.ks, self.costs, self.params, self.dp = levels, ks, costs, params, dp
        # what the cost models are fed: the sequence's share of the batched passes
        # (qspec/batch.py, SeqBackend.clock), else (a backend without batching) wall time;
        # the stats (draft_s, verify_s) are wall time
        self.clock = getattr(levels[0].backend, "clock", time.perf_counter)
        self.gen = None if params.greedy else params.generator()
        self.stats = [LevelStats() for _ in levels]
        self.lookup = lookup if self.gen is None else None
        self.lookup_rows = self.lookup_accepted = 0  # lookup nodes verified / accepted (chain steps)
        self.lookup_steps = 0  # steps the lookup ran alone
        self.lookup_s = 0.0    # their target passes (wall time)
        self.tree = None
        if tree is not None:
            from .tree import TreeRunner

            self.tree = TreeRunner(levels[0].backend, levels[1], tree[0], tree[1], params, self.gen)

    def _k(self, i: int, room: int, cost: CostModel | None) -> int:
        if room <= 0:
            return 0
        if cost is None:
            return min(self.ks[i], room)
        # level 1 beside other sequences: one K a batch round (CostModel.choose)
        return min(cost.choose(getattr(self.levels[0].backend, "round", None) if i == 1 else None), room)

    def _pick(self, logits: np.ndarray) -> tuple[int, np.ndarray | None, float]:
        """A token of one row of logits, its probability row (sampling), and its probability."""
        if self.gen is None:
            tok = argmax(logits)
            return tok, None, top1_prob(logits, tok) if self.dp.draft_p_min > 0 else 1.0
        q = warp(logits, self.params)
        return sample(q, self.gen), q, float(q.max())

    def _draft(self, i: int, last: int, pos: int, want: int, context: list[int]) -> tuple[list[int], list]:
        """Up to `want` tokens of level i after `last` (at position `pos`, not in the cache yet;
        `context` ends with it), and level i's probability rows for them (sampling; None = a
        deterministic proposal)."""
        level = self.levels[i]
        if isinstance(level, NgramLevel):
            toks = level.propose(context, want)
            return toks, [None] * len(toks)
        out: list[int] = []
        rows: list = []
        top = i == len(self.levels) - 1
        while len(out) < want:
            if top:  # one token at a time; draft_p_min may stop early
                tok, q, conf = self._pick(level.score([last], pos, context + out)[-1])
                new, new_rows = [tok], [q]
            else:
                new, new_rows = self._round(i, last, pos, want - len(out) - 1, context + out)
            out += new
            rows += new_rows
            pos += len(new)
            last = new[-1]
            if top and conf < self.dp.draft_p_min and len(out) >= self.dp.draft_min:
                break
        return out, rows

    def _round(self, i: int, last: int, pos: int, room: int, context: list[int],
               lookup: tuple | None = None) -> tuple[list[int], list]:
        """One pass of level i over [last] + at most `room` tokens drafted by level i+1: the tokens
        it keeps and its own next one, with level i's probability rows for them (sampling).
        `lookup` (level 0, greedy): the step's (Lookup, proposal, n-gram length), whose candidates
        join the pass where they pay (Lookup.extension)."""
        up = i + 1
        cost = self.costs[up]() if self.costs[up] is not None else None  # the batch size class's now
        k = self._k(up, room, cost)
        t0, c0 = time.perf_counter(), self.clock()
        drafts, qs = self._draft(up, last, pos, k, context) if k else ([], [])
        t1, c1 = time.perf_counter(), self.clock()
        out = self._verify_lookup(lookup, last, pos, drafts, cost, t1 - t0) if lookup and lookup[1] else None
        if out is not None:
            a, keep, rows_n = out
        else:
            rows = self.levels[i].score([last] + drafts, pos, context)
            rows_n = len(drafts) + 1
        t2, c2 = time.perf_counter(), self.clock()
        if out is not None:
            p_rows = [None] * len(keep)
        elif self.gen is None:
            best = argmax(rows)
            a = next((j for j, d in enumerate(drafts) if d != best[j]), len(drafts))
            keep, p_rows = drafts[:a] + [best[a]], [None] * (a + 1)
        else:
            p_rows = []
            a, nxt = _accept_sampled(drafts, qs, rows, self.params, self.gen, warped=p_rows)
            keep = drafts[:a] + [nxt]
        if lookup:
            lookup[0].observe_verify(rows_n, t2 - t1)
        st = self.stats[up]
        st.drafted += len(drafts)
        st.accepted += a
        st.draft_s += t1 - t0
        st.verify_s += t2 - t1
        st.rounds += room > 0
        st.skipped += room > 0 and not drafts
        if cost is not None:
            cost.observe(len(drafts), a, c1 - c0, c2 - c1, rows=rows_n)
        return keep, p_rows

    def _verify_lookup(self, lookup: tuple, last: int, pos: int, drafts: list[int], cost: CostModel | None,
                       draft_s: float) -> tuple[int, list[int], int] | None:
        """The target's verify of level 1's chain with the lookup candidates that pay for their rows
        (Lookup.extension), greedy: (level 1's drafts accepted, the tokens to emit, verify rows);
        None when none does (the plain verify runs)."""
        from .tree import Tree, accept_greedy, commit_path, lookup_counts, verify_pass

        lk, g, n = lookup
        acc = cost.acceptance() if cost is not None else [lk.PRIOR_P[1]] * len(drafts)
        t = Tree.chain(last, drafts, np.cumprod([acc[min(j, len(acc) - 1)] for j in range(len(drafts))]).tolist())
        k = len(drafts)
        if not lk.graft(t, g, n) or not (r := lk.extension(t, k, draft_s)):
            return None
        kept = list(range(k + 1 + r))
        backend = self.levels[0].backend
        if t.parent[k + 1] == k:  # the candidates go on from the chain's end: one longer chain
            toks = [last] + t.tokens[1:len(kept)]
            new = _accept_linear(toks, backend.forward(toks, pos, all_logits=True))
            path = list(range(len(new)))
        else:  # they leave the chain: a tree of two branches
            toks, rows = verify_pass(backend, t, kept, pos)
            path, new = accept_greedy(t, kept, rows)
            commit_path(backend, toks, path, pos)
        verified, taken = lookup_counts(t, kept, path)
        self.lookup_rows += verified
        self.lookup_accepted += taken
        return sum(1 <= p <= k for p in path), new, len(kept)

    def _lookup_alone(self, lk, last: int, pos: int, g: list[int]) -> list[int]:
        """A step without drafting: the target checks [last] + the lookup's `g` in one pass (greedy)."""
        toks = [last] + g
        t0 = time.perf_counter()
        new = _accept_linear(toks, self.levels[0].score(toks, pos))
        dt = time.perf_counter() - t0
        lk.observe_verify(len(toks), dt)
        self.lookup_s += dt
        self.lookup_steps += 1
        self.lookup_rows += len(g)
        self.lookup_accepted += len(new) - 1
        return new

    def tokens(self, backend, first_logits: np.ndarray, max_new: int, eos_ids: set[int],
               history: list[int], stats: dict[str, float]) -> Iterator[int]:
        """Yields new tokens after a target prefill of `history` (the prompt ids; extended with
        every emitted token) whose last-row logits are `first_logits`."""
        kv = backend.kv
        n, steps, t_start = 0, 0, time.perf_counter()
        try:
            tok = self._pick(first_logits)[0]
            n = 1
            history.append(tok)
            yield tok
            while tok not in eos_ids and n < max_new:
                base = kv.length  # position of `tok`
                room = max_new - n - 1
                lk = self.lookup() if self.lookup is not None else None
                g, ng = lk.propose(history, room) if lk is not None else ([], 0)
                look = (lk, g, ng) if lk is not None else None
                alone = lk.alone(g, ng) if g else 0
                t0 = time.perf_counter()
                if alone:
                    new = self._lookup_alone(lk, tok, base, g[:alone])
                elif self.tree is not None and room > 0:
                    new, drafted, accepted = self.tree.step(
                        tok, base, room, lambda: self._round(0, tok, base, room, history, look)[0], look)
                    self.stats[1].drafted += drafted
                    self.stats[1].accepted += accepted
                else:
                    new, _ = self._round(0, tok, base, room, history, look)
                if lk is not None:
                    lk.learn(g, ng, new)
                    if not alone:
                        lk.observe_step(len(new), time.perf_counter() - t0)
                # an end-of-sequence token ends the run: nothing past it is emitted or committed
                new = next((new[:i + 1] for i, t in enumerate(new) if t in eos_ids), new)
                kv.length = base + len(new)  # commit tok + the accepted drafts; the rest are not counted
                steps += 1
                for t in new:
                    tok = t
                    n += 1
                    history.append(t)
                    yield t
                    if t in eos_ids or n == max_new:
                        break
        finally:  # also when the caller closes the generator early: stats of what was emitted
            self._report(n, steps, time.perf_counter() - t_start, stats)

    def _report(self, n: int, steps: int, decode_s: float, stats: dict[str, float]) -> None:
        s1 = self.stats[1]
        stats.update(new_tokens=n, decode_s=decode_s, tokens_per_s=(n - 1) / decode_s if decode_s > 0 else 0.0,
                     drafted=s1.drafted, accepted=s1.accepted,
                     acceptance_rate=s1.accepted / s1.drafted if s1.drafted else 0.0,
                     tokens_per_step=(n - 1) / steps if steps else 0.0, draft_s=s1.draft_s, verify_s=s1.verify_s,
                     steps=steps, levels=len(self.levels) - 1)
        if self.tree is not None:
            self.tree.report(stats)
        if self.lookup is not None:
            rows = self.lookup_rows + (self.tree.stats.lookup_rows if self.tree is not None else 0)
            taken = self.lookup_accepted + (self.tree.stats.lookup_accepted if self.tree is not None else 0)
            stats.update(lookup_rows=rows, lookup_accepted=taken, lookup_steps=self.lookup_steps,
                         lookup_s=self.lookup_s)
        for i, st in enumerate(self.stats[1:], start=1):
            stats.update({f"level{i}_drafted": st.drafted, f"level{i}_accepted": st.accepted,
                          f"level{i}_acceptance_rate": st.accepted / st.drafted if st.drafted else 0.0,
                          f"level{i}_draft_s": st.draft_s, f"level{i}_verify_s": st.verify_s,
                          f"level{i}_rounds": st.rounds, f"level{i}_skipped": st.skipped})
