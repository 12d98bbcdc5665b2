"""Context size (ctx_size / --ctx-size) and the memory of the KV cache, checked before allocation."""

import subprocess
import sys

import pytest

import qspec
import qspec.loading
from qspec import ContextMemoryError, ContextSizeError, PromptTooLongError
from qspec.kv_cache import KVCache, KVPool
from qspec.memory import available_bytes, cache_bytes, draft_kv_bytes_per_token, kv_bytes_per_token
from qspec.native import DRAFT_KV_AUTO_FORMAT
from qspec.synthetic import save_model_dir, synthetic_config, synthetic_weights

HUGE = 2**40  # positions: a cache of 256 TiB for the tiny model, beyond any machine's memory


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = synthetic_config("smollm2-135m", hidden_size=64, intermediate_size=128, n_layers=2, n_heads=4,
                           n_kv_heads=2, head_dim=32, vocab_size=32, max_seq_len=HUGE)
    return save_model_dir(tmp_path_factory.mktemp("tiny"), cfg, synthetic_weights(cfg))


def cli(*args):
    return subprocess.run([sys.executable, "-m", "qspec.cli", *args], capture_output=True, text=True, timeout=600)


def test_bytes_per_token_of_the_1_5b():
    # the figure: 28 layers x 2 KV heads x 128 x 2 (K, V) x 2 bytes = 28 KiB per token
    cfg = synthetic_config("smollm2-135m", n_layers=28, n_heads=12, n_kv_heads=2, head_dim=128)
    assert kv_bytes_per_token(cfg) == 28 * 1024
    assert draft_kv_bytes_per_token(cfg, "int8") == 14 * 1024 + 14 * 1024 // 32 + 1  # + a flag byte
    # INT4: half a byte a value, V a scale byte per 32, K a BF16 center and a scale byte per channel
    # per 32-position page: 28.1% of BF16
    assert draft_kv_bytes_per_token(cfg, "int4") == 14 * 1024 // 2 + 7 * 1024 // 32 * 4 + 1
    assert cache_bytes(cfg, 8192, "int8") == 8192 * (28 * 1024 + 14 * 1024 * 33 // 32 + 1)


def test_ctx_size_sizes_the_cache_and_limits_prompts(tiny):
    eng = qspec.load(tiny, draft="mxfp4", ctx_size=48)
    assert eng.ctx_size == 48 and eng.backend.pool.pages * eng.backend.pool.page_size >= 48  # reserved at load
    r = eng.generate([1, 2, 3], max_new_tokens=8)
    assert r.stats["kv_bytes"] == 11 * eng.backend.kv.bytes_per_position
    with pytest.raises(PromptTooLongError, match=r"\(40 tokens\).*\(9\).*48 tokens"):
        eng.generate([1] * 40, max_new_tokens=9)
    eng.generate([1] * 40, max_new_tokens=8)  # exactly the context


@pytest.mark.parametrize("bad,match", [(0, ">= 1"), (2.5, "integer"), (True, "integer"), (HUGE + 1, "exceeds")])
def test_bad_ctx_size(tiny, bad, match):
    with pytest.raises(ContextSizeError, match=match):
        qspec.load(tiny, ctx_size=bad)


def test_memory_checked_before_any_weight_is_read(tiny, monkeypatch):
    def no_weights(*a, **k):
        raise AssertionError("weights were read before the memory check")

    monkeypatch.setattr(qspec.loading, "load_weights", no_weights)
    with pytest.raises(ContextMemoryError) as e:
        qspec.load(tiny, ctx_size=HUGE)
    # the BF16 cache and the draft copy of the default draft (draft_kv="auto")
    need = str(cache_bytes(qspec.config.ModelConfig.from_file(tiny / "config.json"), HUGE, DRAFT_KV_AUTO_FORMAT))
    assert need in str(e.value) and "available" in str(e.value)


def test_cache_growth_checked_before_allocation(monkeypatch):
    cfg = synthetic_config("smollm2-135m", n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32)
    pool = KVPool(cfg, page_size=16)
    kv = KVCache(pool)
    monkeypatch.setattr("qspec.memory.available_bytes", lambda: 100 * pool.bytes_per_position)
    kv.ensure_capacity(96)  # doubling to 16 pages does not fit: just the 6 pages needed
    assert kv.capacity == 96 and pool.pages == 6
    with pytest.raises(ContextMemoryError, match=f"{112 * pool.bytes_per_position} bytes"):
        kv.ensure_capacity(97)
    assert kv.capacity == 96 and pool.pages == 6


def test_cache_does_not_grow_while_free_pages_hold_the_rows():
    """A reserved pool (ctx_size) or one with pages given back serves a long prompt from its
    free pages: no growth, no copy of the cache (it doubled on every multi-page request)."""
    cfg = synthetic_config("smollm2-135m", n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32)
    pool = KVPool(cfg, page_size=16)
    pool.reserve(1024)
    kv = KVCache(pool)
    data = pool.data
    kv.ensure_capacity(1000)
    assert pool.pages == 64 and pool.data is data and kv.capacity == 1008
    kv.release()
    kv.ensure_capacity(900)
    assert pool.pages == 64 and pool.data is data
    kv.ensure_capacity(1100)  # past the pool: it grows (doubles)
    assert pool.pages == 128 and kv.capacity == 1104


def test_available_memory_is_known():
    assert available_bytes() > 0


def test_cli_ctx_size_memory_line_and_errors(tiny):
    r = cli("generate", "-m", str(tiny), "-c", "64", "-n", "4", "--no-chat", "w1 w2 w3")
    assert r.returncode == 0, r.stderr
    assert "KV cache for 64 tokens:" in r.stderr and "available" in r.stderr
    r = cli("generate", "-m", str(tiny), "-c", str(HUGE), "-n", "4", "--no-chat", "w1")
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert r.returncode != 0 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("qspec: error: a KV cache of") and "bytes" in lines[0] and "available" in lines[0]
    r = cli("generate", "-m", str(tiny), "-c", "16", "-n", "10", "--no-chat", " ".join(["w1"] * 10))
    lines = [l for l in r.stderr.splitlines() if l.strip() and "KV cache" not in l]
    assert r.returncode != 0 and len(lines) == 1 and "(10 tokens)" in lines[0] and "16 tokens" in lines[0], r.stderr
