"""ModelConfig: the architecture facts qspec needs, read from a Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ModelLoadError

# Llama-family architectures: the same block (RMSNorm, RoPE, GQA attention, gated MLP), with the
# per-family options of ModelConfig (docs/architecture.md, "Model families").
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "SmolLM3ForCausalLM": "smollm3",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",  # its text model (text_config), see from_dict
    "Phi3ForCausalLM": "phi3",
}
ROPE_TYPES = ("default", "linear", "llama3", "longrope")
# Gemma3ForConditionalGeneration: its text_config is read as a Gemma3ForCausalLM (the image tower is
# not loaded); the Hub's text_config lists only what differs from these (Gemma3TextConfig's defaults).
GEMMA3_TEXT_DEFAULTS = {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
                        "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
                        "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
                        "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256,
                        "sliding_window": 4096, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
                        "tie_word_embeddings": True}

_REQUIRED_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "vocab_size")


@dataclass(frozen=True)
class ModelConfig:
    arch: str                     # a value of SUPPORTED_ARCHITECTURES
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    max_seq_len: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # per-family options (the defaults are the Llama block)
    qk_norm: bool = False            # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    norm_plus_one: bool = False      # RMSNorm weights are stored as w, applied as 1 + w (Gemma)
    embed_scale: float = 1.0         # embeddings times this (Gemma: sqrt(hidden_size), fp32)
    sandwich_norms: bool = False     # RMSNorm of the attention and MLP outputs too (Gemma 3)
    hidden_act: str = "silu"         # "silu" (SwiGLU) | "gelu_tanh" (GeGLU)
    query_scale: float | None = None  # attention scale; None: head_dim ** -0.5
    partial_rotary_factor: float = 1.0  # RoPE on the first head_dim * this columns (Phi-4-mini)
    rope_local_theta: float | None = None  # RoPE base of the sliding-window layers (Gemma 3)
    # per layer: RoPE table (0: rope_theta/rope_scaling, 1: rope_local_theta, -1: no RoPE) and
    # sliding window (0: full attention); empty: every layer 0, 0
    layer_rope: tuple[int, ...] = ()
    layer_window: tuple[int, ...] = ()
    fused_checkpoint: bool = False   # qkv_proj and gate_up_proj stored fused (Phi-3)

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        archs = d.get("architectures") or []
        if "Gemma3ForConditionalGeneration" in archs and isinstance(d.get("text_config"), dict):
            d = {**GEMMA3_TEXT_DEFAULTS,
                 **{k: d[k] for k in ("bos_token_id", "eos_token_id", "tie_word_embeddings") if k in d},
                 **d["text_config"], "architectures": ["Gemma3ForCausalLM"]}
            archs = d["architectures"]
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None and d.get("model_type") == "gemma3_text":
            arch = "gemma3"
        if arch is None:
            name = ", ".join(archs) if archs else d.get("model_type", "unknown")
            raise ModelLoadError(f"{source}: unsupported architecture {name!r} "
                                 f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        missing = [k for k in _REQUIRED_KEYS if k not in d]
        if missing:
            raise ModelLoadError(f"{source}: missing required key(s) {', '.join(missing)}")
        try:
            n_heads = int(d["num_attention_heads"])
            n_kv = int(d.get("num_key_value_heads") or n_heads)
            hidden = int(d["hidden_size"])
            head_dim = int(d.get("head_dim") or hidden // n_heads)
            eos = d.get("eos_token_id")
            eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
            n_layers = int(d["num_hidden_layers"])
            rope_theta, rope_scaling, extra = _rope(d, arch, source)
            extra.update(_family(d, arch, n_layers, hidden, source))
            cfg = cls(
                arch=arch,
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                n_layers=n_layers,
                n_heads=n_heads,
                n_kv_heads=n_kv,
                head_dim=head_dim,
                vocab_size=int(d["vocab_size"]),
                max_seq_len=int(d.get("max_position_embeddings") or 4096),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                attention_bias=bool(d.get("attention_bias", arch == "qwen2")),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", arch in ("gemma3", "smollm3"))),
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=eos_ids,
                **extra,
            )
        except (TypeError, ValueError) as e:
            raise ModelLoadError(f"{source}: invalid value ({e})") from None
        cfg._validate(source)
        return cfg

    @property
    def gemm_params(self) -> int:
        """Weights the GEMMs stream per token: every layer's Q/K/V/O and MLP, plus the LM head."""
        attn = self.hidden_size * (self.n_heads + 2 * self.n_kv_heads) * self.head_dim \
            + self.n_heads * self.head_dim * self.hidden_size
        return self.n_layers * (attn + 3 * self.hidden_size * self.intermediate_size) \
            + self.vocab_size * self.hidden_size

    @classmethod
    def from_file(cls, path: Path) -> "ModelConfig":
        try:
            d = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ModelLoadError(f"{path}: no config.json (not a Hugging Face model directory)") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(d, dict):
            raise ModelLoadError(f"{path}: expected a JSON object")
        return cls.from_dict(d, str(path))

    def _validate(self, source: str) -> None:
        for name in ("hidden_size", "intermediate_size", "n_layers", "n_heads", "n_kv_heads",
                     "head_dim", "vocab_size", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ModelLoadError(f"{source}: {name} must be positive")
        if self.n_heads % self.n_kv_heads:
            raise ModelLoadError(f"{source}: num_attention_heads ({self.n_heads}) is not a multiple "
                                 f"of num_key_value_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ModelLoadError(f"{source}: head_dim must be even for RoPE")
        if self.rope_dim % 2 or not 2 <= self.rope_dim <= self.head_dim:
            raise ModelLoadError(f"{source}: partial_rotary_factor {self.partial_rotary_factor} gives "
                                 f"{self.rope_dim} rotary columns of {self.head_dim} (must be even, >= 2)")
        rs = self.rope_scaling
        if rs is not None:
            kind = rs.get("rope_type", rs.get("type")) if isinstance(rs, dict) else None
            if kind not in ROPE_TYPES:
                raise ModelLoadError(f"{source}: unsupported rope_scaling {rs!r} "
                                     f"(supported: {', '.join(ROPE_TYPES[1:])})")
            if kind == "longrope":
                half = self.rope_dim // 2
                for k in ("short_factor", "long_factor"):
                    if not isinstance(rs.get(k), list) or len(rs[k]) != half:
                        raise ModelLoadError(f"{source}: longrope {k} must be a list of {half} numbers")

    @property
    def rope_dim(self) -> int:
        """Columns of each head that RoPE rotates (transformers: int(head_dim * partial_rotary_factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    def rope_table_of(self, layer: int) -> int:
        return self.layer_rope[layer] if self.layer_rope else 0

    def window_of(self, layer: int) -> int:
        return self.layer_window[layer] if self.layer_window else 0


def _rope(d: dict[str, Any], arch: str, source: str) -> tuple[float, dict | None, dict[str, Any]]:
    """(rope_theta, rope_scaling or None, extra fields) from either config format: transformers 4
    (rope_theta, rope_scaling, Gemma's rope_local_base_freq, Phi's partial_rotary_factor at the top)
    or 5 (rope_parameters; Gemma 3: one dict per layer type)."""
    rp = d.get("rope_parameters")
    extra: dict[str, Any] = {}
    if arch == "gemma3":
        if isinstance(rp, dict) and isinstance(rp.get("full_attention"), dict):
            glob, local = dict(rp["full_attention"]), dict(rp.get("sliding_attention") or {})
        else:
            glob = dict(d.get("rope_scaling") or {})
            glob.setdefault("rope_theta", d.get("rope_theta", 1_000_000.0))
            local = {"rope_theta": d.get("rope_local_base_freq", 10_000.0)}
        if local.get("rope_type", local.get("type", "default")) != "default":
            raise ModelLoadError(f"{source}: unsupported rope scaling of the sliding-window layers {local!r}")
        extra["rope_local_theta"] = float(local.get("rope_theta", 10_000.0))
    elif isinstance(rp, dict):
        glob = dict(rp)
    else:
        # the original path (llama, mistral, qwen2 as before): rope_scaling passed on as it is
        prf = d.get("partial_rotary_factor")
        if prf is not None:
            extra["partial_rotary_factor"] = float(prf)
        rs = d.get("rope_scaling")
        if isinstance(rs, dict) and rs.get("rope_type", rs.get("type")) in ("longrope", "su"):
            rs = _longrope(rs, d)
        return float(d.get("rope_theta", 10000.0)), rs, extra
    theta = float(glob.pop("rope_theta", d.get("rope_theta", 10000.0)))
    prf = glob.pop("partial_rotary_factor", d.get("partial_rotary_factor"))
    if prf is not None:
        extra["partial_rotary_factor"] = float(prf)
    kind = glob.get("rope_type", glob.get("type", "default"))
    if kind in ("longrope", "su"):
        glob = _longrope(glob, d)
    return theta, (None if kind == "default" else glob), extra


def _longrope(rs: dict, d: dict[str, Any]) -> dict:
    """A longrope rope_scaling with original_max_position_embeddings filled in from the top level."""
    rs = dict(rs, rope_type="longrope")
    rs.pop("type", None)
    rs.setdefault("original_max_position_embeddings",
                  d.get("original_max_position_embeddings", d.get("max_position_embeddings")))
    return rs


def _family(d: dict[str, Any], arch: str, n_layers: int, hidden: int, source: str) -> dict[str, Any]:
    """The per-family options of ModelConfig (transformers' rules for each family's config)."""
    def layer_types(default: list[str]) -> list[str]:
        lt = d.get("layer_types") or default
        if len(lt) != n_layers or any(t not in ("full_attention", "sliding_attention") for t in lt):
            raise ModelLoadError(f"{source}: layer_types must list full_attention or sliding_attention "
                                 f"for each of the {n_layers} layers")
        return list(lt)

    def windows(types: list[str], window) -> tuple[int, ...]:
        if window is not None and int(window) < 1:
            raise ModelLoadError(f"{source}: sliding_window must be positive")
        return tuple(int(window) if t == "sliding_attention" and window else 0 for t in types)

    act = d.get("hidden_activation") or d.get("hidden_act") or "silu"
    want = "gelu_pytorch_tanh" if arch == "gemma3" else "silu"
    if arch in ("qwen3", "smollm3", "gemma3", "phi3") and act != want:
        raise ModelLoadError(f"{source}: unsupported activation {act!r} for {arch} (supported: {want})")
    if arch == "qwen3":
        window = d.get("sliding_window") if d.get("use_sliding_window") else None
        mwl = int(d.get("max_window_layers", n_layers))
        types = layer_types(["sliding_attention" if window and i >= mwl else "full_attention"
                             for i in range(n_layers)])
        return {"qk_norm": True, "layer_window": windows(types, window)}
    if arch == "smollm3":
        nope = d.get("no_rope_layers")
        if nope is None:
            every = int(d.get("no_rope_layer_interval", 4))
            nope = [int((i + 1) % every != 0) for i in range(n_layers)]
        if len(nope) < n_layers:
            raise ModelLoadError(f"{source}: no_rope_layers has {len(nope)} entries for {n_layers} layers")
        window = d.get("sliding_window") if d.get("use_sliding_window") else None
        types = layer_types(["sliding_attention" if window and not nope[i] else "full_attention"
                             for i in range(n_layers)])
        return {"layer_rope": tuple(0 if nope[i] else -1 for i in range(n_layers)),
                "layer_window": windows(types, window)}
    if arch == "gemma3":
        for k in ("final_logit_softcapping", "attn_logit_softcapping"):
            if d.get(k) is not None:
                raise ModelLoadError(f"{source}: {k} is not supported (Gemma 3 checkpoints leave it null)")
        if d.get("use_bidirectional_attention"):
            raise ModelLoadError(f"{source}: use_bidirectional_attention is not supported (a decoder only)")
        pattern = int(d.get("sliding_window_pattern", 6))
        types = layer_types(["sliding_attention" if (i + 1) % pattern else "full_attention"
                             for i in range(n_layers)])
        import numpy as np

        return {"qk_norm": True, "norm_plus_one": True, "sandwich_norms": True, "hidden_act": "gelu_tanh",
                "embed_scale": float(np.float32(hidden ** 0.5)),
                "query_scale": float(d.get("query_pre_attn_scalar", 256)) ** -0.5,
                "layer_rope": tuple(1 if t == "sliding_attention" else 0 for t in types),
                "layer_window": windows(types, d.get("sliding_window"))}
    if arch == "phi3":
        window = d.get("sliding_window")
        return {"fused_checkpoint": True, "layer_window": windows(["sliding_attention"] * n_layers, window)}
    return {}
