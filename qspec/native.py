"""Engine backend on the native kernels: weights packed once, one C++ call per forward."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from . import _C
from .config import ModelConfig
from .draft import DraftSpec, pack_mx_matrix
from .errors import DraftFileError
from .kv_cache import KVCache
from .loader import ModelWeights
from .rope import rope_tables

TARGET, DRAFT = 0, 1


def bf16_numpy(t: torch.Tensor) -> np.ndarray:
    """Zero-copy uint16 view of a contiguous BF16 tensor (the one place bf16 crosses to _C)."""
    if t.dtype != torch.bfloat16:
        raise TypeError(f"expected a bfloat16 tensor, got {t.dtype}")
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


MATRICES = ("wqkv", "wo", "w_gate_up", "w_down")


def fused_layer_matrices(lw) -> dict[str, torch.Tensor]:
    """The four GEMM operands of a layer: [q;k;v], o, [gate;up], down (BF16)."""
    return {
        "wqkv": torch.cat([lw.wq, lw.wk, lw.wv]),
        "wo": lw.wo,
        "w_gate_up": torch.cat([lw.w_gate, lw.w_up]),
        "w_down": lw.w_down,
    }


def cast_draft(weights: ModelWeights, spec: DraftSpec) -> dict:
    """The draft's packed MX matrices, by direct cast of the target's own BF16 weights."""
    packed = {}
    for i, lw in enumerate(weights.layers):
        for k, w in fused_layer_matrices(lw).items():
            packed[f"layers.{i}.{k}"] = pack_mx_matrix(w, spec.fmt)
    if spec.lm_head != "bf16":
        packed["lm_head"] = pack_mx_matrix(weights.lm_head, spec.lm_head)
    return packed


class NativeBackend:
    """Target (BF16) and optional draft (MX) weight sets over one KV cache."""

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, draft: DraftSpec | None = None,
                 draft_packed: dict | None = None):
        """`draft_packed` (from a draft file) is used as it is; otherwise `draft` is cast here."""
        self.cfg = cfg
        self.kv = KVCache(cfg, 0)
        # the model borrows it; a private copy, so the checkpoint mapping can close after load
        self._embed = weights.embed.clone()
        self.model = _C.Model(
            {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
             "n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads,
             "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.rms_norm_eps},
            bf16_numpy(self._embed), weights.norm.float().numpy())
        self.draft = draft
        self.target_bytes = self.draft_bytes = 0
        for i, lw in enumerate(weights.layers):
            tgt = {k: _C.pack_bf16(bf16_numpy(v)) for k, v in fused_layer_matrices(lw).items()}
            self.model.set_layer(TARGET, i, *(tgt[k] for k in MATRICES))
            self.target_bytes += sum(p.nbytes for p in tgt.values())
            bqkv = None if lw.bq is None else torch.cat([lw.bq, lw.bk, lw.bv]).float().numpy()
            self.model.set_layer_norms(i, lw.attn_norm.float().numpy(), lw.mlp_norm.float().numpy(), bqkv)
        self.lm_head = _C.pack_bf16(bf16_numpy(weights.lm_head))
        self.target_bytes += self.lm_head.nbytes
        self.model.set_lm_head(TARGET, self.lm_head)
        packed_draft = {}
        if draft is not None:
            packed_draft = draft_packed if draft_packed is not None else cast_draft(weights, draft)
            try:
                for i in range(cfg.n_layers):
                    self.model.set_layer(DRAFT, i, *(packed_draft[f"layers.{i}.{k}"] for k in MATRICES))
            except (KeyError, ValueError) as e:
                raise DraftFileError(f"draft file does not match this model ({e})") from None
            head = packed_draft.get("lm_head", self.lm_head)
            self.model.set_lm_head(DRAFT, head)
            self.draft_bytes = sum(p.nbytes for p in packed_draft.values()) + \
                (self.lm_head.nbytes if "lm_head" not in packed_draft else 0)
        self.draft_packed = packed_draft  # the draft matrices, as a draft file holds them
        self._rope_positions = 0
        self._logits = np.empty((0, cfg.vocab_size), dtype=np.float32)

    def _ensure_rope(self, n: int) -> None:
        if n > self._rope_positions:
            n = min(max(n, 2 * self._rope_positions, 256), max(n, self.cfg.max_seq_len))
            cos, sin = rope_tables(self.cfg, n)
            self.model.set_rope(cos.numpy(), sin.numpy())
            self._rope_positions = n

    def forward(self, tokens: Sequence[int], start_pos: int, *, all_logits: bool = False,
                draft: bool = False) -> torch.Tensor:
        m = len(tokens)
        rows = m if all_logits else 1
        if self._logits.shape[0] < rows:
            self._logits = np.empty((rows, self.cfg.vocab_size), dtype=np.float32)
        self._ensure_rope(start_pos + m)
        out = self._logits[:rows]
        kv = self.kv.data.view(torch.int16).numpy().view(np.uint16)
        self.model.forward(np.asarray(tokens, dtype=np.int32), start_pos, kv, DRAFT if draft else TARGET,
                           all_logits, out)
        return torch.from_numpy(out.copy())  # the buffer is reused by the next call
