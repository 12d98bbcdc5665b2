"""qspec bench rows: whole-model d(M) and c by thread CPU time (quick mode, synthetic weights)."""

import json
import math

import torch

from qspec import _C
from qspec.bench import rows


def test_rows_quick_reports_d_and_c(tmp_path):
    out = tmp_path / "rows.jsonl"
    threads, torch_threads = _C.get_num_threads(), torch.get_num_threads()
    try:
        rows.main(["--quick", "--ms", "1,2", "--json", str(out)])
    finally:
        _C.set_num_threads(threads)  # the bench runs on one thread; later tests keep the suite's count
        torch.set_num_threads(torch_threads)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    per_gemm = [r for r in lines if "cpu_us_median" in r]
    summary = [r for r in lines if "d(2)" in r]
    assert {r["layer"] for r in per_gemm} == {"q/o", "k/v", "gate/up", "down", "lm_head"}
    assert all(r["cpu_us_median"] > 0 and r["threads"] == 1 for r in per_gemm)
    (s,) = summary
    # An MXFP4 pass streams ~0.27 of the BF16 bytes; two rows cost more than none and less than four one-row passes.
    assert 0.05 < s["c"] < 1.5 and 0.5 < s["d(2)"] < 4 and math.isfinite(s["M1_ms"])
