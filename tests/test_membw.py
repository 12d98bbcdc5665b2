"""The read-bandwidth probe (csrc/membw.cpp, csrc/x86/membw_*.cpp): every load width the selected
ISA level allows computes the same checksum as a scalar reference (numpy: the uint64 words summed
modulo 2^64), for every stream count and piece size, so the reads cannot be optimised away and
the code that bench/ times is checked. Under the emulation build (tests/test_isa_emulation.py)
the avx512 width runs too."""

import numpy as np
import pytest

from qspec import _C

WIDTHS = ["sse2", "avx2", "avx512"]


def reference(buf: np.ndarray) -> int:
    return int(np.sum(buf.view(np.uint64), dtype=np.uint64))


@pytest.fixture(scope="module")
def buf():
    # 3 full pieces of 4 streams x 256 bytes, a remainder that is not a whole piece, a tail
    # shorter than one 128-byte step per stream; random bytes, so every word and lane counts
    rng = np.random.default_rng(7)
    return rng.integers(0, 256, size=3 * 4 * 256 + 5 * 128 + 40, dtype=np.uint8)


def test_widths_follow_the_isa_level():
    info = _C.cpu_info()
    allowed = _C.read_widths()
    assert allowed[0] == "sse2"
    assert ("avx2" in allowed) == (info["isa_selected"] != "scalar")
    assert ("avx512" in allowed) == (info["isa_selected"] in ("avx512", "avx512_bf16", "amx"))
    assert _C.read_probe_defaults()["width"] == allowed[-1]


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("streams", [1, 2, 3, 4, 8, 16])
def test_checksum_matches_scalar_reference(buf, width, streams):
    if width not in _C.read_widths():
        pytest.skip(f"{width} loads not available at isa_selected={_C.isa_selected()}")
    ref = reference(buf)
    for chunk in (128, 256, 4096):
        for threads in (1, 2):
            for prefetch in (0, 512):
                got = _C.read_sum(buf, width, streams, threads, chunk, prefetch)
                assert got == ref, (width, streams, chunk, threads, prefetch)
    # unaligned start, and a buffer smaller than one step of every stream
    assert _C.read_sum(buf[8:], width, streams, 2, 128, 0) == reference(buf[8:])
    assert _C.read_sum(buf[:64], width, streams, 1, 128, 0) == reference(buf[:64])


def test_probe_runs_and_checks_itself():
    p = _C.ReadProbe(2 << 20, threads=1, streams=4)
    assert p.width == _C.read_widths()[-1] and p.streams == 4 and p.nbytes == 2 << 20
    secs = p.run(2)
    assert len(secs) == 2 and all(s > 0 for s in secs)
    assert len(_C.read_bandwidth_probe(1 << 20, reps=1, threads=1, width="sse2")) == 1


def test_isa_limit_narrows_the_width():
    before = _C.isa_selected()
    try:
        _C.set_isa_limit("scalar")
        assert _C.read_widths() == ["sse2"]
        assert _C.ReadProbe(1 << 20, threads=1).width == "sse2"
        with pytest.raises(ValueError, match="not usable here"):
            _C.read_sum(np.zeros(64, np.uint8), "avx2")
    finally:
        _C.set_isa_limit(before)


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown read width"):
        _C.read_sum(np.zeros(64, np.uint8), "avx3")
    with pytest.raises(ValueError, match="streams"):
        _C.read_sum(np.zeros(64, np.uint8), "sse2", 17)
    with pytest.raises(ValueError, match="multiple of 8"):
        _C.read_sum(np.zeros(12, np.uint8), "sse2")
    with pytest.raises(ValueError, match="1 MiB"):
        _C.ReadProbe(1000)
