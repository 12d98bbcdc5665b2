"""Rotary position embedding tables (HF Llama convention: rotate-half, cat(freqs, freqs)), in numpy.

One table per RoPE base a model uses (Gemma 3: global and local layers), over rope_dim columns.

The angles are HF's: fp32 inverse frequencies times fp32 positions, one fp32 product. Their cos and
sin are taken in float64 and rounded once to fp32, so the tables do not depend on a library's
vectorized fp32 cos."""

from __future__ import annotations

import math

import numpy as np

from .config import ModelConfig


def inv_frequencies(cfg: ModelConfig, table: int = 0, long: bool = False) -> np.ndarray:
    """[rope_dim // 2] fp32, as transformers computes them (fp32 exponents, one rounding per op).
    table 0: rope_theta with rope_scaling; table 1: rope_local_theta unscaled (Gemma 3's local
    layers). `long`: longrope's long factors (else its short ones)."""
    dim, f32 = cfg.rope_dim, np.float32
    theta = cfg.rope_theta if table == 0 else cfg.rope_local_theta
    exponent = np.arange(0, dim, 2).astype(f32) / f32(dim)
    base_pow = (float(theta) ** exponent.astype(np.float64)).astype(f32)
    inv = f32(1.0) / base_pow
    rs = cfg.rope_scaling if table == 0 else None
    kind = (rs or {}).get("rope_type", (rs or {}).get("type"))
    if kind == "linear":
        inv = inv / f32(rs["factor"])
    elif kind == "longrope":
        # transformers' _compute_longrope_parameters: 1 / (ext_factors * base ** (2i / dim))
        ext = np.asarray(rs["long_factor" if long else "short_factor"], dtype=f32)
        inv = f32(1.0) / (ext * base_pow)
    elif kind == "llama3":
        # Llama 3.1 frequency-dependent scaling (as in transformers' _compute_llama3_parameters)
        factor = f32(rs["factor"])
        low, high = f32(rs.get("low_freq_factor", 1.0)), f32(rs.get("high_freq_factor", 4.0))
        old_ctx = f32(rs.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = f32(2 * math.pi) / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (f32(1) - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(f32)


def longrope_attention_factor(cfg: ModelConfig) -> float:
    """The factor transformers multiplies longrope's cos and sin by (attention_factor, else
    sqrt(1 + ln(factor) / ln(original_max_position_embeddings)), factor = max / original)."""
    rs = cfg.rope_scaling
    if rs.get("attention_factor") is not None:
        return float(rs["attention_factor"])
    orig = float(rs["original_max_position_embeddings"])
    factor = rs.get("factor") or cfg.max_seq_len / orig
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))


def _cos_sin(positions: np.ndarray, inv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    angles = np.outer(positions.astype(np.float32), inv).astype(np.float64)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def rope_tables(cfg: ModelConfig, n_positions: int, table: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin: [n_positions, rope_dim // 2] fp32 (the two halves of HF's table are equal).

    longrope: positions below original_max_position_embeddings take the short factors, the others
    the long ones, and both tables are scaled by longrope_attention_factor. transformers picks one
    set for a whole forward by its longest position, so a one-token-per-step generate (each step
    computes only its own position) gets exactly these; a single forward over more than
    original_max_position_embeddings positions rotates its early ones with the long factors
    instead. Per position, a row never depends on how many others share its pass (lossless
    speculation needs that)."""
    rs = cfg.rope_scaling if table == 0 else None
    pos = np.arange(n_positions)
    if not rs or rs.get("rope_type", rs.get("type")) != "longrope":
        return _cos_sin(pos, inv_frequencies(cfg, table))
    orig = int(rs["original_max_position_embeddings"])
    cs, sn = _cos_sin(pos[:orig], inv_frequencies(cfg, table, long=False))
    if n_positions > orig:
        cl, sl = _cos_sin(pos[orig:], inv_frequencies(cfg, table, long=True))
        cs, sn = np.concatenate([cs, cl]), np.concatenate([sn, sl])
    att = np.float32(longrope_attention_factor(cfg))
    return (cs * att).astype(np.float32), (sn * att).astype(np.float32)
