"""A helper-model draft level: another model with the target's vocabulary, with a KV cache of its own.

Its K/V differ from the target's, so it cannot share the target's cache: it keeps its own, and a
record of the token id each of its rows holds. Before each pass it catches up on the tokens the
levels below accepted since (and re-runs from the first row whose token differs, e.g. after its
own rejected drafts), in the same pass when the gap is small. Loaded in BF16, or cast to an MX
format (`PATH:FORMAT`; the helper's own BF16 weights are then mapped from the weight cache but
not read). Draft tokens pass between levels as token ids, so the two tokenizers must agree
exactly: a helper with another vocabulary is refused, with the first difference named.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from .config import ModelConfig
from .draft import DRAFT_FORMATS, DraftSpec
from .errors import ModelLoadError
from .tokenizer import Tokenizer

CATCH_UP_IN_PASS = 8  # rows to catch up on within the drafting pass (their logits are not needed)


def split_helper(name: str) -> tuple[str, str | None]:
    """"PATH" or "PATH:FORMAT" (an MX cast of the helper) -> (model, format or None)."""
    model, sep, fmt = name.rpartition(":")
    return (model, fmt) if sep and fmt in DRAFT_FORMATS else (name, None)


def check_helper(name: str, cfg: ModelConfig, tok: Tokenizer) -> tuple[Path, ModelConfig]:
    """The helper's folder and config, once its vocabulary is known to be the target's (ModelLoadError
    naming the first difference otherwise). Reads configs and tokenizers only: no weights."""
    from .fetch import resolve_model

    model, _ = split_helper(name)
    helper_dir = resolve_model(model)
    hcfg = ModelConfig.from_file(helper_dir / "config.json")
    if hcfg.vocab_size != cfg.vocab_size:
        raise ModelLoadError(f"helper model {model}: vocabulary of {hcfg.vocab_size} tokens, the target's has "
                             f"{cfg.vocab_size} (a helper must share the target's tokenizer)")
    mine, theirs = tok.vocab(), Tokenizer(helper_dir).vocab()
    if mine != theirs:
        diff = sorted(set(mine.items()) ^ set(theirs.items()))[0][0]
        raise ModelLoadError(f"helper model {model}: its tokenizer differs from the target's (token {diff!r} "
                             f"is id {theirs.get(diff)} there, {mine.get(diff)} in the target)")
    return helper_dir, hcfg


def load_helper(name: str, helper_dir: Path, hcfg: ModelConfig, cache: bool | None) -> "HelperLevel":
    from .loader import load_weights
    from .native import native_backend

    _, fmt = split_helper(name)
    spec = DraftSpec(fmt, fmt) if fmt else None
    be = native_backend(helper_dir, hcfg, load_weights(helper_dir, hcfg), spec, cache=cache)
    return HelperLevel(name, be, 1 if spec else 0)


class HelperLevel:
    """A draft level running another model (weight set 0, or 1 for its MX cast) over its own cache."""

    def __init__(self, name: str, backend, weight_set: int):
        self.name, self.backend, self.weight_set = name, backend, weight_set
        self.bytes = backend.set_bytes[weight_set]
        self.rows: list[int] = []  # the token id of each row of its cache, position by position

    def score(self, tokens: Sequence[int], pos: int, context: Sequence[int]) -> np.ndarray:
        """Logits of `tokens` run at positions pos.. after `context[:pos]`, which its cache is
        brought up to first."""
        kv = self.backend.kv
        have = np.asarray(self.rows[:pos], dtype=np.int64)
        differ = np.flatnonzero(have != np.asarray(context[:len(have)], dtype=np.int64))
        start = int(differ[0]) if differ.size else len(have)  # rows [0, start) are valid
        needed = pos + len(tokens)
        if needed > kv.capacity:
            kv.length = start  # what ensure_capacity keeps
            kv.ensure_capacity(max(needed, 2 * kv.capacity, 256))
        run = list(tokens)
        if pos - start > CATCH_UP_IN_PASS:  # a long gap (the prompt): one pass, last row only
            self.backend.forward(list(context[start:pos]), start, draft=self.weight_set)
        elif pos > start:
            run = list(context[start:pos]) + run
        logits = self.backend.forward(run, needed - len(run), all_logits=True, draft=self.weight_set)
        self.rows = list(context[:pos]) + list(tokens)
        return logits[-len(tokens):]
