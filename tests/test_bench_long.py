"""The long-prompt harness: bench/long_prompts.py, `qspec bench prefill`, `qspec bench e2e --context`."""

import json

import pytest

import qspec
from qspec import _C
from qspec.bench import e2e, prefill
from qspec.bench.long_prompts import QUESTION, long_prompts


@pytest.fixture(scope="module")
def engine(default_model_dir):
    return qspec.load(default_model_dir, draft=None)


@pytest.mark.parametrize("n", [300, 2000])
def test_long_prompts_are_real_documents_of_the_asked_length(engine, n):
    prompts = long_prompts(engine, n, 3)
    assert prompts == long_prompts(engine, n, 3)  # deterministic
    assert len({tuple(p) for p in prompts}) == 3
    for ids in prompts:
        assert n - 80 <= len(ids) <= n
        text = engine.tokenizer.decode(ids)
        assert "def " in text and "what does the function" in text
        func = text.split("the function `")[1].split("`")[0]
        assert f"def {func}(" in text  # the question is about a function the document defines
        lines = [line for line in text.splitlines() if line.strip()]
        assert len(set(lines)) > 0.7 * len(lines)  # not repeated filler
    assert QUESTION.split("{")[0].strip() in engine.tokenizer.decode(prompts[0])


def test_long_prompts_too_long_is_one_error(engine):
    with pytest.raises(SystemExit, match="standard-library files"):
        long_prompts(engine, 10**7, 1)


def test_bench_prefill_quick(default_model_dir, tmp_path, capsys):
    out = tmp_path / "prefill.jsonl"
    prefill.main(["--quick", "--lengths", "128,384", "--json", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt_tokens"] for r in rows] == [pytest.approx(128, abs=64), pytest.approx(384, abs=64)]
    for r in rows:
        assert r["ttft_s"] > 0 and r["prompt_tok_s"] > 0 and r["gemm_gflops"] > 0 and r["torch_gflops"] > 0
        assert 0 < r["gemm_share"] < 1 and 0 < r["attention_share"] < 1
        assert r["peak_gflops"] is None or 0 < r["of_peak"] < 1.5
    text = capsys.readouterr().out
    assert "bench.prefill" in text and "GEMM clock peak" in text
    assert ("measured GEMM peak" in text) == (_C.isa_selected() != "scalar")
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        assert "# llama.cpp: skipped (llama-cpp-python is not installed" in text


def test_bench_prefill_no_peer(default_model_dir, capsys):
    prefill.main(["--quick", "--lengths", "128", "--no-peer"])
    assert "# llama.cpp: skipped (--no-peer)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        prefill.main(["--no-peer", "--peer-server", "x", "--peer-gguf", "y"])
    assert "--no-peer and --peer-server exclude each other" in capsys.readouterr().err


def test_bench_e2e_context_quick(default_model_dir, tmp_path, capsys):
    out = tmp_path / "e2e.jsonl"
    e2e.main(["--quick", "--context", "256", "--ks", "2", "--temps", "0", "--no-synthetic", "--prompts", "2", "--max-new", "24",
              "--draft-kv", "int4,bf16", "--draft-windows", "0,64", "--draft-sparse", "0,256", "--json", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    spec = [r for r in rows if r.get("mode") == "speculative"]
    # a draft window and a sparse budget are over the draft copy: none with the BF16 cache
    assert sorted((r["draft_kv"], r["draft_window"], r["draft_sparse"]) for r in spec) == [
        ("bf16", 0, 0), ("int4", 0, 0), ("int4", 0, 256), ("int4", 64, 0), ("int4", 64, 256)]
    for r in spec:
        assert r["context"] == 256 and r["speedup"] > 0 and 0 < r["acceptance_rate"] <= 1 and r["c"] > 0


@pytest.mark.parametrize("args,word", [(["e2e", "--context", "10"], "--context"),
                                       (["e2e", "--draft-kv", "int2"], "--draft-kv"),
                                       (["e2e", "--draft-windows", "0,-8"], "--draft-windows"),
                                       (["e2e", "--draft-sparse", "0,8"], "--draft-sparse"),
                                       (["prefill", "--lengths", "10"], "--lengths"),
                                       (["prefill", "--peer-server", "llama-server"], "--peer-gguf")])
def test_bad_harness_flags_are_one_error(args, word, capsys):
    from qspec.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and word in err and err.count("error:") == 1
