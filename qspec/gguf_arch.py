"""The GGUF architectures qspec imports, and how llama.cpp's names and metadata map to Hugging Face's.

Per GGUF architecture (general.architecture), as llama.cpp's convert_hf_to_gguf.py writes it:
- the HF class and model_type of the checkpoint written;
- `permuted_qk`: llama.cpp interleaves the Q/K rows of its LlamaModel and the classes derived
  from it (llama, smollm3); qwen2, qwen3, gemma3 and phi3 are written as HF has them;
- `norm_shift`: Gemma computes x * (1 + w) and HF stores w; llama.cpp stores 1 + w in every
  "*norm.weight" tensor (Gemma3Model.norm_shift), so the import subtracts 1;
- the per-layer tensor names (after "blk.N.") and their HF names (after "model.layers.N.").
Fields llama.cpp does not store are filled with the values it hard-codes for that architecture
(gemma3: every 6th layer global, sliding-window RoPE base 10000; smollm3: every 4th layer
without RoPE).
"""

from __future__ import annotations

from dataclasses import dataclass

from qspec.errors import ModelLoadError


def field(reader, key: str, default=None):
    """GGUF metadata value of `key`, or `default` when the file lacks it."""
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        return f.contents()
    except (ValueError, IndexError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"GGUF metadata key {key} is unreadable ({e})") from None


def require(reader, key: str):
    value = field(reader, key)
    if value is None:
        raise ModelLoadError(f"GGUF metadata key {key} is missing")
    return value


