"""The cache stays clean: the test session's guard on the user's cache (tests/conftest.py),
`qspec cache` (list, --clear, --older-than) and the packed-weight cache's LRU size cap."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import qspec
from qspec.cache import entries, select
from qspec.cli import main
from qspec.weight_cache import SUFFIX, evict, max_bytes

HERE = Path(__file__).parent
DAY = 86400


def one_error_line(err: str) -> str:
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("qspec: error: "), lines[0]
    return lines[0]


# ---------------------------------------------------------------------------------------------
# The session guard


def test_snapshot_sees_added_changed_and_removed_files(tmp_path):
    from cache_guard import changes, snapshot

    (tmp_path / "a").write_text("1")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b").write_text("2")
    before = snapshot(tmp_path)
    assert changes(before, snapshot(tmp_path)) == []
    (tmp_path / "a").write_text("11")          # size
    os.utime(tmp_path / "sub" / "b", ns=(0, 5))  # mtime only
    (tmp_path / "c").write_text("")
    assert changes(before, snapshot(tmp_path)) == ["changed a", "added c", "changed sub/b"]
    (tmp_path / "c").unlink()
    (tmp_path / "a").unlink()
    assert changes(before, snapshot(tmp_path)) == ["removed a", "changed sub/b"]
    assert snapshot(tmp_path / "missing") == {}


@pytest.mark.parametrize("where,fails", [("home", True), ("session", False)])
def test_a_session_that_writes_the_users_cache_fails(tmp_path, where, fails):
    """A pytest session with this conftest, a fake HOME and no QSPEC_CACHE: writing under
    ~/.cache/qspec fails the run (naming the file); writing under QSPEC_CACHE (the session's
    temporary cache, removed afterwards) does not."""
    for name in ("conftest.py", "cache_guard.py"):
        shutil.copy(HERE / name, tmp_path / name)
    target = ('Path.home() / ".cache" / "qspec" / "intruder"' if where == "home"
              else 'Path(os.environ["QSPEC_CACHE"]) / "fine"')
    (tmp_path / "test_writer.py").write_text(
        "import os\nfrom pathlib import Path\n\n\ndef test_write():\n"
        f"    p = {target}\n    p.parent.mkdir(parents=True, exist_ok=True)\n    p.write_text('x')\n"
        "    print('CACHE', os.environ['QSPEC_CACHE'])\n")
    home = tmp_path / "home"
    (home / ".cache" / "qspec").mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k != "QSPEC_CACHE"}
    env["HOME"] = str(home)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "test_writer.py"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    session_cache = next(l.split()[1] for l in r.stdout.splitlines() if l.startswith("CACHE "))
    assert Path(session_cache) != home / ".cache" / "qspec" and not Path(session_cache).exists()
    if fails:
        assert r.returncode == 1 and "changed the user's qspec cache" in r.stdout and "added intruder" in r.stdout
    else:
        assert r.returncode == 0, r.stdout + r.stderr


# ---------------------------------------------------------------------------------------------
# qspec cache


def _file(path: Path, size: int, age_days: float = 0.0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\0" * size)
    t = time.time() - age_days * DAY
    os.utime(path, (t, t))
    return path


@pytest.fixture
def filled(tmp_path, monkeypatch):
    """A cache with two model folders, their packed files, a peer GGUF, a lock and a temp folder."""
    root = tmp_path / "cache"
    monkeypatch.setenv("QSPEC_CACHE", str(root))
    for name, age in (("qwen2.5-coder-0.5b", 40), ("SmolLM2-135M-Instruct", 1)):
        _file(root / name / "model.safetensors", 3000, age)
        _file(root / name / "config.json", 10, age)
        t = time.time() - age * DAY
        os.utime(root / name, (t, t))
    _file(root / "packed" / f"qwen2.5-coder-0.5b-0123456789abcdef.target{SUFFIX}", 2000, 40)
    _file(root / "packed" / f"SmolLM2-135M-Instruct-fedcba9876543210.draft-mxfp4-mxfp4{SUFFIX}", 500, 2)
    _file(root / "peer" / "qwen2.5-coder-0.5b.sha256-ab.gguf.491400064.q8_0.gguf", 700, 50)
    _file(root / ".qwen2.5-coder-0.5b.lock", 0)
    (root / ".gemma3-270m.fetch-abc").mkdir()
    return root


def test_cache_lists_models_packed_files_and_peer_files(filled, capsys):
    assert main(["cache"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"cache {filled} (QSPEC_CACHE); packed weights capped at 16.00 GiB")
    rows = [l.split() for l in out[2:-1]]
    assert [(r[0], r[1]) for r in rows] == [
        ("qwen2.5-coder-0.5b", "model"), ("SmolLM2-135M-Instruct", "model"),
        ("qwen2.5-coder-0.5b", "packed"), ("SmolLM2-135M-Instruct", "packed"),
        ("qwen2.5-coder-0.5b.sha256-ab.gguf.491400064.q8_0.gguf", "peer")]
    assert rows[2][2] == "target" and rows[3][2] == "draft-mxfp4-mxfp4"
    assert out[-1].split()[0] == "total"
    by_kind = {(e.name, e.kind): e for e in entries(filled)}
    assert by_kind[("qwen2.5-coder-0.5b", "model")].size == 3010
    assert abs(by_kind[("qwen2.5-coder-0.5b", "model")].last_use - (time.time() - 40 * DAY)) < 60


def test_cache_older_than_lists_then_clears_only_old_entries(filled, capsys):
    assert main(["cache", "--older-than", "30"]) == 0
    names = {l.split()[0] for l in capsys.readouterr().out.splitlines()[2:-1]}
    assert names == {"qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b.sha256-ab.gguf.491400064.q8_0.gguf"}
    assert (filled / "qwen2.5-coder-0.5b").exists()  # listing removes nothing
    assert main(["cache", "--clear", "--older-than", "30"]) == 0
    assert "removed 3 entries" in capsys.readouterr().err
    assert sorted(p.name for p in filled.iterdir()) == [".gemma3-270m.fetch-abc", ".qwen2.5-coder-0.5b.lock",
                                                         "SmolLM2-135M-Instruct", "packed", "peer"]
    assert [p.name for p in (filled / "packed").iterdir()] == [
        f"SmolLM2-135M-Instruct-fedcba9876543210.draft-mxfp4-mxfp4{SUFFIX}"]


def test_cache_clear_by_known_name(filled, capsys):
    """smollm2-135m is the default model: its folder is SmolLM2-135M-Instruct."""
    assert main(["cache", "--clear", "smollm2-135m"]) == 0
    assert not (filled / "SmolLM2-135M-Instruct").exists()
    assert [e.name for e in entries(filled) if e.name.startswith("SmolLM2")] == []
    assert {e.name for e in entries(filled)} == {"qwen2.5-coder-0.5b",
                                                 "qwen2.5-coder-0.5b.sha256-ab.gguf.491400064.q8_0.gguf"}
    assert main(["cache", "--clear"]) == 0
    assert entries(filled) == [] and (filled / ".qwen2.5-coder-0.5b.lock").exists()
    assert main(["cache"]) == 0 and "(nothing cached)" in capsys.readouterr().out


def test_cache_bad_arguments(filled, capsys):
    assert main(["cache", "--older-than", "-1"]) == 1
    assert "--older-than must be a number of days >= 0" in one_error_line(capsys.readouterr().err)
    assert select(entries(filled), "no-such-model") == []


# ---------------------------------------------------------------------------------------------
# The packed-weight cache's cap


def test_evict_removes_least_recently_used_first(tmp_path):
    d = tmp_path / "packed"
    old = _file(d / f"a-1.target{SUFFIX}", 400, 3)
    mid = _file(d / f"b-2.target{SUFFIX}", 400, 2)
    new = _file(d / f"c-3.target{SUFFIX}", 400, 1)
    mine = _file(d / f"m-4.target{SUFFIX}", 400, 9)  # the checkpoint being loaded: oldest, but kept
    tmp = _file(d / f".x-5.target{SUFFIX}.abc.tmp", 4000, 9)  # a writer's temp file: not ours to judge
    assert evict(d, 900, keep="m-4.") == [old, mid]
    assert sorted(p.name for p in d.iterdir()) == sorted([new.name, mine.name, tmp.name])
    assert evict(d, 10, keep="m-4.") == [new]  # the kept files alone may exceed the cap
    assert evict(d, 10) == [mine]


def test_cap_setting(monkeypatch):
    monkeypatch.delenv("QSPEC_CACHE_MAX_GB", raising=False)
    assert max_bytes() == 16 * 2**30
    monkeypatch.setenv("QSPEC_CACHE_MAX_GB", "0.5")
    assert max_bytes() == 2**29
    for bad in ("0", "-1", "lots", "nan"):
        monkeypatch.setenv("QSPEC_CACHE_MAX_GB", bad)
        with pytest.raises(ValueError, match="QSPEC_CACHE_MAX_GB must be a number of GiB > 0"):
            max_bytes()


def test_loads_record_last_use_and_evict_other_models(default_model_dir, tmp_path, monkeypatch, capsys):
    root = tmp_path / "cache"
    packed = root / "packed"
    monkeypatch.setenv("QSPEC_CACHE", str(root))
    monkeypatch.delenv("QSPEC_NO_WEIGHT_CACHE", raising=False)
    model = shutil.copytree(default_model_dir, tmp_path / "model")
    monkeypatch.setenv("QSPEC_CACHE_MAX_GB", "lots")
    assert main(["generate", "-m", str(model), "--draft", "none", "--no-chat", "-n", "1", "hi"]) == 1
    assert "QSPEC_CACHE_MAX_GB must be a number of GiB > 0, got 'lots'" in one_error_line(capsys.readouterr().err)
    assert not packed.exists()  # failed before packing anything

    other = tmp_path / "other-model"
    other.mkdir()  # an existing model dir: its files are not pruned as orphans
    stale = _file(packed / f"other-model-0123456789abcdef.target{SUFFIX}", 1 << 20, 5)
    monkeypatch.setenv("QSPEC_CACHE_MAX_GB", str(1 / 1024))  # 1 MiB: below the default model's files
    qspec.load(model, draft="mxfp4", draft_lm_head="bf16")
    mine = sorted(p.name for p in packed.iterdir())
    assert not stale.exists() and len(mine) == 2 and all(n.startswith("model-") for n in mine)
    target = next(p for p in packed.iterdir() if ".target." in p.name)
    os.utime(target, (1, 1))
    qspec.load(model, draft="mxfp4", draft_lm_head="bf16")  # mapped: its last use is now
    assert time.time() - target.stat().st_mtime < 120
