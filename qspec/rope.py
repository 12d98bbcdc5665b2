"""Rotary position embedding tables (HF Llama convention: rotate-half, cat(freqs, freqs))."""

from __future__ import annotations

import math

import torch

from .config import ModelConfig


def inv_frequencies(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = cfg.rope_scaling
    kind = (rs or {}).get("rope_type", (rs or {}).get("type"))
    if kind == "linear":
        inv = inv / float(rs["factor"])
    elif kind == "llama3":
        # Llama 3.1 frequency-dependent scaling (as in transformers' _compute_llama3_parameters)
        factor = float(rs["factor"])
        low, high = float(rs.get("low_freq_factor", 1.0)), float(rs.get("high_freq_factor", 4.0))
        old_ctx = float(rs.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    return inv


def rope_tables(cfg: ModelConfig, n_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [n_positions, head_dim // 2] fp32 (the two halves of HF's table are equal)."""
    pos = torch.arange(n_positions, dtype=torch.int64).float()
    freqs = torch.outer(pos, inv_frequencies(cfg))
    return freqs.cos().contiguous(), freqs.sin().contiguous()
