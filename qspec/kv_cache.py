"""The one KV cache of a model: [layers][2][max_seq][kv_heads][head_dim], position-indexed.

Target and draft share it (docs/architecture.md): the committed prefix is always target-written, draft
steps write provisional rows after it, verify overwrites them; rejection = moving `length` back.
The cache also records which token ids its leading rows hold as target rows, so that a prompt
starting with them is not prefilled again (Engine._prefill).
Draft trees (docs/architecture.md, "Tree attention"): a tree pass writes its nodes to slots after
the committed prefix (recorded as tokens=None: a slot is not the node's position); after
verification move_rows copies the accepted path's rows to their linear positions.
A numpy array: BF16 bits as uint16 for the native kernels, float32 for the torch reference.
With `draft_copy`, an INT8 copy of every row sits beside it (csrc/kv_q8.h: int8 values and one E8M0
scale byte per 32): every native pass writes it with the BF16 row, the MX draft passes may read it
instead (draft_kv="int8"), and ensure_capacity / move_rows treat it like the BF16 rows.
"""

from __future__ import annotations

import numpy as np

from .config import ModelConfig
from .memory import Q8_BLOCK, check_fits


class KVCache:
    def __init__(self, cfg: ModelConfig, capacity: int, dtype: np.dtype = np.uint16, draft_copy: bool = False):
        self.cfg = cfg
        self.dtype = np.dtype(dtype)  # uint16 = BF16 bits
        # np.empty: pages are touched (and count in RSS) only as positions are written
        self.data = np.empty((cfg.n_layers, 2, capacity, cfg.n_kv_heads, cfg.head_dim), dtype=self.dtype)
        if draft_copy and (self.dtype != np.uint16 or cfg.head_dim % Q8_BLOCK):
            raise ValueError(f"the INT8 draft copy needs BF16 rows and head_dim a multiple of {Q8_BLOCK}")
        # the INT8 draft copy: (values, scales) or None
        self.q8 = (np.empty(self.data.shape, dtype=np.int8),
                   np.empty((*self.data.shape[:4], cfg.head_dim // Q8_BLOCK), dtype=np.uint8)) if draft_copy else None
        self.length = 0  # committed positions
        # rows [0, len(tokens)) hold the target's K/V of these token ids, computed at kernel path
        # `tokens_path`. A verify pass's rows for drafts that were then rejected stay valid target
        # rows of those ids (each row depends only on the ids up to it), so the record does not
        # follow `length`: it holds whatever the last target passes wrote.
        self.tokens: list[int] = []
        self.tokens_path: str | None = None

    @property
    def capacity(self) -> int:
        return self.data.shape[2]

    @property
    def bytes_per_position(self) -> int:
        """Bytes of one position (every layer, K and V)."""
        shape = self.data.shape
        n = int(np.prod(shape[:2]) * np.prod(shape[3:]))
        return n * self.dtype.itemsize + (n + n // Q8_BLOCK if self.q8 is not None else 0)

    def ensure_capacity(self, needed: int, keep: int | None = None) -> None:
        """Grow so that `needed` positions fit, keeping rows [0, keep) (default: the committed rows
        and the recorded target rows). ContextMemoryError, before anything is allocated, when the
        grown cache does not fit in the available memory."""
        if needed <= self.capacity:
            return
        check_fits(needed * self.bytes_per_position, f"a KV cache of {needed} tokens")
        new = np.empty((*self.data.shape[:2], needed, *self.data.shape[3:]), dtype=self.dtype)
        keep = max(self.length, len(self.tokens)) if keep is None else min(keep, self.capacity)
        new[:, :, :keep] = self.data[:, :, :keep]
        self.data = new
        if self.q8 is not None:
            grown = []
            for a in self.q8:
                g = np.empty((*a.shape[:2], needed, *a.shape[3:]), dtype=a.dtype)
                g[:, :, :keep] = a[:, :, :keep]
                grown.append(g)
            self.q8 = tuple(grown)

    def reset(self) -> None:
        self.length = 0

    def forget(self) -> None:
        """Drop the record of the rows' tokens: the next prompt is prefilled in full."""
        self.tokens = []

    def reusable(self, ids: list[int], kernel_path: str | None) -> int:
        """How many leading rows of `ids` the cache already holds as target rows, computed by the
        kernels `kernel_path` selects now (rows of another ISA level differ in their bits)."""
        if kernel_path != self.tokens_path:
            return 0
        n = 0
        for a, b in zip(self.tokens, ids):
            if a != b:
                break
            n += 1
        return n

    def writing(self, start_pos: int, tokens=None, kernel_path: str | None = None) -> None:
        """A forward pass is about to write rows from start_pos on (every backend calls this).

        `tokens`: the ids of the target rows it writes, recorded for reuse; None for rows that
        must not be reused (a draft pass's provisional MX rows, or a backend whose rows depend on
        the batch they were computed in)."""
        del self.tokens[start_pos:]
        if tokens is None or start_pos != len(self.tokens):
            return
        if kernel_path != self.tokens_path:
            self.tokens = []
            self.tokens_path = kernel_path
            if start_pos:
                return
        self.tokens.extend(int(t) for t in tokens)

    def move_rows(self, src_slots, dst_start: int, tokens=None, kernel_path: str | None = None) -> None:
        """Copies the K/V of every layer at `src_slots` (ascending, src_slots[j] >= dst_start + j)
        to rows dst_start, dst_start + 1, .. and sets `length` = dst_start + len(src_slots): the
        accepted path of a draft tree becomes linear, the rest of the tree is dropped.

        `tokens`: the ids of the moved rows when they are target rows (a tree verify pass; their
        bits equal a linear target pass's), recorded for prefix reuse like `writing` does, at
        `kernel_path`; None (draft rows): the record is cut at dst_start."""
        src = np.asarray(src_slots)
        if src.ndim != 1 or (src.size and src.dtype.kind not in "iu"):
            raise ValueError("move_rows: src_slots must be a 1-D sequence of ints")
        src = src.astype(np.int64)
        n = src.size
        if isinstance(dst_start, bool) or not isinstance(dst_start, (int, np.integer)) or dst_start < 0:
            raise ValueError(f"move_rows: dst_start must be an int >= 0, got {dst_start!r}")
        dst_start = int(dst_start)
        if dst_start + n > self.capacity or (n and src[-1] >= self.capacity):
            raise ValueError(f"move_rows: rows beyond the cache capacity {self.capacity}")
        if n and (np.any(np.diff(src) <= 0) or np.any(src < dst_start + np.arange(n))):
            raise ValueError("move_rows: src_slots must be ascending with src_slots[j] >= dst_start + j")
        if tokens is not None and len(tokens) != n:
            raise ValueError(f"move_rows: {len(tokens)} tokens for {n} rows")
        self.writing(dst_start, tokens, kernel_path)
        if n and not np.array_equal(src, dst_start + np.arange(n)):
            for a in (self.data,) + (self.q8 or ()):
                a[:, :, dst_start:dst_start + n] = a[:, :, src]
        self.length = dst_start + n
