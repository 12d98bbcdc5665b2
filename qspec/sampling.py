"""Sampling parameters and the warped distribution shared by plain and speculative sampling (numpy)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0            # 0 = off
    top_p: float = 1.0        # 1 = off
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0) or self.temperature == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self) -> np.random.Generator:
        """numpy's default generator (PCG64), seeded with `seed` (None: fresh OS entropy)."""
        return np.random.default_rng(self.seed)


def warp(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """logits [..., V] -> probabilities after temperature, top-k and top-p (fp32)."""
    x = np.asarray(logits, dtype=np.float32) / np.float32(p.temperature)
    if p.top_k and p.top_k < x.shape[-1]:
        kth = np.partition(x, -p.top_k, axis=-1)[..., -p.top_k:-p.top_k + 1]  # the k-th largest
        x = np.where(x < kth, np.float32(-np.inf), x)
    e = np.exp(x - x.max(-1, keepdims=True))
    probs = e / e.sum(-1, keepdims=True)
    if p.top_p < 1.0:
        idx = np.argsort(-probs, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(probs, idx, -1)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        sorted_p[(np.cumsum(sorted_p, -1) - sorted_p) >= p.top_p] = 0.0
        probs = np.zeros_like(probs)
        np.put_along_axis(probs, idx, sorted_p, -1)
        probs /= probs.sum(-1, keepdims=True)
    return probs


def argmax(logits: np.ndarray) -> int | list[int]:
    """Greedy token(s): index of the first maximum of the last dim (NaN counts as the maximum)."""
    a = np.asarray(logits).argmax(-1)
    return int(a) if a.ndim == 0 else a.tolist()


def top1_prob(logits: np.ndarray, top: int) -> float:
    """softmax(logits)[top] for the argmax index `top`."""
    return float(1.0 / np.exp(logits - logits[top]).sum())


def sample(probs: np.ndarray, gen: np.random.Generator) -> int:
    """One index drawn with probability proportional to `probs` (1-D, >= 0, not necessarily
    normalized); an index of zero weight is never drawn."""
    cdf = np.cumsum(probs, dtype=np.float64)
    i = int(np.searchsorted(cdf, gen.random() * cdf[-1], side="right"))
    return i if i < len(cdf) else int(np.flatnonzero(probs)[-1])  # u * total rounded up to total
