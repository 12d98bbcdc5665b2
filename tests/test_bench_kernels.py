"""`qspec bench kernels`: one small custom shape, the VNNI kernel's forced row-block variants, a
model's own weights."""

import json

import numpy as np
import pytest

from qspec import _C
from qspec.bench import kernels


def test_bench_kernels_row_block_variants(tmp_path):
    if "avx512" not in _C.cpu_info()["isa_levels"] or not _C.mx_vnni():
        pytest.skip("no VNNI avx512 path on this CPU")
    out = tmp_path / "k.jsonl"
    kernels.main(["--quick", "--shapes", "64x256", "--formats", "mxfp4", "--ms", "1,3", "--no-torch",
                  "--mx-row-blocks", "1,4", "--json", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    for m in (1, 3):
        paths = {r["path"] for r in rows if r["m"] == m}
        assert {"avx512_vnni", "avx512_vnni_rb1", "avx512_vnni_rb4"} <= paths
        assert all(r["us_median"] > 0 for r in rows if r["m"] == m)
        assert all(r["isa"] == "avx512" for r in rows if r["m"] == m and r["path"].startswith("avx512_vnni"))
    assert _C.set_mx_row_blocks(0) == 0  # the variants put the CPU's choice back


def test_bench_kernels_bad_row_blocks(capsys):
    with pytest.raises(SystemExit):
        kernels.main(["--shapes", "64x256", "--mx-row-blocks", "3"])
    assert "--mx-row-blocks takes 1, 2 or 4" in capsys.readouterr().err


def test_bench_kernels_real_weights(default_model_dir, tmp_path):
    """--real-weights: the model's own middle layer and LM head, MX cast as the drafts are (what
    the draft packs): every GEMM of the model timed, the rows marked not synthetic."""
    out = tmp_path / "k.jsonl"
    kernels.main(["--model", str(default_model_dir), "--real-weights", "--formats", "mxfp4", "--ms", "1",
                  "--no-torch", "--quick", "--json", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["layer"] for r in rows} == {"qkv", "o", "gate_up", "down", "lm_head"}
    assert all(not r["synthetic"] and r["us_median"] > 0 for r in rows)
    w = kernels.model_weights(str(default_model_dir))
    assert w["lm_head"].dtype == np.uint16 and w["gate_up"].shape == (2 * 1536, 576)
    assert kernels.cast_weight("mxfp4", w["down"]).nbytes == 576 * 1536 * 17 // 32


def test_bench_kernels_real_weights_need_a_model(capsys):
    with pytest.raises(SystemExit):
        kernels.main(["--real-weights", "--shapes", "64x256"])
    assert "--real-weights needs --model" in capsys.readouterr().err


def test_bench_kernels_real_weights_bad_model(tmp_path):
    """A model directory that cannot be read: one line, no traceback."""
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit, match="^bench: error: ") as e:
        kernels.model_weights(str(tmp_path))
    assert "\n" not in str(e.value)
