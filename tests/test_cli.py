"""The `qspec` command: output, stats line, JSON, and one-line errors with non-zero exit."""

import json
import os
import subprocess
import sys

import pytest


def run(*args, stdin=None, env=None):
    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "qspec.cli", *args], input=stdin, capture_output=True,
                          text=True, env=e, timeout=600)


def assert_one_line_error(r, *words):
    assert r.returncode != 0
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for w in words:
        assert w in lines[0], lines[0]


def test_info():
    r = run("info")
    assert r.returncode == 0 and "isa" in r.stdout and "threads" in r.stdout


def test_info_honours_qspec_isa():
    r = run("info", env={"QSPEC_ISA": "scalar"})
    assert r.returncode == 0 and "selected scalar" in r.stdout
    assert "draft_max auto; tree off" in r.stdout  # trees are a default at the amx level only


def test_info_names_the_defaults_of_this_isa_level():
    from qspec import cpu_info
    from qspec.engine import DEFAULT_TREE_BY_ISA

    r = run("info")
    line = next(x for x in r.stdout.splitlines() if x.startswith("defaults"))
    assert "draft mxfp4 from 300M GEMM weights (mxfp6_e2m3 below)" in line, line
    tree = DEFAULT_TREE_BY_ISA.get(cpu_info()["isa_selected"], "off")
    assert f"tree {tree}" + (" from 300M GEMM weights at this ISA level (off below)" if tree != "off" else "") in line, line
    assert line.endswith("; lookup auto (greedy)"), line


def test_bad_qspec_isa():
    assert_one_line_error(run("info", env={"QSPEC_ISA": "sse9"}), "QSPEC_ISA")


def test_generate_default_model_streams_and_reports(default_model_dir):
    r = run("generate", "-n", "24", "What is the capital of France?")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    stats = r.stderr.strip().splitlines()[-1]
    for key in ("prompt", "prefill", "tok/s", "drafted", "accepted", "tok/step", "draft", "verify"):
        assert key in stats, stats


def test_generate_json_stdin_plain(default_model_dir):
    r = run("generate", "--json", "--draft", "none", "-n", "8", "--no-chat", stdin="The capital of France is")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["tokens"]) <= 8 and out["text"] and out["stats"]["new_tokens"] == len(out["tokens"])
    assert out["finish_reason"] in ("stop", "length") and "logprobs" not in out
    r = run("generate", "--json", "-n", "8", "--no-chat", "--stop", "\n", "--logprobs", "2",
            stdin="The capital of France is")
    out = json.loads(r.stdout)
    assert [d["token"] for d in out["logprobs"]] == out["tokens"] and "\n" not in out["text"]
    assert all(len(d["top"]) == 2 and d["logprob"] <= 0 for d in out["logprobs"])


def test_quantize_then_generate_from_draft_file(default_model_dir, tmp_path):
    f = tmp_path / "d.safetensors"
    r = run("quantize", str(default_model_dir), "--format", "mxfp4", "-o", str(f))
    assert r.returncode == 0, r.stderr
    a = run("generate", "--json", "-m", str(default_model_dir), "--draft-file", str(f), "-n", "24", "Hi!")
    b = run("generate", "--json", "-m", str(default_model_dir), "--draft", "none", "-n", "24", "Hi!")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert json.loads(a.stdout)["tokens"] == json.loads(b.stdout)["tokens"]
    assert json.loads(a.stdout)["stats"]["drafted"] > 0


@pytest.mark.parametrize("args,words", [
    (["generate", "-m", "/nonexistent/model", "hi"], ["/nonexistent/model"]),
    (["generate", "-n", "0", "hi"], ["max-new-tokens"]),
    (["generate", "--draft-max", "33", "hi"], ["draft-max"]),
    (["generate", "--draft-max", "0", "hi"], ["draft-max"]),
    (["generate", "--draft", "mxfp3", "hi"], ["--draft"]),
    (["generate", "--draft-p-min", "1.5", "hi"], ["draft_p_min"]),
    (["generate", "--temp", "-1", "hi"], ["temperature"]),
    (["generate", "--top-p", "0", "hi"], ["top_p"]),
    (["generate", "--top-k", "-2", "hi"], ["top_k"]),
    (["generate", "--bogus-flag", "hi"], ["--bogus-flag"]),
    (["generate", "--logprobs", "2", "hi"], ["--logprobs", "--json"]),
    (["generate", "--json", "--logprobs", "21", "hi"], ["logprobs", "0..20"]),
    (["generate", "--stop", "", "hi"], ["stop"]),
    (["generate", "--draft-file", "/nonexistent.safetensors", "hi"], ["/nonexistent.safetensors"]),
    (["generate", "--draft-window", "-1", "hi"], ["--draft-window"]),
    (["generate", "--draft-window", "64", "--draft-kv", "bf16", "hi"], ["draft window", "draft KV copy"]),
    (["generate", "--draft-sparse", "100", "hi"], ["--draft-sparse", ">= 256"]),
    (["generate", "--draft-sparse", "512", "--draft-kv", "bf16", "hi"], ["sparse draft attention", "draft KV copy"]),
    (["convert", "/nonexistent.gguf", "/tmp/qspec-never"], ["/nonexistent.gguf"]),
    (["serve", "-c", "1000000"], ["--ctx-size", "8192"]),
    (["serve", "--draft-max", "0"], ["draft-max"]),
    (["serve", "--port", "http"], ["--port"]),
    (["serve", "-m", "/nonexistent/model"], ["/nonexistent/model"]),
])
def test_user_errors_are_one_line(args, words):
    r = run(*args)
    assert_one_line_error(r, *words)


def test_prompt_too_long(default_model_dir):
    r = run("generate", "-n", "10", "--no-chat", "word " * 9000)
    assert_one_line_error(r, "context")


def test_not_a_model_dir(tmp_path):
    assert_one_line_error(run("generate", "-m", str(tmp_path), "hi"), "config.json")


def test_draft_file_of_another_model(default_model_dir, tmp_path):
    from qspec.synthetic import save_model_dir, synthetic_config, synthetic_weights

    cfg = synthetic_config("smollm2-135m", hidden_size=64, intermediate_size=128, n_layers=2, n_heads=4,
                           n_kv_heads=2, head_dim=16, vocab_size=32)
    tiny = save_model_dir(tmp_path / "tiny", cfg, synthetic_weights(cfg))
    f = tmp_path / "tiny-draft.safetensors"
    assert run("quantize", str(tiny), "-o", str(f)).returncode == 0
    r = run("generate", "-m", str(default_model_dir), "--draft-file", str(f), "hi")
    assert_one_line_error(r, "another checkpoint")


def test_more_threads_than_cpus_warns_and_runs(default_model_dir):
    """-t past the CPUs this process may run on: one warning line, then the answer as usual."""
    n = len(os.sched_getaffinity(0)) + 1
    r = run("generate", "-m", str(default_model_dir), "-t", str(n), "--draft", "none", "-n", "2", "hi")
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    assert [l for l in r.stderr.splitlines() if "warning" in l] == [
        f"qspec: warning: {n} threads on the {n - 1} CPUs this process may run on: every pass waits for its "
        "slowest thread, so it runs slower than with one thread a CPU"]
