"""Load a Hugging Face model directory: config, memory-mapped safetensors weights (never pickle)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .config import ModelConfig
from .errors import ModelLoadError


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [D] fp32
    wq: torch.Tensor         # [H*hd, D] bf16
    wk: torch.Tensor         # [KVH*hd, D] bf16
    wv: torch.Tensor         # [KVH*hd, D] bf16
    wo: torch.Tensor         # [D, H*hd] bf16
    mlp_norm: torch.Tensor   # [D] fp32
    w_gate: torch.Tensor     # [F, D] bf16
    w_up: torch.Tensor       # [F, D] bf16
    w_down: torch.Tensor     # [D, F] bf16
    bq: torch.Tensor | None = None  # [H*hd] fp32 (Qwen2)
    bk: torch.Tensor | None = None
    bv: torch.Tensor | None = None


@dataclass
class ModelWeights:
    embed: torch.Tensor    # [V, D] bf16
    layers: list[LayerWeights]
    norm: torch.Tensor     # [D] fp32
    lm_head: torch.Tensor  # [V, D] bf16; the embedding itself when tied


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"{index}: invalid safetensors index ({e})") from None
        files = [model_dir / n for n in names]
        for f in files:
            if not f.exists():
                raise ModelLoadError(f"{index}: shard {f.name} is missing")
        return files
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    if list(model_dir.glob("*.bin")) or list(model_dir.glob("*.pt")):
        raise ModelLoadError(f"{model_dir}: only pickle checkpoints (*.bin/*.pt) found; qspec reads "
                             "safetensors only (convert them with transformers' save_pretrained)")
    raise ModelLoadError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


def read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint, memory-mapped by safetensors (no unpickling)."""
    tensors: dict[str, torch.Tensor] = {}
    for f in _weight_files(model_dir):
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    tensors[name] = st.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ModelLoadError(f"{f}: corrupt or unreadable safetensors file ({msg})") from None
    return tensors


def check_model_dir(path: str | Path) -> Path:
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelLoadError(f"{p}: no such file or directory")
    if p.is_file():
        if p.suffix == ".gguf":
            raise ModelLoadError(f"{p}: is a GGUF file; import it first with `qspec convert {p} OUT_DIR`")
        raise ModelLoadError(f"{p}: expected a model directory (config.json + safetensors)")
    if not (p / "config.json").exists():
        raise ModelLoadError(f"{p}: no config.json (not a Hugging Face model directory)")
    return p


def load_weights(model_dir: Path, cfg: ModelConfig) -> ModelWeights:
    t = read_tensors(model_dir)
    D, hd = cfg.hidden_size, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {}

    def take(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if name not in t:
            raise ModelLoadError(f"{model_dir}: tensor {name} is missing")
        x = t.pop(name)
        if tuple(x.shape) != shape:
            raise ModelLoadError(f"{model_dir}: tensor {name} has shape {tuple(x.shape)}, "
                                 f"config says {shape}")
        shapes[name] = shape
        return x.to(dtype).contiguous()

    bf16, f32 = torch.bfloat16, torch.float32
    q_out, kv_out = cfg.n_heads * hd, cfg.n_kv_heads * hd
    layers = []
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        bias = cfg.attention_bias
        layers.append(LayerWeights(
            attn_norm=take(p + "input_layernorm.weight", (D,), f32),
            wq=take(p + "self_attn.q_proj.weight", (q_out, D), bf16),
            wk=take(p + "self_attn.k_proj.weight", (kv_out, D), bf16),
            wv=take(p + "self_attn.v_proj.weight", (kv_out, D), bf16),
            wo=take(p + "self_attn.o_proj.weight", (D, q_out), bf16),
            mlp_norm=take(p + "post_attention_layernorm.weight", (D,), f32),
            w_gate=take(p + "mlp.gate_proj.weight", (cfg.intermediate_size, D), bf16),
            w_up=take(p + "mlp.up_proj.weight", (cfg.intermediate_size, D), bf16),
            w_down=take(p + "mlp.down_proj.weight", (D, cfg.intermediate_size), bf16),
            bq=take(p + "self_attn.q_proj.bias", (q_out,), f32) if bias else None,
            bk=take(p + "self_attn.k_proj.bias", (kv_out,), f32) if bias else None,
            bv=take(p + "self_attn.v_proj.bias", (kv_out,), f32) if bias else None,
        ))
    embed = take("model.embed_tokens.weight", (cfg.vocab_size, D), bf16)
    norm = take("model.norm.weight", (D,), f32)
    if cfg.tie_word_embeddings or "lm_head.weight" not in t:
        if not cfg.tie_word_embeddings:
            raise ModelLoadError(f"{model_dir}: tensor lm_head.weight is missing")
        lm_head = embed
    else:
        lm_head = take("lm_head.weight", (cfg.vocab_size, D), bf16)
    return ModelWeights(embed=embed, layers=layers, norm=norm, lm_head=lm_head)
