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
from .batch import Pass
from .kv_cache import KVCache, KVPool
from .loader import LayerWeights, ModelWeights
from .rope import rope_tables


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [M, H, hd]; cos/sin: [M, rd/2] -> rotate-half convention of HF Llama on the first rd
    # columns of each head (partial rotary), the rest passed through
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, rest), dim=-1)


class TorchModel:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights):
        self.cfg = cfg
        # FP32 copies made once: this path is the oracle, so clarity beats memory here
        f32 = torch.float32
        up = lambda t: None if t is None else t.to(f32)
        self.w = ModelWeights(
            embed=weights.embed, norm=weights.norm, lm_head=weights.lm_head.to(f32),
            layers=[LayerWeights(**{k: up(v) for k, v in vars(lw).items()}) for lw in weights.layers])
        self._tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _rope(self, n: int, table: int) -> tuple[torch.Tensor, torch.Tensor]:
        have = self._tables.get(table)
        if have is None or have[0].shape[0] < n:
            cos, sin = rope_tables(self.cfg, max(n, 2 * (have[0].shape[0] if have else 0)), table)
            self._tables[table] = torch.from_numpy(cos), torch.from_numpy(sin)
        return self._tables[table]

    @staticmethod
    def tree_mask(start_pos: int, end: int, prefix: int, parents) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tree attention (docs: tree-contract): the mask [M, end] of query slots start_pos..end-1,
        their RoPE positions and the logical positions of the cache rows 0..end-1. Slot s >= prefix
        has parent slot parents[s - prefix] (-1: a root) and sees the rows 0..prefix-1, its
        ancestors and itself, at position prefix + depth(s)."""
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
        key_pos = torch.cat([torch.arange(prefix), torch.tensor(depth, dtype=torch.long) + prefix])
        return anc[rows], torch.tensor(depth[rows], dtype=torch.long) + prefix, key_pos

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start_pos: int, kv: KVCache, tree=None) -> torch.Tensor:
        """tokens [M] at positions start_pos.. -> logits [M, V] fp32; writes K/V rows (float32 cache).
        `tree` = (prefix, parents): the rows are tree slots (tree_mask), not consecutive positions."""
        cfg, f32 = self.cfg, torch.float32
        cache = torch.from_numpy(kv.data)  # shares the pool's array: writes land in the cache
        M, H, KVH, hd = tokens.shape[0], cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        end = start_pos + M
        rows = torch.from_numpy(kv.rows(0, end))  # the pool rows of positions 0..end-1
        if tree is None:
            # causal mask over the cache rows 0..end-1 for query rows at start_pos..end-1
            mask = torch.arange(end)[None, :] <= torch.arange(start_pos, end)[:, None]  # [M, end]
            pos = torch.arange(start_pos, end)
            key_pos = torch.arange(end)
        else:
            mask, pos, key_pos = self.tree_mask(start_pos, end, tree[0], tree[1])
        h = self.w.embed[tokens].to(f32)  # [M, D]
        if cfg.embed_scale != 1.0:
            h = h * torch.tensor(cfg.embed_scale, dtype=f32)
        for i, lw in enumerate(self.w.layers):
            x = rms_norm(h, lw.attn_norm, cfg.rms_norm_eps)
            q = F.linear(x, lw.wq, lw.bq).view(M, H, hd)
            k = F.linear(x, lw.wk, lw.bk).view(M, KVH, hd)
            v = F.linear(x, lw.wv, lw.bv).view(M, KVH, hd)
            if lw.q_norm is not None:
                q, k = rms_norm(q, lw.q_norm, cfg.rms_norm_eps), rms_norm(k, lw.k_norm, cfg.rms_norm_eps)
            table = cfg.rope_table_of(i)
            if table >= 0:
                cos_t, sin_t = self._rope(int(pos.max()) + 1, table)
                q, k = apply_rope(q, cos_t[pos], sin_t[pos]), apply_rope(k, cos_t[pos], sin_t[pos])
            seen = mask
            if cfg.window_of(i):  # sliding window: logical key positions > pos - window
                seen = mask & (key_pos[None, :] > pos[:, None] - cfg.window_of(i))
            cache[i, 0, rows[start_pos:]] = k
            cache[i, 1, rows[start_pos:]] = v
            keys = cache[i, 0, rows].repeat_interleave(H // KVH, dim=1).transpose(0, 1)  # [H, end, hd]
            vals = cache[i, 1, rows].repeat_interleave(H // KVH, dim=1).transpose(0, 1)
            if cfg.query_scale is None:
                att = (q.transpose(0, 1) @ keys.transpose(1, 2)) / hd ** 0.5  # [H, M, end]
            else:
                att = (q.transpose(0, 1) @ keys.transpose(1, 2)) * cfg.query_scale
            att = att.masked_fill(~seen[None], float("-inf")).softmax(-1)
            o = (att @ vals).transpose(0, 1).reshape(M, H * hd)
            o = F.linear(o, lw.wo)
            h = h + (o if lw.post_attn_norm is None else rms_norm(o, lw.post_attn_norm, cfg.rms_norm_eps))
            x = rms_norm(h, lw.mlp_norm, cfg.rms_norm_eps)
            g = F.linear(x, lw.w_gate)
            g = F.gelu(g, approximate="tanh") if cfg.hidden_act == "gelu_tanh" else F.silu(g)
            o = F.linear(g * F.linear(x, lw.w_up), lw.w_down)
            h = h + (o if lw.post_mlp_norm is None else rms_norm(o, lw.post_mlp_norm, cfg.rms_norm_eps))
        h = rms_norm(h, self.w.norm, cfg.rms_norm_eps)
        return F.linear(h, self.w.lm_head)


class TorchBackend:
    """Engine backend on the torch reference model (FP32 KV cache: an oracle, not a fast path).
    Concurrent sequences (qspec/batch.py) run one after the other within a step: torch's GEMMs are
    not batch-invariant, so rows are never batched across sequences here."""

    def __init__(self, cfg: ModelConfig, weights: ModelWeights):
        self.cfg = cfg
        self.model = TorchModel(cfg, weights)
        self.pool = KVPool(cfg, dtype=np.float32)
        self.kv = KVCache(self.pool)

    def forward(self, tokens, start_pos: int, *, all_logits: bool = False, tree=None) -> np.ndarray:
        """`tree` = (prefix, parents): a tree pass (TorchModel.tree_mask, docs: tree-contract)."""
        p = self.prepare(self.kv, tokens, start_pos, all_logits=all_logits, tree=tree)
        with self.pool.lock:
            return self.run([p], 0)[0]

    def prepare(self, kv: KVCache, tokens, start_pos: int, *, all_logits: bool = False, draft=False,
                tree=None) -> Pass:
        if draft:
            raise ValueError("the torch backend has no draft")
        kv.ensure_capacity(start_pos + len(tokens))
        # nothing recorded for reuse: torch's GEMMs are not batch-invariant (a row computed in a
        # prefill of M rows need not match the same row computed alone), so every prompt is prefilled
        kv.writing(start_pos, start_pos + len(tokens))  # and never `recorded`
        return Pass(kv, np.asarray(tokens, dtype=np.int64).reshape(-1), int(start_pos), all_logits, tree)

    def run(self, passes, weight_set: int) -> list[np.ndarray]:
        out = []
        for p in passes:
            logits = self.model.forward(torch.as_tensor(p.tokens, dtype=torch.long), p.start_pos, p.kv, p.tree)
            out.append((logits if p.all_logits else logits[-1:]).numpy())
        return out
