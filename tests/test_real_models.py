"""Losslessness on the real benchmark models (Qwen2.5-Coder-1.5B / 0.5B, `qspec fetch NAME`).

Slow (minutes per model on two cores): run with `python -m pytest -m slow test_real_models.py`.
A model that has not been fetched is skipped with the command that fetches it.
"""

import pytest

import qspec
from qspec import _C
from qspec.bench.common import dev_prompts
from qspec.draft import DRAFT_FORMATS
from qspec.fetch import is_fetched

MODELS = ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")


def _require(name: str) -> None:
    if not is_fetched(name):
        pytest.skip(f"{name} is not fetched (run: qspec fetch {name})")


@pytest.mark.slow
@pytest.mark.parametrize("fmt", DRAFT_FORMATS)
@pytest.mark.parametrize("name", MODELS)
def test_greedy_speculative_equals_plain(name, fmt):
    """Greedy speculative == plain greedy, token for token, for every draft format (its own MX
    LM head and the shared BF16 one), fixed K and auto, on prompts of every category."""
    _require(name)
    prompts = dev_prompts(n=6)
    eng = qspec.load(name, draft=fmt, draft_lm_head=fmt)
    plain = [eng.generate(p, max_new_tokens=48, speculative=False).tokens for p in prompts]
    drafted = 0
    for prompt, want in zip(prompts, plain):
        for k in (1, 4, "auto"):
            r = eng.generate(prompt, max_new_tokens=48, draft_max=k)
            assert r.tokens == want, f"{name} {fmt} K={k} isa={_C.cpu_info()['isa_selected']}: {prompt!r}"
            drafted += r.stats["drafted"]  # a step may be the prompt lookup's alone (qspec/lookup.py)
    assert drafted > 0
    del eng
    shared_head = qspec.load(name, draft=fmt, draft_lm_head="bf16")
    for prompt, want in zip(prompts[:2], plain[:2]):
        assert shared_head.generate(prompt, max_new_tokens=48, draft_max=3).tokens == want


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_sampling_speculative_is_seeded(name):
    _require(name)
    eng = qspec.load(name)
    kw = dict(max_new_tokens=32, temperature=0.7, seed=3)
    a = eng.generate("Write a haiku about compilers.", **kw)
    b = eng.generate("Write a haiku about compilers.", **kw)
    assert a.tokens == b.tokens and a.stats["drafted"] > 0
