"""Which part of the model a tensor-parallel rank holds (Megatron-style sharding).

Column-parallel: the fused [q;k;v] rows of whole attention heads (each rank its own query heads
and the KV heads they read, so its KV cache holds only those) and the [gate;up] rows of an FFN
slice. Row-parallel: the O columns of its query heads and the down columns of its FFN slice, whose
[m, hidden] partial sums the ranks add (qspec/parallel/comm.py). The LM head is split by vocab rows;
rank 0 gathers the logits. Embedding, norms (per-head q/k norms and Gemma's output norms too),
RoPE tables and sliding windows are replicated.

One process is the world of one: rank 0 of 1 holds everything, and the slices are the whole
tensors, so single-process packing runs the same code.
Slices of a row-parallel matrix start at multiples of the MX block (32 along K), so each rank's MX
cast of its slice is exactly that slice of the whole matrix's cast; vocab slices start at
multiples of the 16-row packing block.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import ModelConfig
from ..errors import TensorParallelError

MX_BLOCK = 32     # MX scale block along K (docs/mx.md)
ROW_BLOCK = 16    # packed BF16 weights come in blocks of 16 rows (csrc/gemm.h)


def _split(n: int, parts: int, align: int, i: int) -> tuple[int, int]:
    """Part i of [0, n) cut into `parts` contiguous pieces starting at multiples of `align` (of 1
    when n is too small for that), as even as that allows (the last one may be shorter)."""
    if n < parts * align:
        align = 1
    step = -(-n // (parts * align)) * align
    return min(i * step, n), min((i + 1) * step, n)


@dataclass(frozen=True)
class Shard:
    rank: int
    world: int
    heads: tuple[int, int]      # query heads [lo, hi)
    kv_heads: tuple[int, int]   # KV heads [lo, hi)
    ffn: tuple[int, int]        # intermediate columns [lo, hi)
    vocab: tuple[int, int]      # LM-head rows [lo, hi)
    head_dim: int

    @classmethod
    def plan(cls, cfg: ModelConfig, rank: int = 0, world: int = 1) -> "Shard":
        """Rank `rank`'s part of `cfg`'s model over `world` ranks; TensorParallelError when the
        model cannot be split that way."""
        if world < 1 or not 0 <= rank < world:
            raise TensorParallelError(f"rank {rank} is not in a world of {world}")
        if cfg.n_kv_heads % world:
            ok = [w for w in range(1, cfg.n_kv_heads + 1) if cfg.n_kv_heads % w == 0]
            raise TensorParallelError(
                f"tensor parallelism over {world} ranks needs the KV-head count to be divisible by {world}; "
                f"this model has {cfg.n_kv_heads} KV heads (world sizes that work: {', '.join(map(str, ok))})")
        kv = cfg.n_kv_heads // world
        q = cfg.n_heads // world
        ffn = _split(cfg.intermediate_size, world, MX_BLOCK, rank)
        vocab = _split(cfg.vocab_size, world, ROW_BLOCK, rank)
        if ffn[0] == ffn[1] or vocab[0] == vocab[1]:
            raise TensorParallelError(f"this model is too small for {world} ranks (rank {rank} would hold no "
                                      f"{'FFN columns' if ffn[0] == ffn[1] else 'LM-head rows'})")
        return cls(rank, world, (rank * q, (rank + 1) * q), (rank * kv, (rank + 1) * kv), ffn, vocab, cfg.head_dim)

    @property
    def whole(self) -> bool:
        return self.world == 1

    @property
    def tag(self) -> str:
        """Names this shard in weight-cache file kinds ("" for the whole model)."""
        return "" if self.whole else f".tp{self.rank}of{self.world}"

    @property
    def vocab_rows(self) -> int:
        return self.vocab[1] - self.vocab[0]

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The shapes this rank's forward runs: its heads, KV heads and FFN slice (the vocabulary
        stays whole: the embedding is replicated; the LM head has vocab_rows rows)."""
        if self.whole:
            return cfg
        return replace(cfg, n_heads=self.heads[1] - self.heads[0], n_kv_heads=self.kv_heads[1] - self.kv_heads[0],
                       intermediate_size=self.ffn[1] - self.ffn[0])

    def layer_matrices(self, lw) -> dict:
        """This rank's four GEMM operands of a layer (BF16 torch tensors): [q;k;v] rows of its heads,
        O columns of its query heads, [gate;up] rows and down columns of its FFN slice."""
        import torch

        q, kv, f = self._rows(self.heads), self._rows(self.kv_heads), slice(*self.ffn)
        return {
            "wqkv": torch.cat([lw.wq[q], lw.wk[kv], lw.wv[kv]]),
            "wo": lw.wo[:, q].contiguous(),
            "w_gate_up": torch.cat([lw.w_gate[f], lw.w_up[f]]),
            "w_down": lw.w_down[:, f].contiguous(),
        }

    def layer_bias(self, lw):
        """This rank's q/k/v bias (float32 torch tensor), or None for a model without one."""
        import torch

        if lw.bq is None:
            return None
        q, kv = self._rows(self.heads), self._rows(self.kv_heads)
        return torch.cat([lw.bq[q], lw.bk[kv], lw.bv[kv]]).float()

    def lm_head(self, w):
        """This rank's LM-head rows."""
        return w if self.whole else w[slice(*self.vocab)]

    def _rows(self, heads: tuple[int, int]) -> slice:
        return slice(heads[0] * self.head_dim, heads[1] * self.head_dim)
