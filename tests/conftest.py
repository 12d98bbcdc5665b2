"""Shared fixtures, and a test session that leaves the user's qspec cache alone.

- QSPEC_CACHE: when the environment does not set it, the session uses a temporary cache of its
  own (removed at the end), so the default model is converted once per session and nothing is
  written under ~/.cache/qspec. CI sets QSPEC_CACHE itself (a cache kept between its steps).
- The user's cache (~/.cache/qspec, unless the environment's QSPEC_CACHE is that very folder) is
  snapshot (every file's size and mtime) when the session starts and compared when it ends: any
  file added, removed or changed there fails the run, naming the files.
- QSPEC_OFFLINE: set to 1 unless the environment sets it, so a test that names a known model
  which is not fetched never downloads it on first use (tests that check fetching unset it).
"""

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from cache_guard import changes, snapshot, user_cache

_TEMP_CACHE = None
_GUARDED = None  # (folder, snapshot at the start)


def pytest_configure(config):
    global _TEMP_CACHE, _GUARDED
    if not os.environ.get("QSPEC_CACHE"):
        _TEMP_CACHE = tempfile.mkdtemp(prefix="qspec-test-cache-")
        os.environ["QSPEC_CACHE"] = _TEMP_CACHE
    os.environ.setdefault("QSPEC_OFFLINE", "1")
    guarded = user_cache()
    if guarded.resolve() != Path(os.environ["QSPEC_CACHE"]).expanduser().resolve():
        _GUARDED = (guarded, snapshot(guarded))


def pytest_sessionfinish(session, exitstatus):
    if _GUARDED is not None:
        folder, before = _GUARDED
        changed = changes(before, snapshot(folder))
        if changed:
            reporter = session.config.pluginmanager.get_plugin("terminalreporter")
            msg = (f"the test session changed the user's qspec cache {folder}: "
                   + ", ".join(changed[:10]) + (f" (+{len(changed) - 10} more)" if len(changed) > 10 else ""))
            if reporter is not None:
                reporter.write_line(f"ERROR: {msg}", red=True)
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_unconfigure(config):  # called after every configure, even when no session ran
    if _TEMP_CACHE is not None:
        shutil.rmtree(_TEMP_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def default_model_dir():
    """Converted HF directory of the default model (SmolLM2-135M-Instruct), in the session's
    QSPEC_CACHE (converted once per session, or kept by CI between runs)."""
    from qspec.default_model import default_model_dir as locate

    return locate(progress=False)
