"""Engines for the decode / end-to-end benchmarks: real models (--model) and synthetic shapes."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

import qspec
from qspec.draft import DraftSpec
from qspec.native import NativeBackend
from qspec.synthetic import synthetic_config, synthetic_weights



def load_engine(args, draft: DraftSpec | str | None, levels: tuple[str, ...] = (), draft_kv: str = "auto"):
    """`qspec.load` of --model with --threads (and draft levels above `draft`, its draft KV mode);
    a user error (unknown name, bad folder, bad chain) is one line."""
    try:
        return qspec.load(args.model, draft=draft, threads=args.threads, draft_levels=levels, draft_kv=draft_kv)
    except (qspec.QspecError, ValueError) as e:
        raise SystemExit(f"bench: error: {e}") from None


def default_draft_name(args) -> str:
    """"FORMAT:LM_HEAD" of the draft qspec.load(draft="auto") picks for --model."""
    from qspec.config import ModelConfig
    from qspec.loading import default_draft
    from qspec.fetch import resolve_model

    try:
        d = default_draft(ModelConfig.from_file(resolve_model(args.model) / "config.json"))
    except qspec.QspecError as e:
        raise SystemExit(f"bench: error: {e}") from None
    return f"{d.fmt}:{d.lm_head}"


def model_label(engine) -> str:
    """The model's name for tables and JSON: its directory name (a fetched model's name)."""
    return engine.model_dir.name


def parse_draft(s: str) -> DraftSpec:
    """'mxfp4' or 'mxfp4:mxfp4' (format:lm_head)."""
    fmt, _, head = s.partition(":")
    return DraftSpec(fmt, head or "bf16")


def parse_chain_setting(s: str) -> tuple[DraftSpec | str, tuple[str, ...]]:
    """A draft chain: 'FORMAT[:LM_HEAD]' or 'ngram' (level 1), then '+LEVEL' per level above it
    (an MX format or, at the top, ngram): 'mxfp6_e2m3:mxfp6_e2m3+mxfp4+ngram' -> (level 1, levels).
    ValueError for a bad one (checked as qspec.load checks it)."""
    from qspec.levels import NGRAM, check_formats, parse_chain

    first, *levels = s.split("+")
    draft = NGRAM if first == NGRAM else parse_draft(first)
    check_formats(parse_chain(draft if draft == NGRAM else draft.fmt, levels))
    return draft, tuple(levels)


def synthetic_backend(shape: str, draft: DraftSpec | None, max_seq: int = 1024) -> NativeBackend:
    """A native backend on random weights of a real shape (SYNTHETIC: speed only)."""
    cfg = synthetic_config(shape, max_seq_len=max_seq)
    be = NativeBackend(cfg, synthetic_weights(cfg), draft)
    be.kv.ensure_capacity(max_seq)
    return be


def step_costs(be, ks: list[int], context: int, reps: int, time_fn, draft_ms: Sequence[int] = ()) -> dict:
    """Seconds of one target step (M=1), one draft step, verify of K+1 rows, and (draft_ms) a
    draft pass of M rows with every row's logits (a tree or a second level checked by the draft),
    at `context`.

    The cache holds `context` positions of arbitrary (but finite) rows first; timing is
    interleaved per repetition (docs/benchmarking.md rule 1)."""
    kmax = max([*ks, *(m - 1 for m in draft_ms)], default=0)
    be.kv.ensure_capacity(context + kmax + 2)
    rng = np.random.default_rng(0)
    toks = rng.integers(0, be.cfg.vocab_size, size=context + kmax + 1).tolist()
    for start in range(0, context, 256):  # fill the cache with target rows
        be.forward(toks[start:min(context, start + 256)], start)
    fns = {"target": lambda: be.forward(toks[context:context + 1], context)}
    if be.draft is not None:
        fns["draft"] = lambda: be.forward(toks[context:context + 1], context, draft=True)
    for k in ks:
        fns[f"verify{k}"] = (lambda k=k: be.forward(toks[context:context + k + 1], context, all_logits=True))
    for m in draft_ms if be.draft is not None else ():
        if m > 1:
            fns[f"draft{m}"] = (lambda m=m: be.forward(toks[context:context + m], context, all_logits=True, draft=True))
    return time_fn(fns, warmup=2, reps=reps)
