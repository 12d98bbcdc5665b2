"""Prompt-lookup candidates in the target's verify pass (greedy).

Prompt lookup (`NgramLevel.match`: the tokens that followed the latest earlier occurrence of the
context's last n tokens) proposes a continuation for free. Each greedy step it is used in one of
two ways, whichever the measurements say yields more tokens per second:
  - beside the MX draft: where the lookup agrees with the draft's nodes it follows them; where it
    goes on past them, or leaves them, its tokens become extra nodes of the verify pass (a longer
    chain, or a branch: tree attention, qspec/tree.py), as many as pay for their verify rows;
  - alone: when the lookup's continuation is likely enough to be right (a stretch the answer
    copies from its prompt: a rename, an edit of given code, a quoted passage), the step skips the
    MX draft and the target checks the continuation directly, in one pass.
Lossless as any greedy step: every verify row is bit-identical to the linear row over its path,
and the accepted path is the one whose every token is the target's argmax. Sampling keeps the
draft alone (a deterministic candidate beside i.i.d. draws would break accept_sampled's rule).

What is learned (per engine setting and batch size class, decaying so it follows the text): the
chance that the lookup's i-th token is the target's, given that its earlier ones were, by i = 1 or
later and by the length n of the n-gram that matched (every step with a proposal tests it
against the tokens the target emitted); the verify curve t_v(M); and the tokens per second of the
steps that drafted, the rate a lookup-alone step has to beat.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .levels import NgramLevel
from .speculative import DRAFT_MAX_LIMIT, CostModel
from .tree import LOOKUP_RANK, Tree

LOOKUP_MODES = ("auto", "off")
MAX_LOOKUP = 32   # lookup tokens offered a step at most


class Lookup:
    """Prompt-lookup proposals and what they have earned, shared by the sequences of one engine
    setting and batch size class. hits / seen[i, n]: decayed counts of the lookup's token being the
    target's, i = 0 its first token, 1 a later one after right ones; PRIOR_P worth PRIOR counts."""

    N_MAX, PRIOR, DECAY = 4, 2.0, 0.99
    PRIOR_P = (0.3, 0.6)
    RATE_DECAY = CostModel.DECAY

    def __init__(self) -> None:
        self.ngram = NgramLevel(self.N_MAX, 1)
        self.hits = np.zeros((2, self.N_MAX + 1))
        self.seen = np.zeros((2, self.N_MAX + 1))
        self.verify = CostModel(1.0, DRAFT_MAX_LIMIT + MAX_LOOKUP + 1, 1)  # its t_v(M) curve only
        self.tok = self.sec = 0.0  # decayed tokens and seconds of the steps that drafted

    def propose(self, context: Sequence[int], room: int) -> tuple[list[int], int]:
        """(the continuation after `context`, at most `room` tokens; the n-gram length, 0: none)."""
        return self.ngram.match(context, min(MAX_LOOKUP, room)) if room > 0 else ([], 0)

    def chance(self, i: int, n: int) -> float:
        """The chance that the lookup's token i (0-based) is the target's, given tokens < i were."""
        k = min(i, 1)
        return (self.hits[k, n] + self.PRIOR * self.PRIOR_P[k]) / (self.seen[k, n] + self.PRIOR)

    def learn(self, g: list[int], n: int, emitted: list[int]) -> None:
        """A step's proposal `g` against the tokens the target emitted after the same root."""
        for i, x in enumerate(g[:len(emitted)]):
            k = min(i, 1)
            self.hits[k, n] = self.hits[k, n] * self.DECAY + (x == emitted[i])
            self.seen[k, n] = self.seen[k, n] * self.DECAY + 1.0
            if x != emitted[i]:
                break

    def observe_verify(self, rows: int, seconds: float) -> None:
        self.verify.t_verify[rows] = CostModel._ema(self.verify.t_verify.get(rows), seconds)

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A step that drafted (chain or tree): the rate a lookup-alone step must beat."""
        self.tok = self.tok * self.RATE_DECAY + tokens
        self.sec = self.sec * self.RATE_DECAY + max(seconds, 1e-9)

    def alone(self, g: list[int], n: int) -> int:
        """How many of `g` a lookup-alone step should verify; 0: drafting pays more (or nothing is
        measured yet). The count with the most expected tokens per second, (1 + sum over i of
        P(tokens 1..i right)) / t_v(1 + i), must beat the drafting steps' measured rate."""
        if not g or not self.sec or not self.verify.t_verify:
            return 0
        tv = self.verify.verify_seconds
        best_r, best, acc, reach = 0, self.tok / self.sec, 1.0, 1.0
        for i in range(len(g)):
            reach *= self.chance(i, n)
            acc += reach
            rate = acc / tv(i + 2)
            if rate > best:
                best_r, best = i + 1, rate
        return best_r

    def graft(self, t: Tree, g: list[int], n: int) -> list[int]:
        """Adds the proposal `g` (after the root) to `t`: it walks the tree's nodes while they agree
        (raising a node's value to the lookup's) and becomes new nodes from where it leaves them.
        A new node's value: its parent's x the lookup's chance, and where it leaves the draft's
        children, x the chance that they are all wrong (only one token can be the target's).
        Returns the new nodes (rank LOOKUP_RANK)."""
        node, new = 0, []
        kids: dict[int, dict[int, int]] = {}
        for i in range(1, len(t.tokens)):
            kids.setdefault(t.parent[i], {})[t.tokens[i]] = i
        for i, x in enumerate(g):
            here = kids.get(node, {})
            value = t.value[node] * self.chance(i, n)
            nxt = here.get(x)
            if nxt is None:
                if t.value[node] > 0:  # the draft's children here take their share first
                    value *= max(0.0, 1.0 - sum(t.value[c] for c in here.values()) / t.value[node])
                t.tokens.append(x)
                t.parent.append(node)
                t.depth.append(t.depth[node] + 1)
                t.rank.append(LOOKUP_RANK)
                t.prob.append(0.0)
                t.value.append(min(value, t.value[node]))
                nxt = len(t.tokens) - 1
                new.append(nxt)
            else:  # the draft has it: follow; its value is at least the lookup's
                t.value[nxt] = max(t.value[nxt], min(value, t.value[node]))
            node = nxt
        return new

    def extension(self, t: Tree, drafts: int, draft_s: float) -> int:
        """For a chain (t: the root, its `drafts` chain nodes valued by the chain's acceptance,
        then grafted lookup nodes, which form one path): how many lookup nodes to verify, the count
        with the most expected tokens per second, (1 + the kept nodes' values) / (draft_s + t_v(rows))."""
        if not self.verify.t_verify:  # no verify measured yet: nothing to weigh the rows against
            return 0
        tv = self.verify.verify_seconds
        acc = 1.0 + sum(t.value[1:drafts + 1])
        best_r, best = 0, acc / (draft_s + tv(drafts + 1))
        for r in range(1, len(t.tokens) - drafts):
            acc += t.value[drafts + r]
            rate = acc / (draft_s + tv(drafts + 1 + r))
            if rate > best:
                best_r, best = r, rate
        return best_r

