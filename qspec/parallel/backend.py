"""Rank 0's backend over the tensor-parallel ranks, and the followers' loop.

Rank 0 runs the whole controller (engine, speculative levels, trees, sampling, the server) on a
TPBackend: every forward is first sent to the followers as a command (token ids, positions, weight
set, tree), then each rank runs its shard of the same forward (qspec/parallel/shard.py), the ranks
add their row-parallel partial sums (Comm.reduce_rows), and rank 0 gathers the logits. The only
other command is move_rows (a draft tree's accepted path). Nothing else is decided on the
followers: their KV caches hold their own heads of exactly the rows rank 0's cache holds.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .. import _C
from ..kv_cache import KVCache
from ..native import NativeBackend, check_tree
from .comm import FORWARD, MOVE_ROWS, STOP, Comm
from .shard import Shard


class MirroredKVCache(KVCache):
    """Rank 0's KV cache: move_rows (the one write outside a forward) is repeated on every rank."""

    comm: Comm

    def move_rows(self, src_slots, dst_start: int, tokens=None, kernel_path: str | None = None) -> None:
        super().move_rows(src_slots, dst_start, tokens, kernel_path)  # checks its arguments first
        src = np.asarray(src_slots, dtype=np.int64)
        self.comm.send(MOVE_ROWS, (int(dst_start),), src)


class TPBackend:
    """The engine's backend on rank 0: the same interface as NativeBackend, over all ranks."""

    def __init__(self, local: NativeBackend, comm: Comm):
        self.local, self.comm = local, comm
        self.cfg = local.cfg
        kv = MirroredKVCache(local.kv.cfg, 0, draft_copy=local.kv.q8 is not None)
        kv.comm = comm
        local.kv = self.kv = kv
        self.columns = [Shard.plan(self.cfg, r, comm.world).vocab for r in range(comm.world)]
        self._logits = np.empty((0, self.cfg.vocab_size), dtype=np.float32)
        local.model.set_reducer(comm.reducer)

    def __getattr__(self, name):  # draft, set_bytes, kernel_path, model, load_info, ...: rank 0's
        return getattr(self.local, name)

    def forward(self, tokens: Sequence[int], start_pos: int, *, all_logits: bool = False,
                draft: bool | int = False, tree: tuple[int, Sequence[int]] | None = None) -> np.ndarray:
        """As NativeBackend.forward, on every rank; the logits of the whole vocabulary."""
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        m = ids.size
        # everything a follower's forward could refuse is checked here, before it is sent
        if m < 1 or ids.min() < 0 or ids.max() >= self.cfg.vocab_size:
            raise ValueError("forward needs token ids in the vocabulary")
        if not 0 <= start_pos <= self.kv.capacity - m:
            raise ValueError("positions exceed the KV cache capacity")
        prefix, parents = (-1, np.zeros(0, dtype=np.int64)) if tree is None else \
            (int(tree[0]), check_tree(tree, start_pos, m))
        if not self.local.model.has_set(int(draft)):
            raise ValueError(f"weight set {int(draft)} is not loaded")
        self.comm.send(FORWARD, (m, int(start_pos), int(draft), int(all_logits), prefix, self.kv.capacity),
                       np.concatenate([ids, parents]))
        try:
            local = self.local.forward(ids, start_pos, all_logits=all_logits, draft=draft,
                                       tree=None if tree is None else (prefix, parents))
        except _C.PeerLost as e:
            raise self.comm.broke("a forward", e) from None
        rows = local.shape[0]
        if self._logits.shape[0] < rows:
            self._logits = np.empty((rows, self.cfg.vocab_size), dtype=np.float32)
        self.comm.gather_logits(local, self._logits, self.columns)
        return self._logits[:rows].copy()


def follow(local: NativeBackend, comm: Comm) -> int:
    """A follower rank: run rank 0's commands on this rank's shard until STOP; its exit code."""
    local.model.set_reducer(comm.reducer)
    kv = local.kv
    columns = [Shard.plan(local.cfg, r, comm.world).vocab for r in range(comm.world)]
    while True:
        op, args, payload = comm.receive()
        if op == STOP:
            return args[0]
        if op == FORWARD:
            m, start_pos, weight_set, all_logits, prefix, capacity = args
            # grow when rank 0's cache grew (not row by row: each growth copies the cache), keeping
            # every row: rank 0's cache holds them too
            kv.ensure_capacity(capacity, keep=kv.capacity)
            tree = None if prefix < 0 else (prefix, payload[m:])
            try:
                logits = local.forward(payload[:m], start_pos, all_logits=bool(all_logits), draft=weight_set,
                                       tree=tree)
            except _C.PeerLost as e:
                raise comm.broke("a forward", e) from None
            comm.gather_logits(logits, None, columns)
        elif op == MOVE_ROWS:
            kv.move_rows(payload, args[0])
        else:
            raise RuntimeError(f"unknown tensor-parallel command {op}")
