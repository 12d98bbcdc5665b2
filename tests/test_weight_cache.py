"""The packed-weight cache: written on the first load, mapped (no packing) on the next, identical
output, rebuilt when anything it depends on changes or the file is damaged, never in the way."""

import json
import os
import shutil
import threading
import time

import numpy as np
import pytest

import qspec
from qspec import _C
from qspec.draft import DRAFT_CAST, read_packed_file, write_packed_file
from qspec.weight_cache import SUFFIX

PROMPT = "Write a haiku about the sea."
N = 12
LIGHT = "mxfp4"  # the draft cast in the invalidation tests (draft_lm_head="bf16": layers only)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "qspec-cache"
    monkeypatch.setenv("QSPEC_CACHE", str(root))
    monkeypatch.delenv("QSPEC_NO_WEIGHT_CACHE", raising=False)
    return root / "packed"


@pytest.fixture
def model_copy(default_model_dir, tmp_path):
    """The default model in a directory of its own (files copied, so they can be changed)."""
    return shutil.copytree(default_model_dir, tmp_path / "model")


def files(d):
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def no_temp_files(d):
    return not [n for n in files(d) if n.endswith(".tmp")]


def forbid_packing(monkeypatch):
    """Any packing or casting, or reading a layer of the checkpoint, from here on fails the test."""
    def boom(*a, **k):
        raise AssertionError("packed or read the checkpoint although the weight cache has the weights")
    for name in ("pack_bf16", "pack_mx", "mx_quantize"):
        monkeypatch.setattr(_C, name, boom)
    monkeypatch.setattr("qspec.loader._Layers.__getitem__", boom)


def logits(engine, ids, draft=False):
    be = engine.backend
    be.kv.reset()
    be.kv.ensure_capacity(len(ids))
    return be.forward(ids, 0, all_logits=True, draft=draft)


@pytest.fixture(scope="module")
def pristine(default_model_dir, tmp_path_factory):
    """A cache written by a first load of the default model with the LIGHT draft (checked here),
    and the greedy speculative tokens of that load. Tests copy its files instead of packing again."""
    root = tmp_path_factory.mktemp("pristine-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QSPEC_CACHE", str(root))
        mp.delenv("QSPEC_NO_WEIGHT_CACHE", raising=False)
        eng = qspec.load(default_model_dir, draft=LIGHT, draft_lm_head="bf16")
        info = eng.backend.load_info
        assert (info["target"], info["draft"], info["embed"]) == ("built+cached", "built+cached", "mapped")
        want = eng.generate(PROMPT, max_new_tokens=N)
    d = root / "packed"
    assert len(files(d)) == 2 and all(n.endswith(SUFFIX) for n in files(d)) and no_temp_files(d)
    assert want.stats["drafted"] > 0
    return d, want.tokens


def use_pristine(pristine, cache):
    cache.mkdir(parents=True, exist_ok=True)
    for f in pristine[0].iterdir():
        shutil.copy2(f, cache / f.name)
    return pristine[1]


def test_second_load_maps_and_is_identical(default_model_dir, pristine, cache, monkeypatch):
    use_pristine(pristine, cache)
    ref = qspec.load(default_model_dir, draft=LIGHT, draft_lm_head="bf16", cache=False)
    assert ref.backend.load_info["target"] == "built"
    forbid_packing(monkeypatch)
    mapped = qspec.load(default_model_dir, draft=LIGHT, draft_lm_head="bf16")
    info = mapped.backend.load_info
    assert (info["target"], info["draft"], info["embed"]) == ("cache", "cache", "mapped")
    assert mapped.draft == ref.draft and files(cache) == files(pristine[0])

    ids = ref.encode_prompt(PROMPT)
    for draft in (False, True):
        assert np.array_equal(logits(mapped, ids, draft), logits(ref, ids, draft))
    plain = ref.generate(PROMPT, max_new_tokens=N, speculative=False).tokens
    assert mapped.generate(PROMPT, max_new_tokens=N, speculative=False).tokens == plain
    spec = mapped.generate(PROMPT, max_new_tokens=N)
    assert spec.tokens == plain == pristine[1] and spec.stats["drafted"] > 0
    # a draft file written from the mapped draft is a regular `qspec quantize` file
    from qspec.draft import save_draft_file

    f = save_draft_file(cache.parent / "d.safetensors", default_model_dir, mapped.draft,
                        mapped.backend.draft_packed)
    from_file = qspec.load(default_model_dir, draft_file=f)
    assert (from_file.backend.load_info["target"], from_file.backend.load_info["draft"]) == ("cache", "file")
    assert np.array_equal(logits(from_file, ids, True), logits(ref, ids, True))


