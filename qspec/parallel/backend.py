"""Rank 0's backend over the tensor-parallel ranks, and the followers' loop.

Rank 0 runs the whole controller (engine, speculative levels, trees, sampling, the server) on a
TPBackend: every forward is first sent to the followers as a command (token ids, positions, weight
set, tree), then each rank runs its shard of the same forward (qspec/parallel/shard.py), the ranks
add their row-parallel partial sums (Comm.reduce_rows), and rank 0 gathers the logits. The only
other command copies rows between pages (qspec/kv_cache.py: a shared page copied before a write,
a draft tree's accepted path). Each forward carries rank 0's page table, and the followers' pools
grow with rank 0's: their pools hold their own heads of exactly the rows rank 0's pool holds.
Nothing else is decided on the followers.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .. import _C
from ..batch import Pass
from ..kv_cache import KVCache, KVPool
from ..native import NativeBackend
from .comm import COPY_ROWS, FORWARD, STOP, Comm
from .shard import Shard


class MirroredKVPool(KVPool):
    """Rank 0's pool: a copy of rows between pages (a shared page copied before a write, a
    partial prefix page adopted, a draft tree's accepted path) is repeated on every rank."""

    comm: Comm

    def copy_rows(self, src_rows, dst_rows) -> None:
        super().copy_rows(src_rows, dst_rows)
        self.comm.send(COPY_ROWS, (), np.stack([np.asarray(src_rows, dtype=np.int64),
                                                np.asarray(dst_rows, dtype=np.int64)]).reshape(-1))


class TPBackend:
    """The engine's backend on rank 0: the same interface as NativeBackend, over all ranks."""

    def __init__(self, local: NativeBackend, comm: Comm):
        self.local, self.comm = local, comm
        self.cfg = local.cfg
        pool = MirroredKVPool(local.pool.cfg, draft_copy=local.pool.draft_copy)
        pool.comm = comm
        local.pool = self.pool = pool
        local.kv = self.kv = KVCache(pool)
        self.columns = [Shard.plan(self.cfg, r, comm.world).vocab for r in range(comm.world)]
        self._logits = np.empty((0, self.cfg.vocab_size), dtype=np.float32)
        local.model.set_reducer(comm.reducer)

    def __getattr__(self, name):  # draft, set_bytes, kernel_path, model, load_info, ...: rank 0's
        return getattr(self.local, name)

    def forward(self, tokens: Sequence[int], start_pos: int, *, all_logits: bool = False,
                draft: bool | int = False, tree: tuple[int, Sequence[int]] | None = None) -> np.ndarray:
        """As NativeBackend.forward, on every rank; the logits of the whole vocabulary."""
        p = self.prepare(self.kv, tokens, start_pos, all_logits=all_logits, draft=draft, tree=tree)
        with self.pool.lock:
            return self.run([p], int(draft))[0]

    def prepare(self, kv: KVCache, tokens, start_pos: int, *, all_logits: bool = False, draft: bool | int = False,
                tree=None) -> Pass:
        # everything a follower's forward could refuse is checked here, before anything is sent
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if ids.size < 1 or ids.min() < 0 or ids.max() >= self.cfg.vocab_size:
            raise ValueError("forward needs token ids in the vocabulary")
        if not self.local.model.has_set(int(draft)):
            raise ValueError(f"weight set {int(draft)} is not loaded")
        return self.local.prepare(kv, ids, start_pos, all_logits=all_logits, draft=draft, tree=tree)

    def run(self, passes: Sequence[Pass], weight_set: int) -> list[np.ndarray]:
        """One pass at a time on every rank (Engine runs one sequence under tensor parallelism)."""
        out = []
        for p in passes:
            m = len(p.tokens)
            prefix, parents = (-1, np.zeros(0, dtype=np.int64)) if p.tree is None else p.tree
            self.comm.send(FORWARD, (m, p.start_pos, int(weight_set), int(p.all_logits), prefix, self.pool.pages),
                           np.concatenate([p.tokens.astype(np.int64), np.asarray(parents, dtype=np.int64),
                                           p.kv.page_table.astype(np.int64)]))
            try:
                local = self.local.run([p], weight_set)[0]
            except _C.PeerLost as e:
                raise self.comm.broke("a forward", e) from None
            rows = local.shape[0]
            if self._logits.shape[0] < rows:
                self._logits = np.empty((rows, self.cfg.vocab_size), dtype=np.float32)
            self.comm.gather_logits(local, self._logits, self.columns)
            out.append(self._logits[:rows].copy())
        return out


class _Pages:
    """A follower's view of rank 0's page table for one forward."""

    def __init__(self, table: np.ndarray):
        self.page_table = table.astype(np.int32)


def follow(local: NativeBackend, comm: Comm) -> int:
    """A follower rank: run rank 0's commands on this rank's shard until STOP; its exit code."""
    local.model.set_reducer(comm.reducer)
    pool = local.pool
    columns = [Shard.plan(local.cfg, r, comm.world).vocab for r in range(comm.world)]
    while True:
        op, args, payload = comm.receive()
        if op == STOP:
            return args[0]
        if op == FORWARD:
            m, start_pos, weight_set, all_logits, prefix, pages = args
            with pool.lock:
                pool.grow_to(pages)  # rank 0's pool grew: the same pages, every row kept
            n_par = 0 if prefix < 0 else start_pos + m - prefix  # check_tree's parents on rank 0
            tree = None if prefix < 0 else (prefix, payload[m:m + n_par])
            p = Pass(_Pages(payload[m + n_par:]), payload[:m].astype(np.int32), start_pos, bool(all_logits), tree,
                     local.reads_draft_copy(weight_set, start_pos))
            try:
                logits = local.run([p], weight_set)[0]
            except _C.PeerLost as e:
                raise comm.broke("a forward", e) from None
            comm.gather_logits(logits, None, columns)
        elif op == COPY_ROWS:
            rows = payload.reshape(2, -1)
            pool.copy_rows(rows[0], rows[1])
        else:
            raise RuntimeError(f"unknown tensor-parallel command {op}")
