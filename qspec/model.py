"""Reference Llama-family forward pass in torch (FP32 math on the BF16 weights).

This is the readable oracle the native forward (csrc/model.cpp) is tested against, and the
`backend="torch"` engine path. It reads and writes the same KVCache class as the native path
(float32 here) and, as every backend, returns numpy logits, so the same decoding loops drive it.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .config import ModelConfig
from .kv_cache import KVCache
from .loader import LayerWeights, ModelWeights
from .rope import rope_tables


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [M, H, hd]; cos/sin: [M, hd/2] -> rotate-half convention of HF Llama
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


class TorchModel:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights):
        self.cfg = cfg
        # FP32 copies made once: this path is the oracle, so clarity beats memory here
        f32 = torch.float32
        up = lambda t: None if t is None else t.to(f32)
        self.w = ModelWeights(
            embed=weights.embed, norm=weights.norm, lm_head=weights.lm_head.to(f32),
            layers=[LayerWeights(**{k: up(v) for k, v in vars(lw).items()}) for lw in weights.layers])
        self._cos = self._sin = torch.empty(0, cfg.head_dim // 2)

    def _rope(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos.shape[0] < n:
            cos, sin = rope_tables(self.cfg, max(n, 2 * self._cos.shape[0]))
            self._cos, self._sin = torch.from_numpy(cos), torch.from_numpy(sin)
        return self._cos, self._sin

    @staticmethod
    def tree_mask(start_pos: int, end: int, prefix: int, parents) -> tuple[torch.Tensor, torch.Tensor]:
        """Tree attention (docs: tree-contract): the mask [M, end] of query slots start_pos..end-1
        and their RoPE positions. Slot s >= prefix has parent slot parents[s - prefix] (-1: a root)
        and sees the rows 0..prefix-1, its ancestors and itself, at position prefix + depth(s)."""
        n = end - prefix
        if len(parents) != n:
            raise ValueError(f"tree parents: {len(parents)} entries for {n} slots")
        anc = torch.zeros(n, end, dtype=torch.bool)
        anc[:, :prefix] = True
        depth = [0] * n
        for j, par in enumerate(parents):
            par = int(par)
            if not (par == -1 or prefix <= par < prefix + j):
                raise ValueError(f"tree parents: slot {prefix + j} has parent {par}")
            if par >= 0:
                anc[j] = anc[par - prefix]
                depth[j] = depth[par - prefix] + 1
            anc[j, prefix + j] = True
        rows = slice(start_pos - prefix, n)
        return anc[rows], torch.tensor(depth[rows], dtype=torch.long) + prefix

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start_pos: int, kv: KVCache, tree=None) -> torch.Tensor:
        """tokens [M] at positions start_pos.. -> logits [M, V] fp32; writes K/V rows (float32 cache).
        `tree` = (prefix, parents): the rows are tree slots (tree_mask), not consecutive positions."""
        cfg, f32 = self.cfg, torch.float32
        cache = torch.from_numpy(kv.data)  # shares the array: writes land in the cache
        M, H, KVH, hd = tokens.shape[0], cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        end = start_pos + M
        if tree is None:
            # causal mask over the cache rows 0..end-1 for query rows at start_pos..end-1
            mask = torch.arange(end)[None, :] <= torch.arange(start_pos, end)[:, None]  # [M, end]
            pos = torch.arange(start_pos, end)
        else:
            mask, pos = self.tree_mask(start_pos, end, tree[0], tree[1])
        cos_t, sin_t = self._rope(int(pos.max()) + 1)
        cos, sin = cos_t[pos], sin_t[pos]
        h = self.w.embed[tokens].to(f32)  # [M, D]
        for i, lw in enumerate(self.w.layers):
            x = rms_norm(h, lw.attn_norm, cfg.rms_norm_eps)
            q = F.linear(x, lw.wq, lw.bq).view(M, H, hd)
            k = F.linear(x, lw.wk, lw.bk).view(M, KVH, hd)
            v = F.linear(x, lw.wv, lw.bv).view(M, KVH, hd)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            cache[i, 0, start_pos:end] = k
            cache[i, 1, start_pos:end] = v
            keys = cache[i, 0, :end].repeat_interleave(H // KVH, dim=1).transpose(0, 1)  # [H, end, hd]
            vals = cache[i, 1, :end].repeat_interleave(H // KVH, dim=1).transpose(0, 1)
            att = (q.transpose(0, 1) @ keys.transpose(1, 2)) / hd ** 0.5  # [H, M, end]
            att = att.masked_fill(~mask[None], float("-inf")).softmax(-1)
            o = (att @ vals).transpose(0, 1).reshape(M, H * hd)
            h = h + F.linear(o, lw.wo)
            x = rms_norm(h, lw.mlp_norm, cfg.rms_norm_eps)
            h = h + F.linear(F.silu(F.linear(x, lw.w_gate)) * F.linear(x, lw.w_up),
                             lw.w_down)
        h = rms_norm(h, self.w.norm, cfg.rms_norm_eps)
        return F.linear(h, self.w.lm_head)


class TorchBackend:
    """Engine backend on the torch reference model (FP32 KV cache: an oracle, not a fast path)."""

    def __init__(self, cfg: ModelConfig, weights: ModelWeights):
        self.cfg = cfg
        self.model = TorchModel(cfg, weights)
        self.kv = KVCache(cfg, 0, dtype=np.float32)

    def forward(self, tokens, start_pos: int, *, all_logits: bool = False, tree=None) -> np.ndarray:
        """`tree` = (prefix, parents): a tree pass (TorchModel.tree_mask, docs: tree-contract)."""
        # nothing recorded for reuse: torch's GEMMs are not batch-invariant (a row computed in a
        # prefill of M rows need not match the same row computed alone), so every prompt is prefilled
        self.kv.writing(start_pos)
        logits = self.model.forward(torch.as_tensor(list(tokens), dtype=torch.long), start_pos, self.kv,
                                    tree)
        return (logits if all_logits else logits[-1:]).numpy()
