"""What a generation returns: the result, per-token log-probabilities, and the checks of the
arguments that shape them (stop strings, the number of alternatives)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]                       # new token ids (prompt excluded)
    stats: dict[str, float] = field(default_factory=dict)
    finish_reason: str = "length"           # "stop": an end-of-sequence token or a stop string
    logprobs: list[TokenLogprob] | None = None  # per new token, with generate(logprobs=k)


MAX_STOPS = 16
MAX_TOP_LOGPROBS = 20


@dataclass
class TokenLogprob:
    """The target's log-probability of a token at its position, and the `top` most likely tokens
    there (id, log-probability), most likely first."""
    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def check_top_logprobs(top) -> int:
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"logprobs must be an integer in 0..{MAX_TOP_LOGPROBS}, got {top!r}")
    return top


def token_logprobs(rows: np.ndarray, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """log-softmax of each logits row (in float64) at its token, and its `top` best tokens."""
    x = rows.astype(np.float64)
    mx = x.max(axis=1, keepdims=True)
    lse = mx + np.log(np.exp(x - mx).sum(axis=1, keepdims=True))
    out = []
    for r, t in enumerate(tokens):
        best = []
        if top:
            idx = np.argpartition(-x[r], top - 1)[:top]
            idx = idx[np.lexsort((idx, -x[r, idx]))]  # by logit, ties by id
            best = [(int(i), float(x[r, i] - lse[r, 0])) for i in idx]
        out.append(TokenLogprob(int(t), float(x[r, t] - lse[r, 0]), best))
    return out


def check_stops(stop: str | Sequence[str] | None) -> list[str]:
    """`stop` as a list of non-empty strings (a string is one stop; None or [] none)."""
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(x, str) and x for x in stops):
        raise ValueError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    if len(stops) > MAX_STOPS:
        raise ValueError(f"stop takes at most {MAX_STOPS} strings, got {len(stops)}")
    return list(stops)
