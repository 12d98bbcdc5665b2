"""qspec against an independent implementation: Hugging Face transformers, FP32, same weights.

The default model (GGUF -> HF directory by `qspec convert`) is loaded by both. Where the two
greedy continuations part, the test passes only if the reference's two best logits at that
position are within NEAR_TIE (a genuine tie that any FP32 reordering can flip), and fails otherwise.
"""

import pytest
import torch

import qspec

LOGITS_ATOL_TORCH = 1e-4   # FP32 math, FP32 KV: the same op order as transformers (measured: 0)
LOGITS_ATOL_NATIVE = 0.15  # FP32 math, BF16 KV cache (docs/architecture.md): K/V rounded to 8 bits (measured <= 0.10)
# The avx512_bf16 and amx GEMM paths also round activations to BF16 (csrc/gemm.h); measured on
# the six prompts: <= 0.24 under ISA emulation (tests/test_isa_emulation.py runs this file on
# those levels), <= 0.22 on AVX512-BF16 hardware and <= 0.33 on AMX hardware (Xeon, whose
# TDPBF16PS sums a tile step's products more precisely than the SDM's sequential pseudo-code).
LOGITS_ATOL_NATIVE_BF16_ACT = 0.4
NEAR_TIE_TORCH = 1e-4
N_NEW = 64

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain why the sky is blue in two sentences.",
    "List three prime numbers greater than 50.",
    "Translate 'good morning' into Spanish and German.",
    "Once upon a time in a small village,",
]

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_model(default_model_dir):
    m = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    m.eval()
    return m


@pytest.fixture(scope="module", params=["torch", "native"])
def engine(request, default_model_dir):
    return qspec.load(default_model_dir, draft=None, backend=request.param)


def _ids(engine, prompt):
    return engine.encode_prompt(prompt, chat=not prompt.startswith("Once"))


def _tol(engine):
    """(logit tolerance, near-tie gap) for this backend at the selected ISA level."""
    if type(engine.backend).__name__ == "TorchBackend":
        return LOGITS_ATOL_TORCH, NEAR_TIE_TORCH
    bf16_act = qspec._C.gemm_choose(engine.backend.lm_head, 1) in ("avx512_bf16", "amx")
    atol = LOGITS_ATOL_NATIVE_BF16_ACT if bf16_act else LOGITS_ATOL_NATIVE
    return atol, atol  # a split is a near tie when the reference's top-2 gap is within our error


@torch.inference_mode()
def test_final_logits_match_transformers(engine, hf_model):
    atol, _ = _tol(engine)
    for prompt in PROMPTS:
        ids = _ids(engine, prompt)
        ref = hf_model(torch.tensor([ids])).logits[0, -1]
        engine.backend.kv.reset()
        engine.backend.kv.ensure_capacity(len(ids))
        ours = torch.from_numpy(engine.backend.forward(ids, 0)[-1])
        err = (ours - ref).abs().max().item()
        assert err < atol, f"{prompt!r}: max |logit diff| {err:.3g} >= {atol}"
        assert int(ours.argmax()) == int(ref.argmax()) or \
            (ref.topk(2).values[0] - ref.topk(2).values[1]).item() < atol


_hf_continuations: dict = {}


def _hf_greedy(hf_model, ids: list[int], eos: list[int]) -> list[int]:
    """The reference's greedy continuation, generated once for both backends."""
    key = (tuple(ids), tuple(eos))
    if key not in _hf_continuations:
        _hf_continuations[key] = hf_model.generate(torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False,
                                                   eos_token_id=eos, pad_token_id=2)[0, len(ids):].tolist()
    return _hf_continuations[key]


@torch.inference_mode()
def test_greedy_continuations_match_transformers(engine, hf_model):
    _, near_tie = _tol(engine)
    torch_backend = type(engine.backend).__name__ == "TorchBackend"  # its logits: every prompt, above
    for prompt in PROMPTS[:3] if torch_backend else PROMPTS:
        ids = _ids(engine, prompt)
        ours = engine.generate(ids, max_new_tokens=N_NEW).tokens
        ref = _hf_greedy(hf_model, ids, sorted(engine.eos_ids))
        n = min(len(ours), len(ref))
        split = next((i for i in range(n) if ours[i] != ref[i]), None)
        if split is None:
            assert len(ours) == len(ref), f"{prompt!r}: lengths differ {len(ours)} vs {len(ref)}"
            continue
        logits = hf_model(torch.tensor([ids + ref[:split]])).logits[0, -1]
        top2 = logits.topk(2).values
        gap = (top2[0] - top2[1]).item()
        assert gap < near_tie, (f"{prompt!r}: continuations part at token {split} "
                                f"({ours[split]} vs {ref[split]}) with a top-2 gap of {gap:.3g} >= {near_tie}")
