"""Model families beyond Llama (Qwen3, SmolLM3, Gemma 3, Phi-3) against transformers' own code.

Each family is built tiny and random from transformers' config class (offline), saved as BF16
safetensors, and loaded by qspec. The native forward must match transformers' FP32 forward of the
same BF16 weights over a few hundred positions, so that every family-specific piece is exercised:
q/k norms, sliding windows (window 24 << 300 positions, and past the 256-key attention segment),
NoPE layers, Gemma's scaled embedding / (1 + w) norms / sandwich norms / GeGLU / local and global
RoPE bases / query_pre_attn_scalar / head_dim 256, Phi's fused tensors / partial rotary / longrope
(short factors below original_max_position_embeddings, long ones after). Greedy speculative
decoding (a chain and a tree) must equal plain greedy decoding token for token.
"""

import json

import numpy as np
import pytest
import torch

import qspec
from qspec.config import ModelConfig
from qspec.errors import ModelLoadError

transformers = pytest.importorskip("transformers")

N_POS = 300      # positions compared (windows of 24; the native attention's 256-key segments)
VOCAB = 256
# Logit tolerance, relative to the largest |logit| of the reference over the positions. The torch
# reference backend (FP32 K/V) matches transformers to ~1e-5 of it; the native forward keeps FP32
# activations but rounds K and V to BF16 in its cache (relative error <= 2^-9 per element), which
# these random models (weights ~0.15, so every layer amplifies) carry to <= 1.3% of max |logit|
# (measured: qwen3 0.6%, smollm3 1.1%, gemma3 0.6%, phi3 1.3%). Breaking one family piece in the
# native model (window off by one key, no window, RoPE on a NoPE layer, the global base on a local
# layer) moves the logits by 27% to 140% of it. The reference backend's bound has headroom above
# its usual ~1e-5: one CI-like run out of a dozen measured 3.1e-4 on qwen3 (pure torch FP32 on both
# sides, not reproduced since); a broken piece moves it by orders of magnitude more.
LOGITS_RTOL = 0.03
LOGITS_RTOL_TORCH = 1e-3

FAMILIES = {
    "qwen3": dict(head_dim=32, use_sliding_window=True, sliding_window=24, max_window_layers=1,
                  tie_word_embeddings=False),
    "smollm3": dict(no_rope_layers=[1, 0, 1], tie_word_embeddings=True),
    "gemma3_text": dict(hidden_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=256,
                        sliding_window=24, query_pre_attn_scalar=48, hidden_activation="gelu_pytorch_tanh",
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                            "rope_theta": 1_000_000.0},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}),
    "phi3": dict(sliding_window=24, original_max_position_embeddings=128, tie_word_embeddings=False,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5,
                                  "short_factor": [1.0, 1.1, 1.3, 1.7], "long_factor": [1.0, 2.0, 4.0, 9.0],
                                  "original_max_position_embeddings": 128}),
}
ARCH = {"qwen3": "Qwen3ForCausalLM", "smollm3": "SmolLM3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
        "phi3": "Phi3ForCausalLM"}


def _hf_config(model_type: str):
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
              initializer_range=0.15, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    kw.update(FAMILIES[model_type])
    cfg = transformers.AutoConfig.for_model(model_type, **kw)
    cfg.architectures = [ARCH[model_type]]
    return cfg


