"""Draft trees (EAGLE-2 style, Li et al. 2024): drafting, one-pass verification, acceptance, cost.

A step at committed length P with `tok` (the last emitted token, not in the cache yet):
  1. draft: the root `tok` at slot P, then depth by depth one batched draft pass over the frontier
     (the `width` nodes of the newest depth with the highest path value = product of the draft's
     probabilities along the path; greedy with a cost model: of the nodes' acceptance estimates,
     AcceptCal, each <= 1); each frontier node gets `width` children (greedy: its top
     tokens; sampling: i.i.d. samples of its draft distribution q). Draft rows go to slots
     P, P+1, .. in expansion order (backend.forward(tree=(P, parents)), docs: tree-contract).
  2. rerank: all drafted nodes by path value; the best N - 1 are kept (a child never outranks its
     parent, ties go to the shallower node, so every kept node's ancestors are kept). Sampling
     keeps child groups by count, never by value (see select, accept_sampled).
  3. verify: one target pass over [tok, kept nodes..] at slots P.. (parents first) -> N rows.
  4. accept: greedy -> the longest path whose every token is the target's argmax at its parent,
     then the target's token after it; sampling -> accept_sampled. The path's K/V rows are
     moved to P, P+1, .. and the committed length becomes P + len(path).
Greedy output is plain greedy output token for token: each tree row is bit-identical to the
linear step over its path (the native tree attention's rule), so the accepted rows are the
target's linear rows.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .sampling import SamplingParams, argmax, sample, warp
from .speculative import DRAFT_MAX_LIMIT, CostModel, PerRound

TREE_MODES = ("auto", "on", "off")
TREE_WIDTH_LIMIT = 8
TREE_NODES_LIMIT = 64
# what a tree uses for a cap left unset (greedy: the cost model still chooses below these; README
# "Draft trees": depth 10 and 24 nodes over 6 and 16 once the values are calibrated, AcceptCal)
DEFAULT_WIDTH, DEFAULT_DEPTH, DEFAULT_NODES = 3, 10, 24
LOOKUP_RANK = -1  # Tree.rank of a prompt-lookup node (qspec/lookup.py; AcceptCal learns the draft's only)


@dataclass(frozen=True)
class TreeParams:
    mode: str = "auto"        # auto: tree or chain, whichever measures faster; on / off: forced
    width: int | None = None  # top nodes expanded per depth and children per node (None: default)
    depth: int | None = None  # draft passes per step (None: default, greedy stops early by cost)
    nodes: int | None = None  # N: verify rows, root included (EAGLE-2's total_token + 1)

    def __post_init__(self) -> None:
        if self.mode not in TREE_MODES:
            raise ValueError(f"tree must be one of {', '.join(TREE_MODES)}, got {self.mode!r}")
        for name, v, lo, hi in (("tree_width", self.width, 1, TREE_WIDTH_LIMIT),
                                ("tree_depth", self.depth, 1, DRAFT_MAX_LIMIT),
                                ("tree_nodes", self.nodes, 2, TREE_NODES_LIMIT)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi):
                raise ValueError(f"{name} must be an integer in {lo}..{hi}, got {v!r}")
        if self.nodes is not None and self.nodes < self.d + 1:
            raise ValueError(f"tree_nodes ({self.nodes}) must be at least tree_depth + 1 ({self.d + 1}): "
                             "N verify rows hold a path of at most N - 1 drafted tokens")

    @property
    def w(self) -> int:
        return DEFAULT_WIDTH if self.width is None else self.width

    @property
    def d(self) -> int:
        return (DEFAULT_DEPTH if self.nodes is None else min(DEFAULT_DEPTH, self.nodes - 1)) \
            if self.depth is None else self.depth

    @property
    def n(self) -> int:
        return max(DEFAULT_NODES, self.d + 1) if self.nodes is None else self.nodes


@dataclass
class Tree:
    """Drafted nodes; node 0 is the root (the last emitted token)."""
    tokens: list[int]
    parent: list[int]                  # node index, -1 for the root
    depth: list[int]
    value: list[float]                 # path value: product of the nodes' acceptance estimates
    rank: list[int] = field(default_factory=lambda: [0])     # greedy: the node's rank among its siblings
    prob: list[float] = field(default_factory=lambda: [1.0])  # the draft's probability of the node
    q: dict[int, np.ndarray] = field(default_factory=dict)  # sampling: the draft row each node's children were drawn from

    @classmethod
    def chain(cls, root: int, tokens: list[int], values: list[float]) -> "Tree":
        """A chain as a tree: the root, then each token the child of the one before, with these
        path values (rank 0, probability 1)."""
        n = len(tokens)
        return cls([root] + list(tokens), list(range(-1, n)), list(range(n + 1)), [1.0] + list(values),
                   [0] * (n + 1), [1.0] * (n + 1))

    def children(self, kept: list[int]) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for i in kept[1:]:
            out.setdefault(self.parent[i], []).append(i)
        return out


def draft_tree(score, tok: int, P: int, width: int, depth: int, max_nodes: int, gen=None,
               params: SamplingParams | None = None, keep_going=None, accept=None) -> Tree:
    """Expand a tree of at most `depth` levels: score(tokens, start_pos, parents) runs a draft pass
    (tree = (P, parents)) and returns its logits. `keep_going(frontier_values)` (greedy, optional)
    may stop before `depth`. Stops early too when max_nodes - 1 are drafted. A node's value is its
    parent's times `accept(rank, prob)` (greedy, optional: AcceptCal.estimate), else times prob."""
    t = Tree([tok], [-1], [0], [1.0])
    slot_parents = [-1]            # per draft slot P + j: the slot of its parent
    slot_of = {0: P}               # node -> draft slot
    frontier, logits = [0], score([tok], P, slot_parents)
    for d in range(1, depth + 1):
        new: list[int] = []
        for f, node in enumerate(frontier):
            row = logits[f]
            if gen is None:  # the top `width` logits and their probabilities (one exp pass over the row)
                top = np.argpartition(row, len(row) - width)[-width:] if width < len(row) else np.arange(len(row))
                top = top[np.argsort(-row[top], kind="stable")]
                mx = float(row[top[0]])
                total = float(np.exp(row - mx).sum(dtype=np.float64))
                picks = [(int(x), math.exp(float(row[x]) - mx) / total) for x in top]
            else:
                qrow = warp(row, params)
                t.q[node] = qrow
                picks = [(x, float(qrow[x])) for x in (sample(qrow, gen) for _ in range(width))]
            for r, (x, pr) in enumerate(picks):
                t.tokens.append(x)
                t.parent.append(node)
                t.depth.append(d)
                t.rank.append(r)
                t.prob.append(pr)
                t.value.append(t.value[node] * (pr if accept is None else accept(r, pr)))
                new.append(len(t.tokens) - 1)
        if d == depth or len(t.tokens) >= max_nodes:
            break
        # EAGLE-2: the next frontier is the `width` newest nodes of highest path value
        frontier = sorted(new, key=lambda i: -t.value[i])[:width]
        if keep_going is not None and not keep_going([t.value[i] for i in frontier]):
            break
        start = P + len(slot_parents)
        for j, i in enumerate(frontier):
            slot_of[i] = start + j
            slot_parents.append(slot_of[t.parent[i]])
        logits = score([t.tokens[i] for i in frontier], start, slot_parents)
    return t


