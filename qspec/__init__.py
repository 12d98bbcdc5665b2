"""qspec: lossless self-speculative LLM decoding on x86 CPUs with MX drafts of the model's own weights."""

import os as _os

if _os.environ.get("QSPEC_BENCH_SO"):  # A/B runs of two builds (bench/common.py): this file as qspec._C
    import importlib.util as _util
    import sys as _sys

    _spec = _util.spec_from_file_location(__name__ + "._C", _os.environ["QSPEC_BENCH_SO"])
    if _spec is None:
        raise ImportError(f"QSPEC_BENCH_SO={_os.environ['QSPEC_BENCH_SO']!r} is not an extension module")
    _C = _util.module_from_spec(_spec)
    _spec.loader.exec_module(_C)
    _sys.modules[__name__ + "._C"] = _C
try:
    from ._C import cpu_info
except ImportError as e:  # the source tree shadows a regular (non-editable) install
    raise ImportError(f"qspec's compiled module _C is not next to {__file__}: this is the source tree "
                      "without a build. Run from another directory, or install with "
                      "'pip install --no-build-isolation -e .'") from e
from .engine import Engine
from .loading import load
from .result import GenerationResult, TokenLogprob
from .errors import ContextMemoryError, ContextSizeError, DraftFileError, FetchError, ModelLoadError, PromptTooLongError, QspecError, TensorParallelError

__all__ = ["load", "Engine", "GenerationResult", "TokenLogprob", "cpu_info", "QspecError", "ModelLoadError", "TensorParallelError",
           "DraftFileError", "PromptTooLongError", "FetchError", "ContextSizeError",
           "ContextMemoryError"]
__version__ = "0.1.0"
