"""The AVX-512, AVX512-BF16 and AMX kernels, run here under emulation.

A machine without those instructions never dispatches to them, so the ordinary run cannot test
them. This test builds a second `_C` from the same sources with QSPEC_ISA_EMULATION=ON
(csrc/emu/isa_emulation.h: AVX-512 intrinsics from SIMDe, AMX tiles in software, the probe
reporting every level) and runs the ISA-dependent test files against it in a child process:
every GEMM and attention path against the scalar oracle, whole-forward batch invariance per
level, tree rows == linear rows per level, and greedy speculative == plain greedy at each level. Emulation checks the code, not the
CPU: on an AVX-512/AMX machine the ordinary run covers the real instructions as well.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import qspec

REPO = Path(__file__).resolve().parents[1]
BUILD = REPO / "build" / "isa-emulation"

# The child imports the emulated build: its directory first on sys.path, and no import hook
# (such as an editable install's) that would hand back the installed qspec instead.
BOOTSTRAP = """
import importlib.machinery as m, sys
sys.path.insert(0, sys.argv.pop(1))
std = (m.BuiltinImporter, m.FrozenImporter, m.PathFinder)
sys.meta_path = [f for f in sys.meta_path if (isinstance(f, type) and issubclass(f, std))
                 or not getattr(f, "find_spec", lambda *a: None)("qspec", None)]
import qspec
info = qspec.cpu_info()
assert info["isa_emulation"] and info["isa_levels"][-1] == "amx", (qspec._C.__file__, info)
import pytest
sys.exit(pytest.main(sys.argv[1:]))
"""

# tree attention: the kernel and synthetic-model tests (the default model's tree rows: FULL)
TREE_FAST = ["test_tree_attention.py::test_tree_rows_equal_linear_path",
             "test_tree_attention.py::test_deep_chain_crosses_segments",
             "test_tree_attention.py::test_windowed_tree_rows_equal_linear_path",
             "test_tree_attention.py::test_small_model_tree_rows_equal_linear"]
# FAST keeps CI within its time: the kernels against their oracles, whole-forward batch invariance
# and short losslessness cases at every level; FULL (slow) adds the rest.
# the draft copy's attention kernels (the AVX-512 builds score INT4 K by integer dot products)
DRAFT_KV_FAST = [f"test_draft_kv.py::{t}" for t in (
    "test_kernel_against_f64", "test_window_and_sinks_against_f64", "test_kernel_batch_invariant_and_deterministic",
    "test_tree_rows_equal_linear_path", "test_int4_k_sums_the_same_with_and_without_vnni",
    "test_recent_keys_against_f64", "test_recent_keys_tree_rows_equal_linear_path", "test_sparse_pages_against_f64",
    "test_sparse_tree_rows_equal_linear_path", "test_sparse_pages_other_head_dims")]
FAST = ["test_gemm.py", "test_attention.py", "test_native_model.py", *TREE_FAST, *DRAFT_KV_FAST,
        "test_speculative.py::test_greedy_lossless_each_level", "test_peak.py"]  # the default draft, short cases
FULL = ["test_gemm.py", "test_attention.py", "test_native_model.py", "test_speculative.py",
        "test_tree_attention.py", "test_draft_kv.py", "test_batch.py",
        "test_tp.py::test_tp_suite",  # tensor parallelism: 2 ranks at every level
        "test_reference_hf.py", "test_membw.py", "test_peak.py", "test_levels.py::test_mx_chains_are_lossless"]


def _build() -> Path:
    """Configure once, then build incrementally; returns the emulated extension module."""
    simde_py = pytest.importorskip("simde_py", reason="the emulation build needs SIMDe: pip install '.[test]'")
    pybind11 = pytest.importorskip("pybind11")
    if not (REPO / "CMakeLists.txt").exists():
        pytest.skip("needs a source checkout (CMakeLists.txt next to tests/)")
    steps = [["--build", str(BUILD), "-j", str(os.cpu_count() or 1)]]
    if not (BUILD / "CMakeCache.txt").exists():
        steps.insert(0, ["-S", str(REPO), "-B", str(BUILD), "-DCMAKE_BUILD_TYPE=Release",
                         "-DQSPEC_ISA_EMULATION=ON", f"-DSIMDE_INCLUDE={simde_py.get_include()}",
                         f"-Dpybind11_DIR={pybind11.get_cmake_dir()}", f"-DPython_EXECUTABLE={sys.executable}"])
    for args in steps:
        r = subprocess.run(["cmake", *args], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    (so,) = BUILD.glob("_C*.so")
    return so


def _run_emulated(tmp_path, tests: list[str]) -> None:
    pkg = tmp_path / "qspec"
    shutil.copytree(Path(qspec.__file__).parent, pkg, ignore=shutil.ignore_patterns("_C*", "__pycache__"))
    if not (pkg / "bench").exists():  # an editable install: the wheel puts bench/ at qspec/bench
        shutil.copytree(REPO / "bench", pkg / "bench", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(_build(), pkg)
    r = subprocess.run([sys.executable, "-c", BOOTSTRAP, str(tmp_path), "-q", "-p", "no:cacheprovider", *tests],
                       cwd=Path(__file__).parent, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert " passed" in r.stdout and " failed" not in r.stdout, r.stdout[-3000:]


def test_emulated_isa_levels(tmp_path):
    """Kernels and batch invariance at every level; losslessness with the default draft."""
    _run_emulated(tmp_path, FAST)


@pytest.mark.slow
def test_emulated_isa_levels_full(tmp_path):
    """Every draft format's losslessness subset, a draft chain's, and the transformers comparison, emulated."""
    _run_emulated(tmp_path, FULL)
