"""Memory of the KV cache for a context size, and the check that it fits before it is allocated.

The BF16 cache holds layers x 2 (K, V) x kv_heads x head_dim values of 2 bytes per position; the
draft copy (qspec/kv_cache.py, csrc/kv_q8.h) 1 byte ("int8") or half a byte ("int4") per value, one
scale byte per 32 values (INT4 K: a BF16 center and a scale byte per channel per page of
PAGE_SIZE positions), and one flag byte per position."""

from __future__ import annotations

import numpy as np

from .config import ModelConfig
from .errors import ContextMemoryError

PAGE_SIZE = 32  # positions per page of the KV cache: a multiple of 8 (the kernels' key blocks never
# straddle pages), and the INT4 K copy's group (csrc/kv_q8.h: 3 bytes per channel per page)
Q8_BLOCK = 32  # values per scale byte of the draft copy (csrc/kv_q8.h)
DRAFT_COPY_BITS = {"int8": 8, "int4": 4}  # bits per value of each draft copy


def page_aligned_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """np.empty whose data starts on a 4 KiB page, for the arrays the kernels stream (the KV
    cache, its draft copy, the logits). numpy's large blocks start 16 bytes past a page, so every
    64-byte piece the kernels read or write spanned two lines (one decode row's attention over
    8,192 keys of Qwen2.5-Coder-1.5B's cache 2-7% slower, amx and avx512 paths). Untouched pages
    still cost no RSS."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(n + 4096, np.uint8)
    start = -raw.ctypes.data % 4096
    return raw[start:start + n].view(dtype).reshape(shape)


def page_aligned(a: np.ndarray) -> np.ndarray:
    """A copy of `a` in a page_aligned_empty array."""
    out = page_aligned_empty(a.shape, a.dtype)
    out[...] = a
    return out


def draft_copy_arrays(cfg: ModelConfig, fmt: str, rows: int, page_size: int = PAGE_SIZE):
    """The arrays of the draft copy `fmt` over `rows` pool rows, as (shape, dtype): K values, V
    values, K scales, V scales, flags (csrc/attention.h KvCacheView::q8k)."""
    layers, kvh, hd, bits = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, DRAFT_COPY_BITS[fmt]
    k_scales = hd // Q8_BLOCK if bits == 8 else 3 * hd // page_size
    return [((layers, 1, rows, kvh, hd * bits // 8), np.int8), ((layers, 1, rows, kvh, hd * bits // 8), np.int8),
            ((layers, 1, rows, kvh, k_scales), np.uint8), ((layers, 1, rows, kvh, hd // Q8_BLOCK), np.uint8),
            ((1, 1, rows, 1, 1), np.uint8)]


def draft_copy_of(kv: np.ndarray, fmt: str, written: int, page_size: int = PAGE_SIZE) -> tuple:
    """The draft copy `fmt` of BF16 rows kv [layers, 2, rows, kv_heads, head_dim] (rows a multiple
    of page_size) as the forward passes write it (csrc/kv_q8.h): every row's V (and INT8 K) copy,
    the INT4 K copy of the whole pages below row `written`, flagged, in page-aligned arrays as the
    pool's. For benchmarks and tests."""
    from . import _C

    layers, _, rows, kvh, hd = kv.shape
    flags = np.zeros((1, 1, rows, 1, 1), np.uint8)
    if fmt == "int8":
        (qk, ek), (qv, ev) = (_C.kv_q8_quantize(np.ascontiguousarray(kv[:, i:i + 1])) for i in (0, 1))
        return tuple(page_aligned(a) for a in (qk, qv, ek, ev, flags))
    qv, ev = _C.kv_q4_quantize(np.ascontiguousarray(kv[:, 1:]))
    qk = np.zeros((layers, 1, rows, kvh, hd // 2), np.int8)
    ek = np.zeros((layers, 1, rows, kvh, 3 * hd // page_size), np.uint8)
    for g0 in range(0, written - page_size + 1, page_size):
        x = np.ascontiguousarray(kv[:, 0, g0:g0 + page_size]).reshape(layers, page_size, kvh * hd)
        packed, params = _C.kv_k4_group(x, hd)
        qk[:, 0, g0:g0 + page_size] = packed.reshape(layers, page_size, kvh, hd // 2)
        ek[:, 0, g0:g0 + page_size] = params.reshape(layers, page_size, kvh, -1)  # the page's bytes, row by row
        flags[0, 0, g0] = 1
    return tuple(page_aligned(a) for a in (qk, qv, ek, ev, flags))


def kv_bytes_per_token(cfg: ModelConfig) -> int:
    """BF16 bytes of one position of the cache (every layer, K and V)."""
    return cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * 2


def draft_kv_bytes_per_token(cfg: ModelConfig, fmt: str) -> int:
    """Bytes of one position of the draft copy `fmt` (values, scales, flag; pages of PAGE_SIZE)."""
    return sum(int(np.prod(shape)) for shape, _ in draft_copy_arrays(cfg, fmt, 1))


def available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (psutil's figure where there is none); None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().available)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def check_fits(needed: int, what: str) -> None:
    """Raise ContextMemoryError naming both figures when `needed` bytes exceed the available memory."""
    avail = available_bytes()
    if avail is not None and needed > avail:
        raise ContextMemoryError(f"{what} needs {needed} bytes ({human(needed)}) but only {avail} bytes "
                                 f"({human(avail)}) of memory are available; use a smaller --ctx-size")


def cache_bytes(cfg: ModelConfig, tokens: int, draft_copy: str | None) -> int:
    """Bytes of a cache of `tokens` positions (with the draft copy `draft_copy`, or none)."""
    return tokens * (kv_bytes_per_token(cfg) + (draft_kv_bytes_per_token(cfg, draft_copy) if draft_copy else 0))


def describe(cfg: ModelConfig, tokens: int, draft_copy: str | None) -> str:
    """One line: the cache's memory at `tokens` positions, and the memory available."""
    bf16 = tokens * kv_bytes_per_token(cfg)
    line = f"KV cache for {tokens} tokens: {human(bf16)} BF16"
    if draft_copy:
        copy = tokens * draft_kv_bytes_per_token(cfg, draft_copy)
        line += f" + {human(copy)} {draft_copy.upper()} draft copy ({100 * copy / bf16:.0f}% of the BF16 cache)"
    avail = available_bytes()
    return line + (f"; {human(avail)} available" if avail is not None else "")
