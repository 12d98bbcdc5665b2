"""Exceptions a user can cause. The CLI prints their message as one line and exits non-zero."""


class QspecError(Exception):
    """Base class of every error qspec raises for bad input (never for its own bugs)."""


class ModelLoadError(QspecError):
    """A model path, file or config that cannot be loaded: missing, corrupt, unsupported."""


class DraftFileError(ModelLoadError, ValueError):
    """A `qspec quantize` draft file that is corrupt, of another model or of another layout version."""


class PromptTooLongError(QspecError, ValueError):
    """The prompt plus the requested new tokens do not fit in the model's context."""


class ContextSizeError(QspecError, ValueError):
    """A context size (ctx_size, --ctx-size) that is not an integer in 1..the model's context."""


class ContextMemoryError(QspecError, MemoryError):
    """The KV cache of the requested context does not fit in the available memory (raised before
    it is allocated, naming the bytes needed and available)."""


class FetchError(ModelLoadError):
    """`qspec fetch` (or a known model fetched on first use): an unknown model name, a failed
    download, wheels of the wrong size or checksum, or a write error (a full disk) while fetching
    or converting. A ModelLoadError: a model that cannot be fetched cannot be loaded."""


class TensorParallelError(QspecError):
    """Tensor parallelism (qspec/parallel): a model that cannot be split over the world size, ranks
    that disagree on the model or version, a rank that cannot reach the rendezvous, or a rank that
    stopped answering mid-generation."""
