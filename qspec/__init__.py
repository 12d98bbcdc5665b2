"""qspec: lossless self-speculative LLM decoding on x86 CPUs with MX drafts of the model's own weights."""

from ._C import cpu_info
from .engine import Engine, GenerationResult, load
from .errors import DraftFileError, ModelLoadError, PromptTooLongError, QspecError

__all__ = ["load", "Engine", "GenerationResult", "cpu_info", "QspecError", "ModelLoadError",
           "DraftFileError", "PromptTooLongError"]
__version__ = "0.1.0"
