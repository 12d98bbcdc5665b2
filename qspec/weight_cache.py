"""Packed-weight cache: a checkpoint's kernel-ready weights, packed once, memory-mapped afterwards.

Packing the BF16 weights for the kernels and casting the MX draft take most of a load (tens of
seconds for a 1.5B model); their result depends only on the checkpoint, the formats and the
packed layout (not on the CPU's ISA level: every GEMM path reads the same layout, csrc/gemm.h).
So the first load writes it to `$QSPEC_CACHE/packed/` (default ~/.cache/qspec/packed) and later
loads map it zero-copy, as a `qspec quantize` draft file is mapped.

Files: `<model dir name>-<sha256(resolved model dir)[:16]>.<kind>.qspec.safetensors`, kind
"target" (each layer's four BF16 matrices, norms and biases; the final norm and the LM head) or
"draft-<format>-<LM head format>" (a draft file, what `qspec quantize` writes: `--draft-file`
takes it), with ".tp<rank>of<world>" after the kind for a tensor-parallel rank's shard
(qspec/parallel/shard.py). All are packed files (qspec/draft.py).
A file is used only if its metadata matches this build and this checkpoint: cache version,
packed-file version, PACK_LAYOUT_VERSION, kind and formats, a draft's cast (DRAFT_CAST), and the checkpoint identity (model
path, each weight file's size and mtime, config.json SHA-256). Anything else (no file, another
version, a changed checkpoint, a corrupt or truncated file) rebuilds it under the same name.

Writes stream to a uniquely named temp file in the cache directory and are renamed into place
(concurrent writers each write their own; the last rename wins, every version is complete).
A cache directory that cannot be written (or lacks the space) degrades to packing in memory with
a one-line warning. Each write also removes cache files whose model directory no longer exists
and temp files abandoned for an hour. Disable with `qspec.load(..., cache=False)` or
QSPEC_NO_WEIGHT_CACHE=1; deleting the directory is always safe.

Size cap, least recently used out: every load that maps a cache file sets its mtime to now (the
last use, recorded by qspec itself: atime is unreliable under noatime/relatime). After each write
the oldest files are deleted until the folder holds at most QSPEC_CACHE_MAX_GB GiB (default
DEFAULT_MAX_GB: over four times the packed files of the largest known model,
qwen2.5-coder-1.5b: target 2.88 GiB + MXFP4 draft 0.76 GiB); the checkpoint being loaded keeps its files
even when they alone exceed the cap. A process that has a deleted file mapped keeps reading it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from .draft import DRAFT_CAST, DraftSpec, _read_header, checkpoint_identity, packed_file_meta, read_packed_file, \
    write_packed_file
from .errors import DraftFileError

CACHE_VERSION = 2  # 2: the target file holds the norms and biases too
DISABLE_ENV = "QSPEC_NO_WEIGHT_CACHE"
SUFFIX = ".qspec.safetensors"
STALE_TEMP_S = 3600.0      # a temp file not written to for this long belongs to a dead writer
FREE_MARGIN = 1 << 30      # leave this much disk free after writing a cache file
MAX_ENV = "QSPEC_CACHE_MAX_GB"
DEFAULT_MAX_GB = 16.0


def max_bytes() -> int:
    """The cap on the packed cache's size: QSPEC_CACHE_MAX_GB GiB (a number > 0), or the default."""
    raw = os.environ.get(MAX_ENV, "").strip()
    try:
        gib = float(raw) if raw else DEFAULT_MAX_GB
    except ValueError:
        gib = -1.0
    if not gib > 0:
        raise ValueError(f"{MAX_ENV} must be a number of GiB > 0, got {raw!r}")
    return int(gib * 2**30)


def packed_files(directory: Path) -> list[Path]:
    """The finished cache files in `directory` (no temp files), oldest last use first."""
    found = []
    for f in directory.iterdir() if directory.is_dir() else ():
        if f.name.endswith(SUFFIX) and not f.name.startswith("."):
            try:
                found.append((f.stat().st_mtime, f.name, f))
            except OSError:  # removed meanwhile
                continue
    return [f for _, _, f in sorted(found)]


def evict(directory: Path, cap: int, keep: str = "") -> list[Path]:
    """Delete the least recently used cache files until the rest fit in `cap` bytes, sparing the
    files whose name starts with `keep` (the checkpoint being loaded). Returns what was deleted."""
    files = []
    for f in packed_files(directory):
        try:
            files.append((f, f.stat().st_size))
        except OSError:
            continue
    total = sum(size for _, size in files)
    removed = []
    for f, size in files:
        if total <= cap:
            break
        if keep and f.name.startswith(keep):
            continue
        try:
            f.unlink()
        except FileNotFoundError:
            pass
        except OSError:
            continue
        total -= size
        removed.append(f)
    return removed


