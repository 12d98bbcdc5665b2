"""ModelConfig: the architecture facts qspec needs, read from a Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ModelLoadError

# Llama-family architectures: same block (RMSNorm, RoPE, GQA attention, SwiGLU MLP).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
_REQUIRED_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "vocab_size")


@dataclass(frozen=True)
class ModelConfig:
    arch: str                     # "llama" | "mistral" | "qwen2"
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

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        archs = d.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
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
            cfg = cls(
                arch=arch,
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                n_layers=int(d["num_hidden_layers"]),
                n_heads=n_heads,
                n_kv_heads=n_kv,
                head_dim=head_dim,
                vocab_size=int(d["vocab_size"]),
                max_seq_len=int(d.get("max_position_embeddings") or 4096),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
                rope_theta=float(d.get("rope_theta", 10000.0)),
                rope_scaling=d.get("rope_scaling"),
                attention_bias=bool(d.get("attention_bias", arch == "qwen2")),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=eos_ids,
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
        rs = self.rope_scaling
        if rs is not None:
            kind = rs.get("rope_type", rs.get("type")) if isinstance(rs, dict) else None
            if kind not in ("llama3", "linear", "default"):
                raise ModelLoadError(f"{source}: unsupported rope_scaling {rs!r} (supported: llama3, linear)")
