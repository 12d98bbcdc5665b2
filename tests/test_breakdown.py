"""The per-step profile of the native forward (Model.profile) and `qspec bench breakdown` on the
default model (SmolLM2-135M with its default draft)."""

import json

import pytest

import qspec
from qspec.bench import breakdown

GEMMS = breakdown.GEMMS
CONTEXT = 48


@pytest.fixture(scope="module")
def backend(default_model_dir):
    be = qspec.load(default_model_dir).backend
    be.kv.ensure_capacity(CONTEXT + 8)
    be.forward(list(range(100, 100 + CONTEXT)), 0)  # the cache holds CONTEXT target rows
    return be


@pytest.mark.parametrize("draft", [False, True], ids=["target", "draft"])
@pytest.mark.parametrize("m", [1, 5])
def test_profile_pieces_add_up_to_the_forward(backend, m, draft):
    model = backend.model
    model.profile_reset()
    assert model.profile()["calls"] == 0 and model.profile()["total_s"] == 0
    backend.forward(list(range(200, 200 + m)), CONTEXT, all_logits=m > 1, draft=draft)
    p = model.profile()
    assert p["calls"] == 1 and p["total_s"] > 0
    pieces = sum(p[f"gemm_{g}_s"] for g in GEMMS) + p["attention_s"] + p["rowwise_s"] + p["reduce_s"]
    assert pieces == pytest.approx(p["total_s"], rel=1e-9)
    assert p["gemm_s"] == pytest.approx(sum(p[f"gemm_{g}_s"] for g in GEMMS), rel=1e-12)
    assert p["other_s"] == pytest.approx(p["rowwise_s"], rel=1e-6, abs=1e-12)  # the older key, same piece
    assert p["reduce_s"] == 0  # one process: no tensor-parallel reductions
    for g in GEMMS:
        wall, prep, idle = p[f"gemm_{g}_s"], p[f"gemm_{g}_prep_s"], p[f"gemm_{g}_idle_s"]
        assert wall > 0 and prep >= 0 and idle >= 0, g
        assert prep + idle <= wall, g  # both are parts of the GEMM call's wall time
    assert p["gemm_prep_s"] == pytest.approx(sum(p[f"gemm_{g}_prep_s"] for g in GEMMS), rel=1e-12)
    assert p["gemm_idle_s"] == pytest.approx(sum(p[f"gemm_{g}_idle_s"] for g in GEMMS), rel=1e-12)
    assert 0 <= p["gemm_idle_s"] <= p["gemm_idle_thread_s"] + 1e-12
    assert 0 <= p["attention_idle_s"] <= p["attention_s"]
    assert p["attention_idle_s"] <= p["attention_idle_thread_s"] + 1e-12
    assert p["rowwise_s"] > 0
    if draft:  # MX weights: the activations are quantized to Q8 before the kernels
        assert p["gemm_prep_s"] > 0


def test_profile_sums_over_calls_and_keeps_the_logits(backend):
    """The timers change nothing: the same forward twice gives the same logits bit for bit."""
    model = backend.model
    model.profile_reset()
    a = backend.forward([7, 8, 9], CONTEXT, all_logits=True).copy()
    b = backend.forward([7, 8, 9], CONTEXT, all_logits=True)
    assert (a == b).all()
    assert model.profile()["calls"] == 2


def test_bench_breakdown_quick(default_model_dir, tmp_path, capsys):
    out, png = tmp_path / "breakdown.jsonl", tmp_path / "breakdown.png"
    breakdown.main(["--quick", "--ms", "1,3", "--draft-ms", "4", "--reps", "2", "--context", str(CONTEXT),
                    "--prompts", "1", "--max-new", "8", "--json", str(out), "--plot", str(png)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    cases = [(r["case"], r["m"]) for r in rows if r["case"] != "controller"]
    assert cases == [("draft", 1), ("draft", 4), ("target", 1), ("target", 3)]
    for r in rows[:4]:
        assert r["step_ms"] > 0 and r["native_ms"] > 0 and r["context"] == CONTEXT and 0 < r["byte_ratio"] < 1
        assert all(k in r for k in breakdown.PIECES), r
        assert r["qkv"] > 0 and r["lm_head"] > 0 and r["gemm_idle"] >= 0 and r["attn_idle"] >= 0
    draft1, draft4, target1, target3 = rows[:4]
    assert target1["ratio"] == 1.0 and draft1["ratio"] > 0 and target3["ratio"] > 0
    assert draft1["vs_m1"] == 1.0 and target1["vs_m1"] == 1.0 and target3["vs_m1"] == target3["ratio"]
    assert draft4["vs_m1"] == pytest.approx(draft4["step_ms"] / draft1["step_ms"])  # d(4)
    assert draft4["ratio"] == pytest.approx(draft4["step_ms"] / target1["step_ms"])
    ctl = rows[4]
    assert ctl["case"] == "controller" and ctl["prompts"] == 1 and ctl["new_tokens"] == 8
    assert ctl["native_pct"] + ctl["around_forward_pct"] + ctl["controller_pct"] == pytest.approx(100)
    assert 0 < ctl["native_pct"] <= 100 and ctl["around_forward_pct"] >= 0 and ctl["controller_pct"] >= 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert "bench.breakdown" in text and "native forward" in text and "lm_head" in text


def test_controller_share_counts_tree_steps(default_model_dir):
    """Tree steps keep their draft and verify time apart (tree_draft_s, tree_verify_s): the share
    around the forwards counts them, so no share goes negative."""
    import qspec

    eng = qspec.load(default_model_dir)
    ctl = breakdown.controller_share(eng, ["Write a haiku about the sea."], 16, tree="on")
    assert ctl["native_pct"] + ctl["around_forward_pct"] + ctl["controller_pct"] == pytest.approx(100)
    assert 0 < ctl["native_pct"] <= 100 and ctl["around_forward_pct"] >= 0 and ctl["controller_pct"] >= 0


@pytest.mark.parametrize("flag", ["--ms", "--draft-ms"])
@pytest.mark.parametrize("bad", ["0", "1,x", "65", ""])
def test_bad_ms_is_one_usage_error(flag, bad, capsys):
    from qspec.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "breakdown", flag, bad])
    err = capsys.readouterr().err
    assert e.value.code == 2 and flag in err and err.count("error:") == 1



@pytest.mark.parametrize("args", [
    ["kernels", "--ms", "0"], ["kernels", "--shapes", "3x0"], ["kernels", "--shapes", "3y4"],
    ["rows", "--ms", "-1"], ["attention", "--contexts", "0"], ["attention", "--draft-sparse", "7"],
    ["membw", "--threads", "0"], ["e2e", "--prompts", "0"], ["e2e", "--max-new", "-2"],
    ["decode", "--window", "0"], ["batch", "--batch", "0"], ["prefill", "--reps", "0"],
    ["serve", "--max-tokens", "0"], ["tp", "--tau", "inf"], ["peer", "--lookup-n", "0"],
])
def test_bad_bench_counts_are_one_usage_error(args, capsys):
    """A count, size or rate of 0 or less: one usage line naming the flag, before any work (it was a
    kernel error, a numpy error or a run that never ended)."""
    from qspec.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and args[1] in err and err.count("error:") == 1, err