def test_other_draft_format_has_its_own_file(default_model_dir, pristine, cache):
    use_pristine(pristine, cache)
    e = qspec.load(default_model_dir, draft="mxfp6_e2m3", draft_lm_head="bf16")
    assert (e.backend.load_info["target"], e.backend.load_info["draft"]) == ("cache", "built+cached")
    assert e.generate(PROMPT, max_new_tokens=N).tokens == pristine[1]  # lossless: any draft
    e = qspec.load(default_model_dir, draft=LIGHT, draft_lm_head="bf16")
    assert e.backend.load_info["draft"] == "cache" and len(files(cache)) == 3


def test_draft_of_another_cast_is_rebuilt(default_model_dir, pristine, cache, monkeypatch):
    """A cached draft records its cast (qspec.draft.DRAFT_CAST): when the drafts' cast changes it
    is cast again (the target stays mapped); a `qspec quantize` file of another cast still loads."""
    use_pristine(pristine, cache)
    assert read_packed_file(next(cache.glob(f"*draft-{LIGHT}-*")))[0]["cast"] == DRAFT_CAST
    for cast in ("ocp", DRAFT_CAST):  # "ocp": the cast before the mse rule
        monkeypatch.setattr("qspec.draft.DRAFT_CAST", cast)
        monkeypatch.setattr("qspec.weight_cache.DRAFT_CAST", cast)
        e = qspec.load(default_model_dir, draft=LIGHT, draft_lm_head="bf16")
        assert (e.backend.load_info["target"], e.backend.load_info["draft"]) == ("cache", "built+cached")
        assert read_packed_file(next(cache.glob(f"*draft-{LIGHT}-*")))[0]["cast"] == cast
        if cast == "ocp":
            from qspec.draft import save_draft_file

            f = save_draft_file(cache.parent / "d.safetensors", default_model_dir, e.draft, e.backend.draft_packed)
    assert e.generate(PROMPT, max_new_tokens=N).tokens == pristine[1]
    from_file = qspec.load(default_model_dir, draft_file=f)
    assert from_file.backend.load_info["draft"] == "file"
    assert from_file.generate(PROMPT, max_new_tokens=N).tokens == pristine[1]