def select(t: Tree, n: int, sampled: bool) -> list[int]:
    """The kept nodes (root first, parents before children, at most n). Greedy: the best n - 1 by
    path value (EAGLE-2's rerank). Sampling: child groups in drafting order, the last one cut to
    its leading children (a group cut by its members' values would no longer be i.i.d. draws of
    q, which accept_sampled needs; a cut by count only keeps them i.i.d.)."""
    kept, have = [0], {0}
    if sampled:
        groups: dict[int, list[int]] = {}
        for i in range(1, len(t.tokens)):
            groups.setdefault(t.parent[i], []).append(i)
        for par, g in groups.items():
            if par in have:  # a leading part of a group: still i.i.d. draws (its size ignores their values)
                g = g[:n - len(kept)]
                kept += g
                have.update(g)
    else:
        for i in sorted(range(1, len(t.tokens)), key=lambda i: (-t.value[i], t.depth[i], i)):
            if len(kept) == n:
                break
            if t.parent[i] in have:  # always true: a parent ranks before its children
                kept.append(i)
                have.add(i)
    return sorted(kept, key=lambda i: (t.depth[i], i))


def verify_layout(t: Tree, kept: list[int], P: int) -> tuple[list[int], list[int]]:
    """Tokens and parent slots of the verify pass (kept[k] at slot P + k)."""
    slot = {node: P + k for k, node in enumerate(kept)}
    return [t.tokens[i] for i in kept], [-1] + [slot[t.parent[i]] for i in kept[1:]]


