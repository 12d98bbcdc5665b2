"""The compute-peak probe (_C.compute_peak): every kind at or below the selected ISA level gives a
rate, a kind above it or an unknown one is a ValueError."""

import pytest

from qspec import _C

LEVELS = ["scalar", "avx2", "avx512", "avx512_bf16", "amx"]
KINDS = {"fma_avx2": "avx2", "fma_avx512": "avx512", "dpbf16": "avx512_bf16", "amx_bf16": "amx"}


@pytest.mark.parametrize("kind", list(KINDS))
def test_compute_peak(kind):
    if LEVELS.index(_C.isa_selected()) < LEVELS.index(KINDS[kind]):
        with pytest.raises(ValueError, match=f"{kind} needs the {KINDS[kind]} level"):
            _C.compute_peak(kind, 0.01)
        return
    # a loose sanity range: at least one multiply-add a microsecond, at most 100 TFLOP/s a thread
    assert 1e-3 < _C.compute_peak(kind, 0.05) < 1e5 * _C.get_num_threads()


@pytest.mark.parametrize("kind, seconds, match", [("fma", 0.1, "unknown kind 'fma'"), ("dpbf16", 0, "seconds"),
                                                  ("dpbf16", 61, "seconds"), ("dpbf16", float("nan"), "seconds")])
def test_compute_peak_bad_input(kind, seconds, match):
    with pytest.raises(ValueError, match=match):
        _C.compute_peak(kind, seconds)
