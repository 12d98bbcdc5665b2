"""Load a Hugging Face model directory: config, memory-mapped safetensors weights (never pickle)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
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
    layers: Sequence[LayerWeights]  # may read each layer from disk when indexed
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


class Checkpoint:
    """The tensors of a checkpoint, memory-mapped by safetensors (no unpickling), read on demand."""

    def __init__(self, model_dir: Path):
        self.model_dir = model_dir
        self._where: dict[str, object] = {}
        for f in _weight_files(model_dir):
            try:
                h = safe_open(str(f), framework="pt")
                for name in h.keys():
                    self._where[name] = (h, f)
            except (SafetensorError, OSError, RuntimeError, ValueError) as e:
                raise ModelLoadError(f"{f}: corrupt or unreadable safetensors file ({_first_line(e)})") from None

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        h, _ = self._where[name]
        return tuple(h.get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        h, f = self._where[name]
        try:
            return h.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise ModelLoadError(f"{f}: corrupt or unreadable safetensors file ({_first_line(e)})") from None


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


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


class _Layers(Sequence):
    """Decoder layers read from the checkpoint when indexed: a backend that packs weights
    layer by layer never holds more than one layer of BF16 tensors besides its packed copy."""

    def __init__(self, read: Callable[[int], LayerWeights], n: int):
        self._read, self._n = read, n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        if not -self._n <= i < self._n:
            raise IndexError(i)
        return self._read(i % self._n)


def load_weights(model_dir: Path, cfg: ModelConfig) -> ModelWeights:
    """Checks every tensor's presence and shape up front (from the headers), reads lazily."""
    ck = Checkpoint(model_dir)
    D, hd, F = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q_out, kv_out = cfg.n_heads * hd, cfg.n_kv_heads * hd
    layer_shapes = {"input_layernorm.weight": (D,), "self_attn.q_proj.weight": (q_out, D),
                    "self_attn.k_proj.weight": (kv_out, D), "self_attn.v_proj.weight": (kv_out, D),
                    "self_attn.o_proj.weight": (D, q_out), "post_attention_layernorm.weight": (D,),
                    "mlp.gate_proj.weight": (F, D), "mlp.up_proj.weight": (F, D), "mlp.down_proj.weight": (D, F)}
    if cfg.attention_bias:
        layer_shapes.update({"self_attn.q_proj.bias": (q_out,), "self_attn.k_proj.bias": (kv_out,),
                             "self_attn.v_proj.bias": (kv_out,)})
    expected = {"model.embed_tokens.weight": (cfg.vocab_size, D), "model.norm.weight": (D,)}
    for i in range(cfg.n_layers):
        expected.update({f"model.layers.{i}.{k}": v for k, v in layer_shapes.items()})
    untied = not cfg.tie_word_embeddings
    if untied:
        expected["lm_head.weight"] = (cfg.vocab_size, D)
    for name, shape in expected.items():
        if name not in ck:
            raise ModelLoadError(f"{model_dir}: tensor {name} is missing")
        if ck.shape(name) != shape:
            raise ModelLoadError(f"{model_dir}: tensor {name} has shape {ck.shape(name)}, config says {shape}")

    bf16, f32 = torch.bfloat16, torch.float32

    def get(name: str, dtype: torch.dtype) -> torch.Tensor:
        return ck.get(name).to(dtype).contiguous()

    def read_layer(i: int) -> LayerWeights:
        p = f"model.layers.{i}."
        bias = cfg.attention_bias
        return LayerWeights(
            attn_norm=get(p + "input_layernorm.weight", f32),
            wq=get(p + "self_attn.q_proj.weight", bf16),
            wk=get(p + "self_attn.k_proj.weight", bf16),
            wv=get(p + "self_attn.v_proj.weight", bf16),
            wo=get(p + "self_attn.o_proj.weight", bf16),
            mlp_norm=get(p + "post_attention_layernorm.weight", f32),
            w_gate=get(p + "mlp.gate_proj.weight", bf16),
            w_up=get(p + "mlp.up_proj.weight", bf16),
            w_down=get(p + "mlp.down_proj.weight", bf16),
            bq=get(p + "self_attn.q_proj.bias", f32) if bias else None,
            bk=get(p + "self_attn.k_proj.bias", f32) if bias else None,
            bv=get(p + "self_attn.v_proj.bias", f32) if bias else None,
        )

    embed = get("model.embed_tokens.weight", bf16)
    lm_head = get("lm_head.weight", bf16) if untied else embed
    return ModelWeights(embed=embed, layers=_Layers(read_layer, cfg.n_layers),
                        norm=get("model.norm.weight", f32), lm_head=lm_head)