_ATTN = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj"}
_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_LLAMA_LAYER = {**_ATTN, **_MLP, "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_GEMMA3_LAYER = {**_ATTN, **_MLP, **_QK_NORM,
                 "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                 "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
_PHI3_LAYER = {"attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
               "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj",
               "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}

GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Tensors llama.cpp adds that HF derives from the config: RoPE frequency factors (rope_scaling).
SKIPPED_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}

GEMMA3_GLOBAL_EVERY = 6        # llama.cpp's default (set_swa_pattern(6)) when the GGUF names no pattern
GEMMA3_LOCAL_ROPE_BASE = 10000.0  # llama.cpp's default for gemma3's sliding-window layers
SMOLLM3_NO_ROPE_EVERY = 4      # llama.cpp: n_no_rope_layer_step = 4 for LLM_ARCH_SMOLLM3


@dataclass(frozen=True)
class Arch:
    hf_class: str
    model_type: str
    permuted_qk: bool
    layer_tensors: dict
    norm_shift: float = 0.0


ARCHS = {
    "llama": Arch("LlamaForCausalLM", "llama", True, _LLAMA_LAYER),
    "qwen2": Arch("Qwen2ForCausalLM", "qwen2", False, _LLAMA_LAYER),
    "qwen3": Arch("Qwen3ForCausalLM", "qwen3", False, {**_LLAMA_LAYER, **_QK_NORM}),
    "smollm3": Arch("SmolLM3ForCausalLM", "smollm3", True, _LLAMA_LAYER),
    "gemma3": Arch("Gemma3ForCausalLM", "gemma3_text", False, _GEMMA3_LAYER, norm_shift=1.0),
    "phi3": Arch("Phi3ForCausalLM", "phi3", False, _PHI3_LAYER),
}


def hf_name(arch: str, gguf_name: str) -> str | None:
    """The HF name of a GGUF tensor; None for one HF does not store; ModelLoadError if unknown."""
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    if gguf_name in SKIPPED_TENSORS:
        return None
    parts = gguf_name.split(".")
    layer = ARCHS[arch].layer_tensors
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer:
        return f"model.layers.{parts[1]}.{layer[parts[2]]}.{parts[3]}"
    raise ModelLoadError(f"unexpected GGUF tensor {gguf_name}")


def gguf_name(arch: str, hf: str) -> str:
    """The GGUF name of HF tensor `hf` (the inverse of hf_name)."""
    for g, h in GLOBAL_TENSORS.items():
        if h == hf:
            return g
    _, _, i, rest = hf.split(".", 3)  # model.layers.N.<module>.<weight|bias>
    module, _, suffix = rest.rpartition(".")
    return next(f"blk.{i}.{g}.{suffix}" for g, h in ARCHS[arch].layer_tensors.items() if h == module)


def expected_shapes(arch: str, hp: dict) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every weight the architecture must provide (biases are checked where
    present)."""
    d, f, v = hp["hidden_size"], hp["intermediate_size"], hp["vocab_size"]
    hd = hp["head_dim"]
    q, kv = hp["num_attention_heads"] * hd, hp["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not hp["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, d)
    per_layer = {
        "self_attn.q_proj": (q, d), "self_attn.k_proj": (kv, d), "self_attn.v_proj": (kv, d),
        "self_attn.qkv_proj": (q + 2 * kv, d), "self_attn.o_proj": (d, q),
        "self_attn.q_norm": (hd,), "self_attn.k_norm": (hd,),
        "mlp.gate_proj": (f, d), "mlp.up_proj": (f, d), "mlp.gate_up_proj": (2 * f, d), "mlp.down_proj": (d, f),
    }
    for i in range(hp["num_hidden_layers"]):
        for hf in ARCHS[arch].layer_tensors.values():
            shapes[f"model.layers.{i}.{hf}.weight"] = per_layer.get(hf, (d,))  # the rest: norms
    return shapes


def _gemma3_layer_types(pattern, layers: int) -> dict:
    """sliding_window_pattern / layer_types from the GGUF's pattern: every Nth layer global (an
    int), or one flag per layer (True = sliding window)."""
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ModelLoadError(f"GGUF sliding_window_pattern has {len(pattern)} entries for {layers} layers")
        return {"layer_types": ["sliding_attention" if p else "full_attention" for p in pattern]}
    n = int(pattern)
    if n < 1:
        raise ModelLoadError(f"GGUF sliding_window_pattern {n} is not >= 1")
    return {"sliding_window_pattern": n,
            "layer_types": ["full_attention" if (i + 1) % n == 0 else "sliding_attention" for i in range(layers)]}


def arch_config(reader, arch: str, hp: dict, has_attn_bias: bool, rope_factors) -> dict:
    """The config.json fields of `arch` beyond the common hyper-parameters `hp`.
    `rope_factors(name)`: the dequantized GGUF tensor `name` (phi3's long/short RoPE factors)."""
    a, layers = arch, hp["num_hidden_layers"]
    if arch == "gemma3":
        heads, d, hd = hp["num_attention_heads"], hp["hidden_size"], hp["head_dim"]
        return {
            "hidden_activation": "gelu_pytorch_tanh",
            # llama.cpp scales queries by 1/sqrt(n_embd / n_head) for the 62-layer 27B, else 1/sqrt(head_dim)
            "query_pre_attn_scalar": d // heads if layers == 62 else hd,
            "sliding_window": int(require(reader, f"{a}.attention.sliding_window")),
            **_gemma3_layer_types(field(reader, f"{a}.attention.sliding_window_pattern", GEMMA3_GLOBAL_EVERY), layers),
            "rope_local_base_freq": float(field(reader, f"{a}.rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE)),
            "rope_scaling": hp.get("rope_scaling"),
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
            "attention_bias": False,
        }
    if arch == "phi3":
        config = {"hidden_act": "silu", "attention_bias": False}
        window = field(reader, f"{a}.attention.sliding_window")
        config["sliding_window"] = int(window) if window else None
        rot = field(reader, f"{a}.rope.dimension_count")
        if rot is not None and int(rot) != hp["head_dim"]:
            config["partial_rotary_factor"] = int(rot) / hp["head_dim"]
        orig = field(reader, f"{a}.rope.scaling.original_context_length")
        config["original_max_position_embeddings"] = int(orig) if orig else hp["max_position_embeddings"]
        long, short = rope_factors("rope_factors_long.weight"), rope_factors("rope_factors_short.weight")
        if (long is None) != (short is None):
            raise ModelLoadError("phi3 GGUF with only one of rope_factors_long/rope_factors_short")
        if long is not None:
            config["rope_scaling"] = {"type": "longrope", "long_factor": [float(x) for x in long.reshape(-1)],
                                      "short_factor": [float(x) for x in short.reshape(-1)]}
        return config
    config = {"hidden_act": "silu"}
    if arch in ("llama", "smollm3"):  # some llama-architecture models carry q/k/v/o biases
        config.update(attention_bias=has_attn_bias, mlp_bias=False)
    if arch == "qwen3":
        config.update(attention_bias=False, use_sliding_window=False)
    if arch == "smollm3":
        config.update(no_rope_layer_interval=SMOLLM3_NO_ROPE_EVERY, use_sliding_window=False,
                      no_rope_layers=[int((i + 1) % SMOLLM3_NO_ROPE_EVERY != 0) for i in range(layers)])
    return config
