"""The user's qspec cache must come out of a test session unchanged (tests/conftest.py).

A snapshot is every file under a folder with its size and mtime (ns); comparing two names what
was added, removed or changed. The folder need not exist (an empty snapshot).
"""

from __future__ import annotations

import os
from pathlib import Path


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    files = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            try:
                st = os.lstat(path)
            except OSError:  # removed while walking
                continue
            files[os.path.relpath(path, root)] = (st.st_size, st.st_mtime_ns)
    return files


def changes(before: dict, after: dict) -> list[str]:
    """'added X', 'removed X', 'changed X' for every file that differs, sorted by path."""
    out = []
    for path in sorted(before.keys() | after.keys()):
        if path not in before:
            out.append(f"added {path}")
        elif path not in after:
            out.append(f"removed {path}")
        elif before[path] != after[path]:
            out.append(f"changed {path}")
    return out


def user_cache() -> Path:
    """The cache a user's qspec writes by default: ~/.cache/qspec."""
    return Path.home() / ".cache" / "qspec"