def cache_enabled(cache: bool | None = None) -> bool:
    """`cache` when given, else on unless QSPEC_NO_WEIGHT_CACHE is set (to anything but 0/false/no)."""
    if cache is not None:
        return bool(cache)
    return os.environ.get(DISABLE_ENV, "").strip().lower() in ("", "0", "false", "no")


def cache_dir() -> Path:
    from .default_model import cache_root

    return cache_root() / "packed"


def draft_kind(spec: DraftSpec) -> str:
    return f"draft-{spec.fmt}-{spec.lm_head}"


def _file_kind(kind: str) -> str:
    """The packed-file kind: a draft cache file is a draft file (`--draft-file` takes it)."""
    return "target" if kind.split(".")[0] == "target" else "draft"


def warn(msg: str) -> None:
    print(f"qspec: warning: {msg}", file=sys.stderr)


class WeightCache:
    """The cache files of one checkpoint (its identity is taken once, when this is created)."""

    def __init__(self, model_dir: Path, directory: Path | None = None):
        self.dir = directory if directory is not None else cache_dir()
        self.identity = checkpoint_identity(model_dir)
        where = hashlib.sha256(self.identity["path"].encode()).hexdigest()[:16]
        name = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(self.identity["path"]).name)[:64] or "model"
        self.stem = f"{name}-{where}"
        self.disabled: str | None = None  # why the cache cannot be written (warned once)
        self.cap = max_bytes()  # a bad QSPEC_CACHE_MAX_GB fails the load before any packing

    def path(self, kind: str) -> Path:
        return self.dir / f"{self.stem}.{kind}{SUFFIX}"

    def load(self, kind: str, fmt: str, lm_head: str) -> dict | None:
        """{matrix: PackedWeight} mapped from the cache file, or None when it has no valid one."""
        try:
            meta, packed = read_packed_file(self.path(kind))
            source = json.loads(meta.get("source", "null"))
        except (DraftFileError, OSError, ValueError):  # missing, unreadable, corrupt, other layout
            return None
        file_kind = _file_kind(kind)
        if (meta.get("qspec_cache_version"), meta.get("kind"), meta.get("format"), meta.get("lm_head"),
                meta.get("cast"), source) != (str(CACHE_VERSION), file_kind, fmt, lm_head,
                                              DRAFT_CAST if file_kind == "draft" else None, self.identity):
            return None
        try:
            os.utime(self.path(kind))  # the last use, for the LRU cap
        except OSError:  # a read-only cache is still used
            pass
        return packed

    def store(self, kind: str, fmt: str, lm_head: str, names: Sequence[str],
              items: Iterable[tuple[str, object]], size_estimate: int) -> dict | None:
        """Stream `items` into the cache file of `kind` and map it; None (after one warning line
        per load) when it cannot be written: the caller then packs in memory."""
        if self.disabled is None:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                self._prune()
                free = shutil.disk_usage(self.dir).free
                if free < size_estimate + FREE_MARGIN:
                    self.disabled = (f"{free / 2**30:.1f} GiB free in {self.dir}, "
                                     f"~{(size_estimate + FREE_MARGIN) / 2**30:.1f} GiB wanted")
                else:
                    meta = packed_file_meta(_file_kind(kind), fmt, lm_head, self.identity,
                                            qspec_cache_version=str(CACHE_VERSION))
                    write_packed_file(self.path(kind), meta, names, items)
                    evict(self.dir, self.cap, keep=self.stem + ".")
                    return self.load(kind, fmt, lm_head)
            except OSError as e:
                self.disabled = f"{getattr(e, 'filename', None) or self.dir}: {e.strerror or e}"
            warn(f"weight cache not written ({self.disabled}); packing in memory, as with "
                 f"{DISABLE_ENV}=1")
        return None

    def _prune(self) -> None:
        """Remove cache files of model directories that are gone and abandoned temp files."""
        now = time.time()
        for f in self.dir.iterdir():
            try:
                if f.name.startswith(".") and f.name.endswith(".tmp") and SUFFIX in f.name:
                    if now - f.stat().st_mtime > STALE_TEMP_S:
                        f.unlink()
                elif f.name.endswith(SUFFIX):
                    header, _ = _read_header(f)
                    src = json.loads((header.get("__metadata__") or {}).get("source", "null"))
                    if isinstance(src, dict) and src.get("path") and not Path(src["path"]).exists():
                        f.unlink()
            except (OSError, DraftFileError, ValueError, AttributeError):
                continue
