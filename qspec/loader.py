"""Load a Hugging Face model directory: config, memory-mapped safetensors weights (never pickle).

The safetensors headers are read and checked as JSON at load; tensors are read, with torch, only
when used: a load that maps everything from the weight cache (qspec/weight_cache.py) never
imports torch."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from .config import ModelConfig
from .errors import ModelLoadError

if TYPE_CHECKING:
    import torch

# bytes per element of the safetensors dtypes
DTYPE_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2,
               "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8}


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
    q_norm: torch.Tensor | None = None          # [hd] fp32, per-head q/k RMSNorm (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None  # [D] fp32, norms of the block outputs (Gemma 3)
    post_mlp_norm: torch.Tensor | None = None


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


def read_safetensors_header(path: Path) -> tuple[dict[str, dict], int]:
    """({tensor name: {"dtype", "shape", "data_offsets"}}, offset of the data) of a safetensors
    file, every entry checked against the file's size (what safetensors checks when it opens one);
    ModelLoadError naming the file otherwise."""
    def bad(why: str) -> ModelLoadError:
        return ModelLoadError(f"{path}: corrupt or unreadable safetensors file ({why})")

    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            size = path.stat().st_size
            n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
            if not 2 <= n <= min(size - 8, 100 * 2**20):
                raise bad("bad header length")
            header = json.loads(f.read(n))
    except OSError as e:
        raise bad(e.strerror or str(e)) from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise bad("header is not JSON") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    header.pop("__metadata__", None)
    for name, info in header.items():
        try:
            lo, hi = (int(x) for x in info["data_offsets"])
            count = 1
            for d in info["shape"]:
                count *= int(d)
            ok = 0 <= lo <= hi <= size - 8 - n and hi - lo == count * DTYPE_SIZES[info["dtype"]]
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise bad(f"tensor {name}")
    return header, 8 + n


class Checkpoint:
    """The tensors of a checkpoint: names, dtypes and shapes from the headers; data memory-mapped
    by safetensors (no unpickling) and read on demand, as torch tensors (torch is imported then)."""

    def __init__(self, model_dir: Path, torch_threads: int | None = None):
        self.model_dir = model_dir
        self.torch_threads = torch_threads
        self._where: dict[str, tuple[Path, dict]] = {}
        for f in _weight_files(model_dir):
            header, _ = read_safetensors_header(f)
            self._where.update((name, (f, info)) for name, info in header.items())
        self._open: dict[Path, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in self._where[name][1]["shape"])

    def get(self, name: str):
        """The tensor `name` as a torch.Tensor in its stored dtype."""
        import torch
        from safetensors import SafetensorError, safe_open

        f = self._where[name][0]
        try:
            if f not in self._open:
                if not self._open and self.torch_threads:
                    torch.set_num_threads(self.torch_threads)
                self._open[f] = safe_open(str(f), framework="pt")
            return self._open[f].get_tensor(name)
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


# LayerWeights field -> checkpoint tensor (under model.layers.<i>.) of the norms, by family
_NORMS = {"attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight"}
_NORMS_QK = dict(_NORMS, q_norm="self_attn.q_norm.weight", k_norm="self_attn.k_norm.weight")
_NORMS_SANDWICH = dict(_NORMS_QK, post_attn_norm="post_attention_layernorm.weight",
                       mlp_norm="pre_feedforward_layernorm.weight",
                       post_mlp_norm="post_feedforward_layernorm.weight")
FUSED_QKV, FUSED_GATE_UP = "self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"  # Phi-3
MODEL_PREFIXES = ("model.", "model.language_model.", "language_model.model.")


def layer_norm_names(cfg: ModelConfig) -> dict[str, str]:
    """The norms of a layer of this family: LayerWeights field -> tensor name under model.layers.<i>."""
    return _NORMS_SANDWICH if cfg.sandwich_norms else _NORMS_QK if cfg.qk_norm else _NORMS


def load_weights(model_dir: Path, cfg: ModelConfig, torch_threads: int | None = None) -> ModelWeights:
    """Checks every tensor's presence and shape up front (from the headers), reads each tensor when
    it is first used (`torch_threads`: torch's thread count, set when torch is first needed).
    Phi-3's fused qkv_proj / gate_up_proj are split into the q, k, v and gate, up rows here."""
    ck = Checkpoint(model_dir, torch_threads)
    # the decoder's tensors: model.* (a causal LM); a Gemma 3 multimodal checkpoint holds them
    # under model.language_model.* (transformers 5) or language_model.model.* (the Hub's)
    base = next((b for b in MODEL_PREFIXES if b + "embed_tokens.weight" in ck), "model.")
    D, hd, F = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q_out, kv_out = cfg.n_heads * hd, cfg.n_kv_heads * hd
    norms = layer_norm_names(cfg)
    fused = cfg.fused_checkpoint and base + "layers.0." + FUSED_QKV in ck
    layer_shapes = {name: ((hd,) if field in ("q_norm", "k_norm") else (D,)) for field, name in norms.items()}
    if fused:
        layer_shapes.update({FUSED_QKV: (q_out + 2 * kv_out, D), FUSED_GATE_UP: (2 * F, D)})
    else:
        layer_shapes.update({"self_attn.q_proj.weight": (q_out, D), "self_attn.k_proj.weight": (kv_out, D),
                             "self_attn.v_proj.weight": (kv_out, D), "mlp.gate_proj.weight": (F, D),
                             "mlp.up_proj.weight": (F, D)})
    layer_shapes.update({"self_attn.o_proj.weight": (D, q_out), "mlp.down_proj.weight": (D, F)})
    if cfg.attention_bias:
        layer_shapes.update({"self_attn.q_proj.bias": (q_out,), "self_attn.k_proj.bias": (kv_out,),
                             "self_attn.v_proj.bias": (kv_out,)})
    expected = {base + "embed_tokens.weight": (cfg.vocab_size, D), base + "norm.weight": (D,)}
    for i in range(cfg.n_layers):
        expected.update({f"{base}layers.{i}.{k}": v for k, v in layer_shapes.items()})
    untied = not cfg.tie_word_embeddings
    if untied:
        expected["lm_head.weight"] = (cfg.vocab_size, D)
    for name, shape in expected.items():
        if name not in ck:
            raise ModelLoadError(f"{model_dir}: tensor {name} is missing")
        if ck.shape(name) != shape:
            raise ModelLoadError(f"{model_dir}: tensor {name} has shape {ck.shape(name)}, config says {shape}")

    bf16, f32 = "bfloat16", "float32"

    def get(name: str, dtype: str):
        import torch

        return ck.get(name).to(getattr(torch, dtype)).contiguous()

    def get_norm(name: str):
        w = get(name, f32)
        return 1.0 + w if cfg.norm_plus_one else w  # Gemma: (1 + w) in fp32, as transformers

    def read_layer(i: int) -> LayerWeights:
        p = f"{base}layers.{i}."
        bias = cfg.attention_bias
        if fused:
            qkv, gu = get(p + FUSED_QKV, bf16), get(p + FUSED_GATE_UP, bf16)
            wq, wk, wv = (t.contiguous() for t in qkv.split([q_out, kv_out, kv_out]))
            w_gate, w_up = (t.contiguous() for t in gu.split([F, F]))  # transformers: gate, up = chunk(2)
        else:
            wq, wk, wv = (get(p + f"self_attn.{k}_proj.weight", bf16) for k in "qkv")
            w_gate, w_up = (get(p + f"mlp.{k}_proj.weight", bf16) for k in ("gate", "up"))
        return LayerWeights(
            wq=wq, wk=wk, wv=wv, w_gate=w_gate, w_up=w_up,
            wo=get(p + "self_attn.o_proj.weight", bf16),
            w_down=get(p + "mlp.down_proj.weight", bf16),
            bq=get(p + "self_attn.q_proj.bias", f32) if bias else None,
            bk=get(p + "self_attn.k_proj.bias", f32) if bias else None,
            bv=get(p + "self_attn.v_proj.bias", f32) if bias else None,
            **{field: get_norm(p + name) for field, name in norms.items()},
        )

    return CheckpointWeights(layers=_Layers(read_layer, cfg.n_layers),
                             read_embed=lambda: get(base + "embed_tokens.weight", bf16),
                             read_norm=lambda: get_norm(base + "norm.weight"),
                             read_lm_head=(lambda: get("lm_head.weight", bf16)) if untied else None)


class CheckpointWeights(ModelWeights):
    """ModelWeights of a checkpoint, each tensor read when first used (the layers each time they
    are indexed): with the packed weights mapped from the cache, none is read."""

    def __init__(self, layers: Sequence[LayerWeights], read_embed: Callable, read_norm: Callable,
                 read_lm_head: Callable | None):
        self.layers = layers
        self._read_embed, self._read_norm, self._read_lm_head = read_embed, read_norm, read_lm_head

    @cached_property
    def embed(self):
        return self._read_embed()

    @cached_property
    def norm(self):
        return self._read_norm()

    @cached_property
    def lm_head(self):
        return self.embed if self._read_lm_head is None else self._read_lm_head()