def verify_pass(backend, t: Tree, kept: list[int], P: int) -> tuple[list[int], np.ndarray]:
    """The target's pass over the kept nodes at slots P..: their tokens and logits rows."""
    toks, parents = verify_layout(t, kept, P)
    return toks, backend.forward(toks, P, all_logits=True, tree=(P, parents))


def commit_path(backend, toks: list[int], path: list[int], P: int) -> None:
    """The accepted rows (path: indexes into the verify pass) to their linear positions P, P+1, ..:
    target rows, bit-equal to a linear pass's on the native backend (recorded for prompt reuse
    there; torch's are not batch-invariant)."""
    kp = getattr(backend, "kernel_path", None)
    backend.kv.move_rows([P + k for k in path], P, [toks[k] for k in path] if kp is not None else None, kp)


def lookup_counts(t: Tree, kept: list[int], path: list[int]) -> tuple[int, int]:
    """(prompt-lookup nodes among `kept`, of them on the accepted path; path indexes into kept)."""
    on_path = {kept[k] for k in path}
    mine = [i for i in kept if t.rank[i] == LOOKUP_RANK]
    return len(mine), sum(i in on_path for i in mine)


def accept_greedy(t: Tree, kept: list[int], rows: np.ndarray) -> tuple[list[int], list[int]]:
    """(path as indexes into kept, root first; the tokens to emit: the path's drafts + the target's next)."""
    best = argmax(rows)
    kids = t.children(kept)
    index = {node: k for k, node in enumerate(kept)}
    path = [0]
    while True:
        b = best[path[-1]]
        nxt = next((index[c] for c in kids.get(kept[path[-1]], []) if t.tokens[c] == b), None)
        if nxt is None:
            return path, [t.tokens[kept[k]] for k in path[1:]] + [b]
        path.append(nxt)


def accept_sampled(t: Tree, kept: list[int], rows: np.ndarray, params: SamplingParams,
                   gen: np.random.Generator) -> tuple[list[int], list[int]]:
    """Multi-candidate speculative sampling: SpecInfer's multi-step speculative sampling (Miao et
    al. 2024, "SpecInfer", Algorithm 2 / Theorem 4.2), for candidates drawn i.i.d. (with
    replacement) from one draft distribution q. At a node with target distribution p and children
    x_1..x_k ~ q i.i.d.: x_i is accepted with probability min(1, p(x)/q(x)); on rejection
    p <- normalize(max(0, p - q)) and the next child is tried against that residual; when all are
    rejected the token is drawn from the last residual. An accepted child repeats this with its
    own children (a node without kept children: drawn from p). Each emitted token is then
    distributed exactly as the target's p given the path. The rule needs the children to be i.i.d.
    draws of q given the path, which is why select() never drops single children by value."""
    kids = t.children(kept)
    index = {node: k for k, node in enumerate(kept)}
    path = [0]
    while True:
        node = kept[path[-1]]
        p = warp(rows[path[-1]], params)
        q = t.q.get(node)
        nxt = None
        for c in kids.get(node, []):
            x = t.tokens[c]
            if gen.random() * float(q[x]) < float(p[x]):
                nxt = index[c]
                break
            r = np.maximum(p - q, 0.0)
            s = float(r.sum())
            if s > 0:  # s == 0 only when p == q, where x was accepted surely
                p = r / s
        if nxt is None:
            return path, [t.tokens[kept[k]] for k in path[1:]] + [sample(p, gen)]
        path.append(nxt)


