"""`qspec cache`: what $QSPEC_CACHE holds, and removing some or all of it.

Entries (qspec.default_model.cache_root()):
- model: a converted model folder (a fetched known model, the default model); last use = the
  folder's mtime, which resolve_model (qspec/fetch.py) sets each time the model is loaded by name.
- packed: a packed-weight file of `$QSPEC_CACHE/packed` (qspec/weight_cache.py), named after its
  model folder; last use = its mtime, set on each load that maps it.
- peer: a GGUF that `qspec bench peer` keeps in `$QSPEC_CACHE/peer` (named after its source
  GGUF: a known model's starts with its name); last use = its mtime.
Names starting with "." (locks, temporary folders of a fetch or conversion under way) are neither
listed nor removed. A model folder is renamed aside before it is deleted, so no reader ever sees
half of one; a process that has a removed file memory-mapped keeps reading it.
"""

from __future__ import annotations

import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from .errors import QspecError

DAY = 86400.0
_PACKED_NAME = re.compile(r"^(.*)-[0-9a-f]{16}\.(.+)$")


@dataclass(frozen=True)
class Entry:
    name: str      # model folder name (a packed file: the folder it was packed from)
    kind: str      # "model", "packed <kind>", "peer"
    size: int      # bytes
    last_use: float  # seconds since the epoch
    path: Path


def _tree_size(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                continue
    return total


def entries(root: Path | None = None) -> list[Entry]:
    """Everything the cache holds, by kind then name."""
    from .default_model import cache_root
    from .weight_cache import SUFFIX, packed_files

    root = cache_root() if root is None else root
    found: list[Entry] = []
    if not root.is_dir():
        return found
    for p in root.iterdir():
        if p.name.startswith(".") or not p.is_dir() or not (p / "config.json").is_file():
            continue
        found.append(Entry(p.name, "model", _tree_size(p), p.stat().st_mtime, p))
    for f in packed_files(root / "packed"):
        m = _PACKED_NAME.match(f.name[: -len(SUFFIX)])  # <model folder>-<hash of its path>.<kind>
        name, kind = (m.group(1), m.group(2)) if m else (f.name, "?")
        found.append(Entry(name, f"packed {kind}", f.stat().st_size, f.stat().st_mtime, f))
    peer = root / "peer"
    for f in sorted(peer.iterdir()) if peer.is_dir() else ():
        if f.is_file() and not f.name.startswith("."):
            found.append(Entry(f.name, "peer", f.stat().st_size, f.stat().st_mtime, f))
    order = {"model": 0, "packed": 1, "peer": 2}
    return sorted(found, key=lambda e: (order[e.kind.split()[0]], e.name.lower(), e.kind))


def folder_name(name: str) -> str:
    """The cache folder of a known model name (smollm2-135m -> SmolLM2-135M-Instruct), else `name`."""
    from .fetch import MODELS, model_dir

    return model_dir(name).name if name.lower() in MODELS else name


def select(found: list[Entry], name: str | None = None, older_than_days: float | None = None,
           now: float | None = None) -> list[Entry]:
    """The entries of model `name` (a known name or a folder name; case-insensitive; its packed
    files too) not used for `older_than_days` days."""
    if older_than_days is not None and not older_than_days >= 0:
        raise QspecError(f"--older-than must be a number of days >= 0, got {older_than_days}")
    now = time.time() if now is None else now
    want = folder_name(name).lower() if name else None

    def named(e: Entry) -> bool:  # a peer file is named <GGUF stem>.<size>.<kind>.gguf
        return e.name.lower() == want or e.kind == "peer" and e.name.lower().startswith(name.lower() + ".")

    return [e for e in found
            if (want is None or named(e))
            and (older_than_days is None or now - e.last_use > older_than_days * DAY)]


def remove(entry: Entry) -> None:
    """Delete one entry (a model folder: renamed aside first, so it disappears at once)."""
    try:
        if entry.kind == "model":
            aside = entry.path.with_name(f".{entry.path.name}.old-{uuid.uuid4().hex[:8]}")
            os.rename(entry.path, aside)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            entry.path.unlink()
    except FileNotFoundError:  # removed by someone else meanwhile
        pass
    except OSError as e:
        raise QspecError(f"cannot remove {entry.path}: {e.strerror or e}") from None
