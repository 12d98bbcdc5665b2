"""Prompt-lookup candidates in the target's verify (qspec/lookup.py): every way a step can use them
is lossless (a longer chain, a branch off the chain, a branch of a tree, the lookup alone, in a
batch), what the lookup learns and how it weighs rows, and bad input."""

import numpy as np
import pytest

import qspec
from qspec.bench.common import dev_prompts
from qspec.levels import NgramLevel
from qspec.lookup import Lookup
from qspec.tree import LOOKUP_RANK, Tree
from test_levels import run_cli


@pytest.fixture(scope="module")
def engine(default_model_dir):
    return qspec.load(default_model_dir)


def prompts() -> list[str]:
    return dev_prompts("repetition")[:2] + dev_prompts()[:2]


# ---------------------------------------------------------------- the pieces
def test_match_reports_the_ngram_length():
    ng = NgramLevel(n_max=3, n_min=1)
    assert ng.match([5, 6, 7, 8, 1, 5, 6, 7], 2) == ([8, 1], 3)
    assert ng.match([2, 3, 4, 9, 3], 3) == ([4, 9, 3], 1)
    assert ng.match([1, 2, 3], 4) == ([], 0)


def test_graft_follows_the_draft_then_branches():
    lk = Lookup()
    t = Tree.chain(0, [10, 11, 12], [0.9, 0.8, 0.2])
    new = lk.graft(t, [10, 11, 20, 21], 3)
    assert new == [4, 5]
    assert [t.parent[i] for i in new] == [2, 4] and [t.depth[i] for i in new] == [3, 4]
    assert [t.tokens[i] for i in new] == [20, 21] and all(t.rank[i] == LOOKUP_RANK for i in new)
    # the branch leaves node 2, whose own child holds 0.2 / 0.8 of its chance: the rest is the lookup's
    assert t.value[4] == pytest.approx(0.8 * lk.chance(2, 3) * (1 - 0.2 / 0.8))
    assert t.value[5] == pytest.approx(t.value[4] * lk.chance(3, 3))
    # the nodes it follows are worth at least the lookup's chance of them
    assert t.value[1] == pytest.approx(max(0.9, lk.chance(0, 3)))
    # a parent is never worth less than its child: the rerank keeps ancestors first
    for i in range(1, len(t.tokens)):
        assert t.value[i] <= t.value[t.parent[i]] + 1e-12
    # a lookup that goes on from the chain's end extends it
    t2 = Tree.chain(0, [10, 11], [0.9, 0.8])
    assert lk.graft(t2, [10, 11, 12], 2) == [3] and t2.parent[3] == 2


def test_learn_counts_until_the_first_miss():
    lk = Lookup()
    before = lk.chance(0, 2), lk.chance(1, 2)
    lk.learn([1, 2, 3, 4], 2, [1, 2, 9, 4, 5])  # right, right, wrong: the 4th is not tested
    assert lk.seen[0, 2] == 1 and lk.hits[0, 2] == 1
    assert lk.seen[1, 2] == pytest.approx(lk.DECAY + 1) and lk.hits[1, 2] == pytest.approx(lk.DECAY)
    assert lk.chance(0, 2) > before[0]
    lk.learn([7], 2, [8])
    assert lk.seen[0, 2] == pytest.approx(1 * lk.DECAY + 1) and lk.hits[0, 2] == pytest.approx(lk.DECAY)
    lk.learn([1, 2], 3, [1])  # only as far as the target emitted
    assert lk.seen[0, 3] == 1 and lk.seen[1, 3] == 0


def trained(hit: bool) -> Lookup:
    lk = Lookup()
    for _ in range(50):
        lk.learn([1, 2, 3, 4, 5, 6, 7, 8], 4, [1, 2, 3, 4, 5, 6, 7, 8, 9] if hit else [0])
    return lk


def test_alone_needs_measurements_and_must_beat_drafting():
    g = [1, 2, 3, 4, 5, 6, 7, 8]
    assert Lookup().alone(g, 4) == 0  # nothing measured yet
    lk = trained(True)
    for rows in (1, 5, 9):
        lk.observe_verify(rows, 0.100 + 0.002 * rows)  # a flat verify curve: rows are cheap
    lk.observe_step(4, 0.35)  # drafting steps: 11.4 tokens a second, a plain step 9.8
    assert lk.alone(g, 4) == len(g)  # each further token is likely right and costs little
    assert 0 < lk.alone(g, 1) < len(g)  # an n never tried takes the prior: its chances fall off sooner
    slow = trained(False)
    for rows in (1, 5, 9):
        slow.observe_verify(rows, 0.100 + 0.002 * rows)
    slow.observe_step(4, 0.35)
    assert slow.alone(g, 4) == 0  # the lookup's first tokens miss: drafting pays more
    fast = trained(True)
    for rows in (1, 5, 9):
        fast.observe_verify(rows, 0.100 + 0.002 * rows)
    fast.observe_step(1000, 1.0)
    assert fast.alone(g, 4) == 0


def test_extension_weighs_rows_against_their_cost():
    lk = trained(True)
    t = Tree.chain(0, [10, 11], [0.9, 0.8])
    lk.graft(t, [10, 11, 12, 13, 14], 4)
    for rows in (1, 3, 8):
        lk.observe_verify(rows, 0.1)  # rows are free: every likely lookup node pays
    assert lk.extension(t, 2, 0.05) == 3
    steep, t = Lookup(), Tree.chain(0, [10, 11], [0.9, 0.8])
    steep.graft(t, [10, 11, 12, 13, 14], 4)  # untrained: the prior's chances
    for rows in (1, 3, 8):
        steep.observe_verify(rows, 0.5 * rows)  # each row costs more than the lookup's nodes yield
    assert steep.extension(t, 2, 0.05) == 0
    assert Lookup().extension(t, 2, 0.05) == 0  # nothing measured