class AcceptCal:
    """Greedy acceptance of a drafted node, learned from the verify passes: the chance that the
    target's argmax at a node's parent is the node's token, given that the parent was accepted, by
    the node's rank among its siblings and its draft probability (BINS bins). The draft's
    probability alone misjudges both: the top child of a 0.5 draft probability is the target's
    argmax far more often than one time in two, a second child far less often than its
    probability. Prior: the probability itself, worth PRIOR observations; the counts decay
    (DECAY per observation of the cell) so the estimate follows the text."""

    RANKS, BINS, PRIOR, DECAY = 3, 10, 4.0, 0.995

    def __init__(self) -> None:
        self.hits = np.zeros((self.RANKS, self.BINS))
        self.seen = np.zeros((self.RANKS, self.BINS))

    def _cell(self, rank: int, prob: float) -> tuple[int, int]:
        return min(rank, self.RANKS - 1), min(int(prob * self.BINS), self.BINS - 1)

    def estimate(self, rank: int, prob: float) -> float:
        c = self._cell(rank, prob)
        return (self.hits[c] + self.PRIOR * prob) / (self.seen[c] + self.PRIOR)

    def observe(self, t: Tree, kept: list[int], path: list[int]) -> None:
        """Every kept child of a node of the accepted path (path: indexes into kept) was tested:
        accepted if it is the path's next node."""
        kids = t.children(kept)
        for j, k in enumerate(path):
            nxt = kept[path[j + 1]] if j + 1 < len(path) else None
            for c in kids.get(kept[k], []):
                if t.rank[c] == LOOKUP_RANK:  # a prompt-lookup node (qspec/lookup.py learns those)
                    continue
                cell = self._cell(t.rank[c], t.prob[c])
                self.hits[cell] = self.hits[cell] * self.DECAY + (c == nxt)
                self.seen[cell] = self.seen[cell] * self.DECAY + 1.0