def test_invalidation(model_copy, cache, monkeypatch):
    def load():
        return qspec.load(model_copy, draft=None).backend.load_info["target"]

    assert load() == "built+cached" and load() == "cache"
    # config.json changed (a key qspec does not read: same model, other bytes)
    cfg = json.loads((model_copy / "config.json").read_text())
    (model_copy / "config.json").write_text(json.dumps({**cfg, "qspec_test": 1}))
    assert load() == "built+cached" and load() == "cache"
    # a checkpoint file touched (same size, other mtime)
    st = (model_copy / "model.safetensors").stat()
    os.utime(model_copy / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert load() == "built+cached"
    # another packed layout version, another cache version
    layout = _C.PACK_LAYOUT_VERSION
    monkeypatch.setattr(_C, "PACK_LAYOUT_VERSION", layout + 100)
    assert load() == "built+cached"
    monkeypatch.setattr(_C, "PACK_LAYOUT_VERSION", layout)
    monkeypatch.setattr("qspec.weight_cache.CACHE_VERSION", 99)
    assert load() == "built+cached"
    eng = qspec.load(model_copy, draft=None)
    assert eng.backend.load_info["target"] == "cache" and len(files(cache)) == 1 and no_temp_files(cache)
    want = eng.generate(PROMPT, max_new_tokens=N, speculative=False).tokens
    assert qspec.load(model_copy, draft=None, cache=False).generate(
        PROMPT, max_new_tokens=N, speculative=False).tokens == want


def test_files_outside_the_checkpoint_do_not_invalidate(default_model_dir, model_copy, pristine, cache):
    """A `qspec quantize` file saved in the model directory (its default place) is not part of
    the checkpoint: the cache stays valid and the draft file loads."""
    assert qspec.load(model_copy, draft=None).backend.load_info["target"] == "built+cached"
    from qspec.draft import load_draft_file, save_draft_file

    spec, packed = load_draft_file(next(pristine[0].glob("*.draft-*")), default_model_dir)
    f = save_draft_file(model_copy / f"draft-{LIGHT}.qspec.safetensors", model_copy, spec, packed)
    e = qspec.load(model_copy, draft_file=f)
    assert (e.backend.load_info["target"], e.backend.load_info["draft"]) == ("cache", "file")
    assert e.generate(PROMPT, max_new_tokens=N).tokens == pristine[1]


@pytest.mark.parametrize("damage,which", [("truncate", "target"), ("empty", "draft"), ("header", "target"),
                                          ("metadata", "draft"), ("buffer_size", "target")])
def test_damaged_cache_file_is_rebuilt(default_model_dir, pristine, cache, damage, which):
    want = use_pristine(pristine, cache)
    f = next(p for p in cache.iterdir() if (".target." if which == "target" else ".draft-") in p.name)
    data = bytearray(f.read_bytes())
    (n,) = np.frombuffer(bytes(data[:8]), "<u8")
    header = json.loads(data[8:8 + n])
    if damage == "truncate":
        data = data[: len(data) - 4096]
    elif damage == "empty":
        data = b""
    elif damage == "header":
        data[8:16] = b"\x00garbage"
    else:
        if damage == "metadata":
            header["__metadata__"]["matrices"] = "{not json"
        else:  # sizes no longer those of the layout (same file length)
            m = json.loads(header["__metadata__"]["matrices"])
            m["layers.0.wo"][1] += 16
            header["__metadata__"]["matrices"] = json.dumps(m)
        raw = json.dumps(header).encode()
        data[8:8 + n] = raw + b" " * (n - len(raw))
    f.write_bytes(bytes(data))
    eng = qspec.load(default_model_dir, draft=LIGHT, draft_lm_head="bf16")
    other = "draft" if which == "target" else "target"
    assert (eng.backend.load_info[which], eng.backend.load_info[other]) == ("built+cached", "cache")
    assert eng.generate(PROMPT, max_new_tokens=N).tokens == want
    assert qspec.load(default_model_dir, draft=LIGHT, draft_lm_head="bf16").backend.load_info[which] == "cache"
    assert no_temp_files(cache)


def test_unwritable_cache_degrades_with_one_warning(default_model_dir, tmp_path, monkeypatch, capfd):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")  # QSPEC_CACHE is a file: $QSPEC_CACHE/packed cannot be created (even as root)
    monkeypatch.setenv("QSPEC_CACHE", str(blocker))
    eng = qspec.load(default_model_dir, draft=LIGHT, draft_lm_head="bf16")
    assert (eng.backend.load_info["target"], eng.backend.load_info["draft"]) == ("built", "built")
    warnings = [l for l in capfd.readouterr().err.splitlines() if "warning" in l]
    assert len(warnings) == 1 and "weight cache" in warnings[0], warnings
    assert eng.generate(PROMPT, max_new_tokens=N).stats["drafted"] > 0


def test_write_failure_leaves_no_temp_file(default_model_dir, cache, monkeypatch, capfd):
    """The disk fills up in the middle of the write: no temp file left, the load packs in memory."""
    import qspec.native

    real, calls = qspec.native.pack_target, []

    def fills_the_disk(weights, shard):
        calls.append(1)
        for i, item in enumerate(real(weights, shard)):
            if len(calls) == 1 and i == 3:
                raise OSError(28, "No space left on device")
            yield item

    monkeypatch.setattr(qspec.native, "pack_target", fills_the_disk)
    eng = qspec.load(default_model_dir, draft=None)
    assert eng.backend.load_info["target"] == "built"
    assert "No space left" in capfd.readouterr().err
    assert files(cache) == []
    assert eng.generate(PROMPT, max_new_tokens=4).tokens


def test_disabled(default_model_dir, cache, monkeypatch):
    assert qspec.load(default_model_dir, draft=None, cache=False).backend.load_info["target"] == "built"
    monkeypatch.setenv("QSPEC_NO_WEIGHT_CACHE", "1")
    assert qspec.load(default_model_dir, draft=None).backend.load_info["target"] == "built"
    assert not cache.exists()


def _small_packed(seed):
    g = np.random.default_rng(seed)
    return {f"m{i}": _C.pack_bf16(g.integers(0, 2**16, (40, 70), dtype=np.uint16)) for i in range(3)}


def test_concurrent_writers_and_atomic_replace(tmp_path):
    """Writers of one file each write their own temp file; the result is one complete version."""
    path = tmp_path / "x.qspec.safetensors"
    versions = [_small_packed(s) for s in range(4)]
    meta = {"qspec_draft_version": "1", "pack_layout_version": str(_C.PACK_LAYOUT_VERSION), "kind": "target"}

    def slow(packed):
        for name, pw in packed.items():
            time.sleep(0.01)
            yield name, pw

    threads = [threading.Thread(target=write_packed_file, args=(path, meta, list(v), slow(v))) for v in versions]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _, got = read_packed_file(path)
    got_bytes = {n: {b: bytes(a) for b, a in pw.buffers().items()} for n, pw in got.items()}
    assert any(got_bytes == {n: {b: bytes(a) for b, a in pw.buffers().items()} for n, pw in v.items()}
               for v in versions)
    assert files(tmp_path) == [path.name]


def test_prune_removes_orphans_and_stale_temp_files(default_model_dir, model_copy, cache):
    qspec.load(model_copy, draft=None)
    stale = cache / f".x{SUFFIX}.abc.tmp"
    stale.write_bytes(b"partial")
    os.utime(stale, (time.time() - 7200,) * 2)
    fresh = cache / f".y{SUFFIX}.abc.tmp"  # maybe being written right now: kept
    fresh.write_bytes(b"partial")
    shutil.rmtree(model_copy)
    qspec.load(default_model_dir, draft=None)  # a write prunes
    left = files(cache)
    assert fresh.name in left and stale.name not in left
    assert [n for n in left if n.endswith(SUFFIX)] == [n for n in left if n.startswith("SmolLM2")]
