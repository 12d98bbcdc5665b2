"""qspec bench attention: every usable path at decode / verify / prefill shapes (quick, synthetic cache)."""

import json

import pytest

from qspec import _C
from qspec.bench import attention


def test_attention_quick_reports_every_path_and_a_of_m(tmp_path):
    out = tmp_path / "attn.jsonl"
    threads = _C.get_num_threads()
    try:
        attention.main(["--quick", "--contexts", "300", "--ms", "1,3", "--prefill", "--reps", "2",
                        "--json", str(out)])
    finally:
        _C.set_num_threads(threads)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    paths = [p for p in _C.attn_paths() if p != "ref"] or ["ref"]
    assert {(r["path"], r["m"]) for r in rows} == {(p, m) for p in paths for m in (1, 3, 300)}
    for r in rows:
        assert r["context"] == 300 and r["ms_per_step"] > 0 and r["gflops"] > 0 and r["read_gbps"] > 0
        assert r[f"vs_{paths[0]}"] > 0 and (r["a(M)"] == 1.0) == (r["m"] == 1)
    # a 300-row prompt does ~150x the work of one row: it cannot cost less than 3 rows
    for p in paths:
        a = {r["m"]: r["a(M)"] for r in rows if r["path"] == p}
        assert a[300] > a[3] > 0


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_attention_over_the_draft_copy(tmp_path, fmt):
    out = tmp_path / "attn.jsonl"
    threads = _C.get_num_threads()
    try:
        attention.main(["--quick", "--contexts", "300", "--ms", "1,2", "--reps", "2", "--draft-kv", fmt,
                        "--json", str(out)])
    finally:
        _C.set_num_threads(threads)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    paths = [p for p in _C.attn_paths() if p != "ref"] or ["ref"]
    assert {(r["path"], r["m"]) for r in rows} == {(p, m) for p in paths for m in (1, 2)}
    # the bytes counted are the copy's: under 30% / 55% of the BF16 rows' (2 K/V x 300 x 2 heads x 128 x 2)
    bf16_bytes = 2 * 300 * 2 * 128 * 2
    for r in rows:
        assert r["draft_kv"] == fmt and r["ms_per_step"] > 0
        assert r["kv_gbps"] * r["ms_per_step"] / 28 * 1e-3 * 1e9 < bf16_bytes * (0.3 if fmt == "int4" else 0.55)


def test_attention_sparse_budgets_side_by_side(tmp_path):
    out = tmp_path / "attn.jsonl"
    threads = _C.get_num_threads()
    try:
        attention.main(["--quick", "--contexts", "2000", "--ms", "1", "--reps", "2", "--draft-kv", "int4",
                        "--draft-sparse", "0,256", "--json", str(out)])
    finally:
        _C.set_num_threads(threads)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    paths = [p for p in _C.attn_paths() if p != "ref"] or ["ref"]
    assert sorted((r["path"], r["draft_sparse"]) for r in rows) == sorted((p, b) for p in paths for b in (0, 256))
    assert all(r["ms_per_step"] > 0 for r in rows)


@pytest.mark.parametrize("args,word", [(["--paths", "avx9"], "avx9"), (["--ms", "0"], "--ms"),
                                       (["--contexts", "1,-4"], "--contexts"), (["--reps", "0"], "--reps"),
                                       (["--draft-kv", "int2"], "--draft-kv"),
                                       (["--draft-kv", "int4", "--draft-sparse", "0,100"], "--draft-sparse"),
                                       (["--draft-sparse", "512"], "--draft-sparse")])
def test_bad_attention_flags_are_one_error(args, word, capsys):
    with pytest.raises(SystemExit) as e:
        attention.main(args)
    msg = str(e.value.code) + capsys.readouterr().err
    assert word in msg and msg.count("error:") == 1