class TreeCost:
    """Per step choices of the tree from measurements on this machine:
    - the shape: in mode auto, "chain" (today's chain, its own CostModel) or tree widths 2..cap,
      each an arm whose tokens per second is measured as decayed sums of its steps' tokens and
      seconds (the evidence of every arm decays by DECAY a step, CostModel's memory: a rate
      measured long ago, e.g. the chain's while its own K was still being explored, gives way to
      the next trial); the best arm is used and the one tried least recently is re-measured
      every PROBE_EVERY steps, so where width does not pay the chain wins;
    - the depth (greedy): another draft pass is made while the expected extra accepted tokens
      (calibration x sum of the frontier's path values; EAGLE-2: path value tracks acceptance)
      are worth its measured cost c(w) at the arm's measured rate;
    - N (greedy): the prefix of the reranked nodes maximising (1 + cal x sum of values) / (t_draft + t_v(N)),
      with t_v the verify-cost curve of CostModel (measured per row count);
    cal = EMA of accepted / predicted (the draft's confidence is not exactly its acceptance)."""

    PROBE_EVERY = 16
    DECAY = CostModel.DECAY

    def __init__(self, params: TreeParams, chain_ok: bool):
        self.params = params
        wmax = params.w
        if params.mode == "on":
            self.arms = [wmax] if params.width is not None else list(range(2, max(2, wmax) + 1)) or [wmax]
        else:
            self.arms = (["chain"] if chain_ok else []) + list(range(2, wmax + 1))
        self.tok: dict = {a: 0.0 for a in self.arms}  # decayed sums of each arm's tokens and seconds
        self.sec: dict = {a: 0.0 for a in self.arms}
        self.tries: dict = {a: 0 for a in self.arms}
        self.last: dict = {a: 0 for a in self.arms}  # the step each arm was last tried
        self.steps = 0
        self.cal = 0.7
        self.c: dict[int, float] = {}          # draft pass seconds per frontier width
        self.verify = CostModel(1.0, TREE_NODES_LIMIT, 1)  # its t_v(M) curve only
        self.verify._explore = []
        self.accept = AcceptCal()
        self._per_round = PerRound()

    def arm(self, round: int | None = None):
        """The shape of the next step; beside other sequences one a batch `round` (PerRound)."""
        return self._per_round.get(round, self._arm)

    def _arm(self):
        self.steps += 1
        untried = [a for a in self.arms if self.tries[a] < 2]
        if untried:
            return untried[0]
        if self.steps % self.PROBE_EVERY == 0:
            return min(self.arms, key=lambda a: self.last[a])
        return max(self.arms, key=self.rate)

    def observe_arm(self, arm, tokens: int, seconds: float) -> None:
        self.tries[arm] += 1
        self.last[arm] = self.steps
        for a in self.arms:
            self.tok[a] *= self.DECAY
            self.sec[a] *= self.DECAY
        self.tok[arm] += tokens
        self.sec[arm] += max(seconds, 1e-9)

    def rate(self, arm) -> float:
        """The arm's tokens per second (tried at least once)."""
        return self.tok[arm] / self.sec[arm]

    def keep_going(self, arm, frontier_values: list[float]) -> bool:
        w = len(frontier_values)
        if w not in self.c or not self.tries[arm]:
            return True
        return self.cal * sum(frontier_values) > self.rate(arm) * self.c[w]

    def observe_pass(self, w: int, seconds: float) -> None:
        self.c[w] = seconds if w not in self.c else 0.8 * self.c[w] + 0.2 * seconds

    def nodes(self, t: Tree, cap: int, draft_s: float) -> int:
        """N for this step from the drafted values (greedy)."""
        if not self.verify.t_verify or self.params.nodes is not None and self.params.mode == "on":
            return cap
        vals = sorted(t.value[1:], reverse=True)[:cap - 1]
        best_n, best, acc = 1, -1.0, 1.0
        for n in range(1, len(vals) + 2):
            if n > 1:
                acc += self.cal * vals[n - 2]
            rate = acc / (draft_s + self.verify.verify_seconds(n))
            if rate > best:
                best_n, best = n, rate
        return max(best_n, 2)

    def observe_verify(self, rows: int, seconds: float, predicted: float, accepted: int) -> None:
        self.verify.t_verify[rows] = CostModel._ema(self.verify.t_verify.get(rows), seconds)
        if predicted > 0:
            self.cal = min(1.0, max(0.05, 0.95 * self.cal + 0.05 * accepted / predicted))


@dataclass
class TreeStats:
    steps: int = 0         # tree steps (chain steps of an auto run not counted)
    rows: int = 0          # verify rows of them (N, root included)
    drafted: int = 0       # tree nodes drafted (before the rerank)
    accepted: int = 0      # accepted path length (drafted tokens kept)
    draft_s: float = 0.0
    verify_s: float = 0.0
    lookup_rows: int = 0      # prompt-lookup nodes verified (qspec/lookup.py)
    lookup_accepted: int = 0  # of them, on the accepted path


