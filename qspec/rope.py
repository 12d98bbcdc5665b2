"""Rotary position embedding tables (HF Llama convention: rotate-half, cat(freqs, freqs)), in numpy.

The angles are HF's: fp32 inverse frequencies times fp32 positions, one fp32 product. Their cos and
sin are taken in float64 and rounded once to fp32, so the tables do not depend on a library's
vectorized fp32 cos."""

from __future__ import annotations

import math

import numpy as np

from .config import ModelConfig


def inv_frequencies(cfg: ModelConfig) -> np.ndarray:
    """[head_dim // 2] fp32, as transformers computes them (fp32 exponents, one rounding per op)."""
    dim, f32 = cfg.head_dim, np.float32
    exponent = np.arange(0, dim, 2).astype(f32) / f32(dim)
    inv = f32(1.0) / (float(cfg.rope_theta) ** exponent.astype(np.float64)).astype(f32)
    rs = cfg.rope_scaling
    kind = (rs or {}).get("rope_type", (rs or {}).get("type"))
    if kind == "linear":
        inv = inv / f32(rs["factor"])
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


def rope_tables(cfg: ModelConfig, n_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin: [n_positions, head_dim // 2] fp32 (the two halves of HF's table are equal)."""
    angles = np.outer(np.arange(n_positions).astype(np.float32), inv_frequencies(cfg)).astype(np.float64)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