# ---------------------------------------------------------------- every path, lossless
@pytest.fixture
def forced(monkeypatch):
    """Every lookup decision forced on, in turn: alone on every other step with a proposal, and
    every grafted node kept beside the chain."""
    calls = {"alone": 0}

    def alone(self, g, n):
        calls["alone"] += 1
        return min(len(g), 1 + calls["alone"] % 7) if calls["alone"] % 2 else 0

    monkeypatch.setattr(Lookup, "alone", alone)
    monkeypatch.setattr(Lookup, "extension", lambda self, t, drafts, draft_s: len(t.tokens) - 1 - drafts)
    return calls


@pytest.mark.parametrize("tree", ["off", "on"])
def test_lookup_steps_are_lossless(engine, forced, tree):
    seen = {"alone": 0, "rows": 0, "taken": 0}
    for p in prompts():
        plain = engine.generate(p, max_new_tokens=48, speculative=False)
        for k in (3, "auto"):
            r = engine.generate(p, max_new_tokens=48, draft_max=k, tree=tree)
            assert r.tokens == plain.tokens, (p[:40], k, tree)
            seen["alone"] += r.stats["lookup_steps"]
            seen["rows"] += r.stats["lookup_rows"]
            seen["taken"] += r.stats["lookup_accepted"]
    off = engine.generate(p, max_new_tokens=48, tree=tree, lookup="off")
    assert off.tokens == plain.tokens and "lookup_rows" not in off.stats
    assert seen["alone"] > 0 and seen["rows"] > seen["taken"] > 0, seen


def test_lookup_in_a_batch_is_lossless(engine, forced):
    ps = prompts()
    plain = [engine.generate(p, max_new_tokens=40, speculative=False).tokens for p in ps]
    engine.batching(4)
    try:
        out = engine.generate_batch(ps, max_new_tokens=40)
    finally:
        engine.batching(1)
    assert [r.tokens for r in out] == plain


def test_lookup_by_default_is_lossless_and_pays_on_copies(engine):
    """Unforced: the measured choice. A prompt whose answer copies it gets lookup tokens accepted."""
    p = dev_prompts("repetition")[0]
    plain = engine.generate(p, max_new_tokens=64, speculative=False)
    r = engine.generate(p, max_new_tokens=64)
    assert r.tokens == plain.tokens
    assert r.stats["lookup_accepted"] > 0, r.stats


def test_sampling_ignores_lookup(engine):
    p = dev_prompts("repetition")[0]
    a = engine.generate(p, max_new_tokens=24, temperature=0.8, seed=3)
    b = engine.generate(p, max_new_tokens=24, temperature=0.8, seed=3, lookup="off")
    assert a.tokens == b.tokens and "lookup_rows" not in a.stats


# ---------------------------------------------------------------- bad input
def test_bad_lookup_setting(engine):
    with pytest.raises(ValueError, match="lookup must be one of"):
        engine.generate("hi", max_new_tokens=2, lookup="always")


def test_cli_bad_lookup_is_one_line():
    r = run_cli("generate", "-m", "/nonexistent/model", "--lookup", "always", "hi")
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode != 0 and len(lines) == 1 and "--lookup" in lines[0] and "Traceback" not in r.stderr, r.stderr


def test_graft_keeps_a_tree_rerankable():
    """Grafted onto a drafted tree of width 2, the kept nodes still come parents first."""
    from qspec.tree import select

    t = Tree([0], [-1], [0], [1.0])
    rng = np.random.default_rng(0)
    for i in range(1, 12):
        par = int(rng.integers(0, i))
        t.tokens.append(100 + i)
        t.parent.append(par)
        t.depth.append(t.depth[par] + 1)
        t.value.append(t.value[par] * float(rng.uniform(0.2, 0.9)))
        t.rank.append(0)
        t.prob.append(0.5)
    path = [0]
    while True:  # follow the draft for a while, then leave it
        kids = [i for i in range(len(t.tokens)) if t.parent[i] == path[-1]]
        if not kids:
            break
        path.append(kids[0])
    g = [t.tokens[i] for i in path[1:]] + [7, 8, 9]
    Lookup().graft(t, g, 2)
    for n in (2, 5, 9, len(t.tokens)):
        kept = select(t, n, sampled=False)
        assert all(t.parent[i] in kept[:k] for k, i in enumerate(kept) if k), kept


def test_server_counts_lookup_tokens():
    from qspec.server.app import Reply
    from qspec.server.metrics import Metrics

    m = Metrics()
    stats = {"drafted": 10, "accepted": 8, "acceptance_rate": 0.8, "lookup_rows": 7, "lookup_accepted": 3,
             "lookup_steps": 1}
    done = {"stats": stats, "prompt_tokens": 5, "completion_tokens": 9, "queue_s": 0.0, "first_token_s": 0.1}
    m.generation(done)
    assert m.registry.get_sample_value("qspec_lookup_tokens_total") == 7
    assert m.registry.get_sample_value("qspec_lookup_accepted_tokens_total") == 3
    assert Reply.extension(done)["lookup_accepted"] == 3