class TreeRunner:
    """The tree steps of one generation: `level` (an MXLevel of the backend) drafts, the backend's
    target verifies. `cost()` (greedy: the TreeCost of the batch size class of the moment) chooses
    the shape; None uses the caps as given."""

    def __init__(self, backend, level, params: TreeParams, cost: Callable[[], TreeCost] | None,
                 sp: SamplingParams, gen: np.random.Generator | None):
        self.backend, self.level, self.params, self.cost, self.sp, self.gen = backend, level, params, cost, sp, gen
        self.stats = TreeStats()

    def step(self, tok: int, P: int, room: int, chain_round, lookup: tuple | None = None) -> tuple[list[int], int, int]:
        """Tokens to emit after `tok` (at slot P), with at most `room` drafted tokens among them;
        `chain_round()` runs today's chain step instead when the cost model's arm says so.
        `lookup` (greedy): the step's (Lookup, proposal, n-gram length); the proposal joins the
        tree (Lookup.graft). Returns (tokens, drafted, accepted) of level 1's nodes (both 0 for a
        chain step)."""
        cost, p = self.cost() if self.cost is not None else None, self.params  # the batch size class's now
        arm = cost.arm(getattr(self.backend, "round", None)) if cost is not None else p.w
        t0 = time.perf_counter()
        if arm == "chain":
            new = chain_round()
            cost.observe_arm(arm, len(new), time.perf_counter() - t0)
            return new, 0, 0
        width, depth, cap = arm, min(p.d, room), p.n
        kv = self.backend.kv
        kv.ensure_capacity(P + max(cap, 1 + width * depth))

        def score(tokens, start, parents):
            s = time.perf_counter()
            out = self.level.score(tokens, start, tree=(P, list(parents)))
            if cost is not None:
                cost.observe_pass(len(tokens), time.perf_counter() - s)
            return out

        keep_going = None
        if cost is not None and self.gen is None and p.depth is None:
            keep_going = lambda vals: cost.keep_going(arm, vals)  # noqa: E731
        t = draft_tree(score, tok, P, width, depth, cap if self.gen is not None else 10 ** 9,
                       self.gen, self.sp, keep_going,
                       cost.accept.estimate if cost is not None and self.gen is None else None)
        lk, g, ng = lookup or (None, [], 0)
        grafted = lk.graft(t, g[:cap - 1], ng) if g and self.gen is None else []
        t1 = time.perf_counter()
        n = cost.nodes(t, cap, t1 - t0) if cost is not None and self.gen is None else cap
        kept = select(t, n, self.gen is not None)
        toks, rows = verify_pass(self.backend, t, kept, P)
        t2 = time.perf_counter()
        if self.gen is None:
            path, new = accept_greedy(t, kept, rows)
            if cost is not None:
                cost.accept.observe(t, kept, path)
            if grafted:
                verified, taken = lookup_counts(t, kept, path)
                self.stats.lookup_rows += verified
                self.stats.lookup_accepted += taken
        else:
            path, new = accept_sampled(t, kept, rows, self.sp, self.gen)
        commit_path(self.backend, toks, path, P)
        mine = [k for k in range(1, len(kept)) if t.rank[kept[k]] >= 0]  # level 1's nodes, not lookup's
        st = self.stats
        st.steps += 1
        st.rows += len(kept)
        st.drafted += len(t.tokens) - 1 - len(grafted)
        st.accepted += len(path) - 1
        st.draft_s += t1 - t0
        st.verify_s += t2 - t1
        if cost is not None:
            predicted = sum(t.value[i] for i in kept[1:])
            cost.observe_verify(len(kept), t2 - t1, predicted, len(path) - 1)
            cost.observe_arm(arm, len(new), time.perf_counter() - t0)
        if lk is not None:
            lk.observe_verify(len(kept), t2 - t1)
        on_path = set(path)
        return new, len(mine), sum(k in on_path for k in mine)

    def report(self, stats: dict) -> None:
        st = self.stats
        stats.update(tree_steps=st.steps, tree_verify_rows=st.rows, tree_drafted=st.drafted,
                     tree_accepted=st.accepted, tree_draft_s=st.draft_s, tree_verify_s=st.verify_s,
                     tree_mean_rows=st.rows / st.steps if st.steps else 0.0,
                     tree_mean_path=st.accepted / st.steps if st.steps else 0.0)
