"""Synthetic-weight models of real shapes: for speed benchmarks and tests, never for acceptance.

Weights are random (seeded) with a scale that keeps activations O(1) through the layers, so
that the kernels see realistic magnitudes. `save_model_dir` writes a loadable HF-style
directory (config.json, model.safetensors, a word-level tokenizer.json) for tiny models.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .config import ModelConfig
from .loader import LayerWeights, ModelWeights

# Real architecture shapes (Hugging Face configs of the named models).
SHAPES: dict[str, dict] = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, n_layers=30, n_heads=9, n_kv_heads=3,
                         head_dim=64, vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, n_layers=16, n_heads=32, n_kv_heads=8,
                         head_dim=64, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True),
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, n_layers=32, n_heads=32, n_kv_heads=8,
                       head_dim=128, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=False),
}


def synthetic_config(name: str, **overrides) -> ModelConfig:
    kw = dict(SHAPES[name], arch="llama", max_seq_len=4096, rms_norm_eps=1e-5, eos_token_ids=())
    kw.update(overrides)
    return ModelConfig(**kw)


def synthetic_weights(cfg: ModelConfig, seed: int = 0, scale: float = 1.0) -> ModelWeights:
    g = torch.Generator().manual_seed(seed)
    bf16 = torch.bfloat16

    def mat(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, generator=g) * (scale / k ** 0.5)).to(bf16)

    def norm(d: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(d, generator=g)

    D, F, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    layers = [LayerWeights(attn_norm=norm(D), wq=mat(cfg.n_heads * hd, D), wk=mat(cfg.n_kv_heads * hd, D),
                           wv=mat(cfg.n_kv_heads * hd, D), wo=mat(D, cfg.n_heads * hd), mlp_norm=norm(D),
                           w_gate=mat(F, D), w_up=mat(F, D), w_down=mat(D, F))
              for _ in range(cfg.n_layers)]
    embed = torch.randn(cfg.vocab_size, D, generator=g).to(bf16)
    lm_head = embed if cfg.tie_word_embeddings else mat(cfg.vocab_size, D)
    return ModelWeights(embed=embed, layers=layers, norm=norm(D), lm_head=lm_head)


def save_model_dir(out: Path, cfg: ModelConfig, weights: ModelWeights) -> Path:
    """A loadable directory (tied embeddings stored once, as HF does)."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    out.mkdir(parents=True, exist_ok=True)
    t = {"model.embed_tokens.weight": weights.embed, "model.norm.weight": weights.norm.to(torch.bfloat16)}
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = weights.lm_head
    for i, lw in enumerate(weights.layers):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": lw.attn_norm.to(torch.bfloat16),
                  p + "post_attention_layernorm.weight": lw.mlp_norm.to(torch.bfloat16),
                  p + "self_attn.q_proj.weight": lw.wq, p + "self_attn.k_proj.weight": lw.wk,
                  p + "self_attn.v_proj.weight": lw.wv, p + "self_attn.o_proj.weight": lw.wo,
                  p + "mlp.gate_proj.weight": lw.w_gate, p + "mlp.up_proj.weight": lw.w_up,
                  p + "mlp.down_proj.weight": lw.w_down})
    save_file({k: v.contiguous() for k, v in t.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_word_embeddings, "eos_token_id": list(cfg.eos_token_ids)}))
    vocab = {f"w{i}": i for i in range(cfg.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(out / "tokenizer.json"))
    return out
