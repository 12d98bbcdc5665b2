"""The one KV cache of a model: [layers][2][max_seq][kv_heads][head_dim], position-indexed.

Target and draft share it (docs/architecture.md): the committed prefix is always target-written, draft
steps write provisional rows after it, verify overwrites them; rejection = moving `length` back.
A numpy array: BF16 bits as uint16 for the native kernels, float32 for the torch reference.
"""

from __future__ import annotations

import numpy as np

from .config import ModelConfig


class KVCache:
    def __init__(self, cfg: ModelConfig, capacity: int, dtype: np.dtype = np.uint16):
        self.cfg = cfg
        self.dtype = np.dtype(dtype)  # uint16 = BF16 bits
        # np.empty: pages are touched (and count in RSS) only as positions are written
        self.data = np.empty((cfg.n_layers, 2, capacity, cfg.n_kv_heads, cfg.head_dim), dtype=self.dtype)
        self.length = 0  # committed positions
        # ((prompt ids, kernel path), fp32 logits of its last row) while rows [0, len(ids)) hold
        # exactly that prompt's prefill: the same prompt again needs no prefill (Engine._prefill)
        self.prompt_memo: tuple[tuple, np.ndarray] | None = None

    @property
    def capacity(self) -> int:
        return self.data.shape[2]

    def ensure_capacity(self, needed: int) -> None:
        """Grow (keeping the committed rows) so that `needed` positions fit."""
        if needed <= self.capacity:
            return
        new = np.empty((*self.data.shape[:2], needed, *self.data.shape[3:]), dtype=self.dtype)
        new[:, :, : self.length] = self.data[:, :, : self.length]
        self.data = new

    def reset(self) -> None:
        self.length = 0

    def writing(self, start_pos: int) -> None:
        """A forward pass is about to write rows from start_pos on (every backend calls this)."""
        if self.prompt_memo is not None and start_pos < len(self.prompt_memo[0][0]):
            self.prompt_memo = None