def save_tiny(model_type: str, out):
    """A random BF16 checkpoint of the family in `out` (seeded; the 1-D weights, norms, perturbed so
    that their values matter) with a word-level tokenizer; returns out."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config(model_type), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.2 * torch.randn_like(p))
    model.to(torch.bfloat16).save_pretrained(out)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(out / "tokenizer.json"))
    return out


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    return request.param, save_tiny(request.param, tmp_path_factory.mktemp(request.param))


def _ids(n: int, seed: int = 1) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB, n).tolist()


@torch.inference_mode()
def _hf_logits(model_dir, ids: list[int]) -> torch.Tensor:
    """transformers' FP32 logits [len(ids), V]: one forward up to a longrope model's
    original_max_position_embeddings, then one token per step with its cache (as its generate
    runs; qspec's longrope tables are per position, qspec/rope.py)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    rp = getattr(model.config, "rope_parameters", None) or {}
    first = rp.get("original_max_position_embeddings", len(ids)) if rp.get("rope_type") == "longrope" else len(ids)
    out = model(torch.tensor([ids[:first]]), use_cache=True)
    logits, cache = [out.logits[0]], out.cache
    for t in ids[first:]:
        out = model(torch.tensor([[t]]), cache=cache, use_cache=True)
        logits.append(out.logits[0])
        cache = out.cache
    return torch.cat(logits)


def test_logits_match_transformers(family):
    model_type, model_dir = family
    ids = _ids(N_POS)
    ref = _hf_logits(model_dir, ids)
    eng = qspec.load(model_dir, draft=None, backend="native")
    eng.backend.kv.ensure_capacity(N_POS)
    ours = torch.from_numpy(eng.backend.forward(ids, 0, all_logits=True))
    scale = ref.abs().max().item()
    err = (ours - ref).abs().max().item()
    assert scale > 1.0, f"{model_type}: logits too small to test ({scale:.3g})"
    assert err <= LOGITS_RTOL * scale, f"{model_type}: max |logit diff| {err:.3g} > {LOGITS_RTOL} * {scale:.3g}"
    torch_eng = qspec.load(model_dir, draft=None, backend="torch")  # the reference backend too
    torch_eng.backend.kv.ensure_capacity(N_POS)
    mine = torch.from_numpy(torch_eng.backend.forward(ids, 0, all_logits=True))
    err_torch = (mine - ref).abs().max().item()
    assert err_torch <= LOGITS_RTOL_TORCH * scale, model_type


def test_greedy_speculative_chain_tree_and_levels_equal_plain(family):
    model_type, model_dir = family
    eng = qspec.load(model_dir, draft="mxfp4")
    prompt = _ids(240, seed=2)  # decoding crosses position 256 (a second attention segment)
    want = eng.generate(prompt, max_new_tokens=40, speculative=False).tokens
    chain = eng.generate(prompt, max_new_tokens=40, draft_max=4, tree="off")
    # the tree is the subject: no lookup-alone steps (a random model's text repeats)
    tree = eng.generate(prompt, max_new_tokens=40, tree="on", tree_width=2, tree_depth=3, lookup="off")
    assert chain.tokens == want, model_type
    assert tree.tokens == want and tree.stats["tree_steps"] > 0, model_type
    again = eng.generate(prompt, max_new_tokens=40, speculative=False).tokens  # prefix reuse
    assert again == want, model_type
    levels = qspec.load(model_dir, draft="mxfp6_e2m3", draft_levels=["mxfp4"])  # a chain of draft levels
    assert levels.generate(prompt, max_new_tokens=40).tokens == want, model_type


def test_unsupported_architecture_is_one_line():
    with pytest.raises(ModelLoadError) as e:
        ModelConfig.from_dict({"architectures": ["FalconForCausalLM"], "hidden_size": 8})
    msg = str(e.value)
    assert "\n" not in msg and "FalconForCausalLM" in msg
    for arch in ("Qwen3ForCausalLM", "SmolLM3ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM"):
        assert arch in msg


def _rewrite(model_dir, change) -> None:
    from safetensors.torch import load_file, save_file

    f = model_dir / "model.safetensors"
    t = load_file(str(f))
    change(t)
    save_file(t, str(f), metadata={"format": "pt"})


@pytest.mark.parametrize("model_type,name", [("qwen3", "model.layers.1.self_attn.q_norm.weight"),
                                             ("gemma3_text", "model.layers.0.post_feedforward_layernorm.weight"),
                                             ("phi3", "model.layers.2.self_attn.qkv_proj.weight")])
def test_missing_or_misshaped_tensor_is_named(tmp_path, model_type, name):
    d = save_tiny(model_type, tmp_path / "m")
    _rewrite(d, lambda t: t.pop(name))
    with pytest.raises(ModelLoadError, match=f"tensor {name} is missing"):
        qspec.load(d, draft=None)
    d = save_tiny(model_type, tmp_path / "s")
    _rewrite(d, lambda t: t.update({name: t[name][:-2].contiguous()}))
    with pytest.raises(ModelLoadError) as e:
        qspec.load(d, draft=None)
    assert f"tensor {name} has shape" in str(e.value) and "\n" not in str(e.value)


# config.json as the Hub's checkpoints write them (transformers 4 keys), reduced to what matters
GEMMA3_1B = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 1152,
             "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
             "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 262144, "max_position_embeddings": 32768,
             "rms_norm_eps": 1e-6, "rope_theta": 1000000, "rope_local_base_freq": 10000, "rope_scaling": None,
             "sliding_window": 512, "sliding_window_pattern": 6, "query_pre_attn_scalar": 256,
             "final_logit_softcapping": None, "attn_logit_softcapping": None,
             "hidden_activation": "gelu_pytorch_tanh"}
PHI35_MINI = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 3072,
              "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 32, "vocab_size": 32064, "max_position_embeddings": 131072,
              "original_max_position_embeddings": 4096, "rope_theta": 10000.0, "sliding_window": 262144,
              "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48},
              "hidden_act": "silu"}


def test_hub_style_configs():
    g = ModelConfig.from_dict(GEMMA3_1B)
    assert g.tie_word_embeddings and g.qk_norm and g.sandwich_norms and g.hidden_act == "gelu_tanh"
    assert g.layer_rope == (1, 1, 1, 1, 1, 0) * 4 + (1, 1) and g.rope_local_theta == 10000.0
    assert g.layer_window[:6] == (512,) * 5 + (0,) and g.rope_theta == 1e6
    assert g.embed_scale == float(np.float32(1152 ** 0.5)) and g.query_scale == 256 ** -0.5
    p = ModelConfig.from_dict(PHI35_MINI)
    assert p.fused_checkpoint and p.rope_scaling["rope_type"] == "longrope"
    assert p.rope_scaling["original_max_position_embeddings"] == 4096 and p.layer_window == (262144,) * 32
    p4 = ModelConfig.from_dict(dict(PHI35_MINI, partial_rotary_factor=0.75, num_attention_heads=24,
                                    num_key_value_heads=8, rope_scaling=dict(PHI35_MINI["rope_scaling"],
                                    short_factor=[1.0] * 48, long_factor=[1.0] * 48)))
    assert p4.head_dim == 128 and p4.rope_dim == 96
    s = ModelConfig.from_dict({"architectures": ["SmolLM3ForCausalLM"], "hidden_size": 64, "intermediate_size": 8,
                               "num_hidden_layers": 8, "num_attention_heads": 4, "vocab_size": 8})
    assert s.layer_rope == (0, 0, 0, -1, 0, 0, 0, -1)  # no_rope_layer_interval 4: every 4th layer NoPE


@pytest.mark.parametrize("change,words", [
    (dict(final_logit_softcapping=30.0), "final_logit_softcapping"),
    (dict(hidden_activation="gelu"), "activation"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "unsupported rope_scaling"),
])
def test_unsupported_family_options_are_refused(change, words):
    with pytest.raises(ModelLoadError, match=words) as e:
        ModelConfig.from_dict(dict(GEMMA3_1B, **change))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("model_type", [pytest.param(t, marks=[] if t == "gemma3_text" else pytest.mark.slow)
                                        for t in FAMILIES])
def test_tensor_parallel_two_ranks(tmp_path, model_type):
    """2 ranks against 1 process (tests/test_tp.py's suite): logits within rounding, batch
    invariance, greedy speculative (chain, tree) == greedy plain under TP."""
    from test_tp import check_suite, run_worker

    check_suite(run_worker("suite", save_tiny(model_type, tmp_path), 2))


def test_tensor_parallel_shards_keep_norms_whole(family):
    """Per-head q/k norms and Gemma's output norms are replicated on every rank; the q/k/v rows
    split by heads (qspec/parallel/shard.py)."""
    from qspec.loader import load_weights
    from qspec.native import pack_target, small_names
    from qspec.parallel.shard import Shard

    model_type, model_dir = family
    cfg = ModelConfig.from_file(model_dir / "config.json")
    w = load_weights(model_dir, cfg)
    for rank in range(2):
        shard = Shard.plan(cfg, rank, 2)
        packed = dict(pack_target(w, shard))
        for k in small_names(cfg):
            assert np.array_equal(packed[f"layers.0.{k}"], getattr(w.layers[0], k).numpy()), (model_type, k)
    assert json.loads((model_dir / "config.json").read_text())["architectures"] == [ARCH[model_type]]


@torch.inference_mode()
def test_gemma3_multimodal_checkpoint_reads_its_text_model(tmp_path):
    """Gemma3ForConditionalGeneration: the text model of the checkpoint (model.language_model.*),
    its config from text_config; the image tower is not loaded. Logits of a text-only prompt."""
    text = _hf_config("gemma3_text").to_dict()
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    cfg = transformers.AutoConfig.for_model("gemma3", text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                            boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2,
                                            image_token_index=VOCAB - 1)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.2 * torch.randn_like(p))
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    ids = _ids(60)
    ref = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager").eval()(torch.tensor([ids])).logits[0]
    save_tiny("gemma3_text", tmp_path / "tok")  # for its tokenizer.json
    (tmp_path / "tokenizer.json").write_bytes((tmp_path / "tok" / "tokenizer.json").read_bytes())
    eng = qspec.load(tmp_path, draft=None)
    assert eng.cfg.arch == "gemma3" and eng.cfg.vocab_size == ref.shape[-1]
    eng.backend.kv.ensure_capacity(len(ids))
    ours = torch.from_numpy(eng.backend.forward(ids, 0, all_logits=True))
    assert (ours - ref).abs().max().item() <= LOGITS_RTOL * ref.abs().max().item()
