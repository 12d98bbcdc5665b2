"""load(): from a model name or folder to a ready Engine — the model resolved (fetched on first
use), the draft format chosen and cast (or mapped from a `qspec quantize` file), the draft levels
built, the KV cache sized against the memory available, tensor parallelism set up."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from .config import ModelConfig
from .draft import DRAFT_FORMATS, DraftSpec, load_draft_file
from .loader import load_weights
from .memory import cache_bytes, check_fits
from .levels import NGRAM, MXLevel, NgramLevel, check_formats, is_helper, parse_chain
from .tokenizer import Tokenizer
from .engine import (DEFAULT_DRAFT, SMALL_MODEL_DRAFT, SMALL_MODEL_PARAMS, Backend, Engine,
                     check_ctx_size)


def _eos_ids(model_dir: Path, cfg: ModelConfig, tok: Tokenizer) -> set[int]:
    import json

    ids = set(cfg.eos_token_ids)
    gen_cfg = model_dir / "generation_config.json"
    if gen_cfg.exists():
        try:
            eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, AttributeError):
            eos = None
        if eos is not None:
            ids |= set(eos if isinstance(eos, list) else [eos])
    if tok.eos_token and tok.token_id(tok.eos_token) is not None:
        ids.add(tok.token_id(tok.eos_token))
    return {int(i) for i in ids | tok.end_marker_ids()}


def default_draft(cfg: ModelConfig) -> DraftSpec:
    """The measured best draft for a model of this size (see DEFAULT_DRAFT)."""
    return SMALL_MODEL_DRAFT if cfg.gemm_params < SMALL_MODEL_PARAMS else DEFAULT_DRAFT


def resolve_draft_spec(draft: str | DraftSpec | None, draft_lm_head: str | None = None,
                       cfg: ModelConfig | None = None) -> DraftSpec | None:
    """"auto" -> default_draft(cfg) (DEFAULT_DRAFT without a config); a format name -> that
    format with an LM head of the same format, unless `draft_lm_head` says otherwise."""
    if draft is None or draft == "none" or draft == NGRAM:
        return None
    if isinstance(draft, DraftSpec):
        return draft
    if draft == "auto":
        auto = DEFAULT_DRAFT if cfg is None else default_draft(cfg)
        return auto if draft_lm_head is None else DraftSpec(auto.fmt, draft_lm_head)
    if draft not in DRAFT_FORMATS:
        raise ValueError(f"unknown draft format {draft!r} (choose from none, auto, {NGRAM}, "
                         f"{', '.join(DRAFT_FORMATS)})")
    return DraftSpec(draft, draft_lm_head or draft)


def load(model: str | Path | None = None, draft: str | DraftSpec | None = "auto",
         draft_file: str | Path | None = None, threads: int | None = None, backend: str = "native",
         draft_lm_head: str | None = None, cache: bool | None = None,
         draft_levels: Sequence[str] = (), tensor_parallel: int | str | None = None,
         ctx_size: int | None = None, draft_kv: str = "auto", draft_window: int | None = None,
         draft_sparse: int | None = None) -> Engine:
    """Load a model into an Engine: None = the default SmolLM2-135M-Instruct, a known name
    (`qspec fetch --list`; fetched on first use unless QSPEC_OFFLINE=1), or a Hugging Face model
    directory.

    `draft`: "auto" (the measured default format), an MX format name, "ngram" (prompt lookup,
    no weights), or None for no draft.
    `draft_levels`: the draft levels above the draft, level 2 first (at most 4 levels in all;
    qspec/levels.py): MX format names (each a cast of the target's weights with an LM head of its
    own format, sharing the KV cache), helper models (a known model name or a model directory
    with the target's tokenizer, "PATH:FORMAT" for its MX cast; a KV cache of its own,
    qspec/helper.py) and, at the top only, "ngram".
    `draft_file`: a `qspec quantize` file to memory-map instead of casting at load.
    `draft_lm_head`: "bf16" (share the target's LM head) or an MX format for the draft's copy.
    `cache`: keep the packed target/draft weights in $QSPEC_CACHE/packed and map them on later
    loads (None = yes unless QSPEC_NO_WEIGHT_CACHE is set; qspec/weight_cache.py).
    `tensor_parallel`: the number of ranks (processes launched by torchrun or `qspec --tp N`;
    "auto" = one per NUMA node; None = the launcher's WORLD_SIZE, 1 without one). Each rank holds
    a shard of every weight set (qspec/parallel). Rank 0 gets the Engine; on the other ranks load()
    serves rank 0's forwards until rank 0's process ends, then exits the process with its status.
    `ctx_size`: tokens of context (prompt + new tokens) per generation, at most the model's
    (default: the model's); the KV cache is allocated for it at load, after checking that it fits in
    the available memory (`qspec.ContextMemoryError` otherwise, before any weight is read).
    `draft_kv`: what the MX draft levels attend over: "int8" / "int4" = an INT8 / INT4 copy of the
    KV cache (csrc/kv_q8.h: INT4 V rows in a Walsh-Hadamard-rotated basis, INT4 K per channel over
    each page of committed rows; kept written by every pass; the target still reads BF16, so the
    output is unchanged; each draft row's latest qspec.native.DRAFT_RECENT_KEYS (256) tokens are
    read from the BF16 cache), "bf16" = the BF16 cache (no copy), "auto" (default) = the
    qspec.native.DRAFT_KV_AUTO_FORMAT copy, read from qspec.native.DRAFT_KV_AUTO_MIN positions on.
    `draft_window`: N: the MX drafts' passes over that copy attend only the first
    qspec.native.DRAFT_SINKS (64) tokens and the N most recent ones, so drafting stays as cheap at
    long context as at short (the target still attends every token: the output is unchanged);
    0: every token; None (default): qspec.native.DEFAULT_DRAFT_WINDOW (8,192) when there is a copy.
    `draft_sparse`: N >= 256: over the INT4 copy each draft row attends about N tokens of its
    written pages, those whose keys can score highest (Quest's per-page bound), besides its latest
    ones; 0: every page; None (default): qspec.native.DEFAULT_DRAFT_SPARSE (2,048) when there is a
    copy. Drafts only: the output is unchanged.
    Raises `qspec.ModelLoadError` (or `qspec.DraftFileError`) for a missing, corrupt or
    unsupported model or draft file, `qspec.TensorParallelError` when the ranks cannot be set up,
    and ValueError for invalid arguments.
    """
    from . import _C
    from .parallel.launch import load_tensor_parallel, world_size
    from .parallel.topology import allowed_cpus

    if threads is not None:
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an integer >= 1, got {threads!r}")
        cpus = len(allowed_cpus())
        if threads > cpus:  # allowed, as llama.cpp allows it, but never what anyone wants
            print(f"qspec: warning: {threads} threads on the {cpus} CPUs this process may run on: every pass "
                  "waits for its slowest thread, so it runs slower than with one thread a CPU", file=sys.stderr)
        _C.set_num_threads(threads)
        if "torch" in sys.modules:  # else load_weights sets it if it reads the checkpoint with torch
            sys.modules["torch"].set_num_threads(threads)
    _C.mx_tiles()  # a bad QSPEC_MX_PATH (or QSPEC_BF16_DOT, QSPEC_ATTN_DOT below) is a ValueError here, before any file is read
    _C.bf16_fma()
    _C.attn_bf16()
    if backend not in ("native", "torch"):
        raise ValueError(f"backend must be 'native' or 'torch', got {backend!r}")
    from .native import DRAFT_KV_MODES, check_draft_sparse, check_draft_window, draft_copy_format

    if draft_kv not in DRAFT_KV_MODES:
        raise ValueError(f"draft_kv must be one of {', '.join(DRAFT_KV_MODES)}, got {draft_kv!r}")
    # a bad format or chain fails before any file is read
    copy = "copy" if backend == "native" and draft_kv != "bf16" and draft not in (None, NGRAM) else None
    check_draft_window(draft_window, copy)
    check_draft_sparse(draft_sparse, copy)
    spec = resolve_draft_spec(draft, draft_lm_head)
    chain = parse_chain(NGRAM if draft == NGRAM else None if spec is None else "auto", draft_levels)
    if backend == "torch" and (spec is not None and draft != "auto" or draft_file is not None or draft_levels
                               or draft == NGRAM):
        raise ValueError("the torch backend has no draft; use backend='native'")
    if draft == NGRAM and (draft_file is not None or draft_lm_head is not None):
        raise ValueError("the ngram draft has no weights: no draft_file or draft_lm_head")
    world = world_size(tensor_parallel)
    if world > 1 and backend != "native":
        raise ValueError("tensor parallelism runs on the native backend only")

    def prepare() -> _Plan:  # on every rank; under TP its errors are reported by rank 0 only
        if world > 1 and draft_file is not None:
            raise ValueError("a draft file holds the whole model: with tensor parallelism each rank casts its "
                             "own shard (and keeps it in the weight cache); drop --draft-file")
        plan = _prepare(model, draft, draft_file, draft_lm_head, draft_levels, chain, backend)
        if ctx_size is not None:  # before any weight is read or any row allocated
            check_ctx_size(ctx_size, plan.cfg)
            copy = draft_copy_format(plan.cfg, draft_kv, plan.spec) if backend == "native" else None
            check_fits(cache_bytes(plan.cfg, ctx_size, copy) // world,
                       f"a KV cache of {ctx_size} tokens" + (f" (per rank of {world})" if world > 1 else ""))
        return plan

    def make_backend(plan: _Plan, shard=None) -> Backend:
        weights = load_weights(plan.model_dir, plan.cfg, torch_threads=threads)
        if backend == "torch":
            from .model import TorchBackend

            return TorchBackend(plan.cfg, weights)
        from .native import native_backend

        return native_backend(plan.model_dir, plan.cfg, weights, plan.spec, plan.draft_packed, cache=cache,
                              upper_drafts=plan.upper_specs, shard=shard, draft_kv=draft_kv,
                              draft_window=draft_window, draft_sparse=draft_sparse)

    def make_engine(plan: _Plan, be: Backend) -> Engine:
        if ctx_size is not None:
            be.pool.reserve(ctx_size)
        return _engine(plan, be, backend, cache, ctx_size)

    if world > 1:
        return load_tensor_parallel(prepare, make_backend, make_engine, threads)
    plan = prepare()
    return make_engine(plan, make_backend(plan))


@dataclass
class _Plan:
    """What load() found before reading any weight (the same on every tensor-parallel rank)."""
    model_dir: Path
    cfg: ModelConfig
    tok: Tokenizer
    spec: DraftSpec | None
    draft_packed: dict | None
    chain: list[str]
    helpers: dict
    upper_specs: list[DraftSpec]


def _prepare(model, draft, draft_file, draft_lm_head, draft_levels, chain: list[str], backend: str) -> _Plan:
    from .fetch import resolve_model  # None = the default model, a known name, or a folder
    from .helper import check_helper

    model_dir = resolve_model(model)
    cfg = ModelConfig.from_file(model_dir / "config.json")
    spec = resolve_draft_spec(draft, draft_lm_head, cfg)  # "auto" is chosen by the model's size
    tok = Tokenizer(model_dir)
    draft_packed = None
    if draft_file is not None and backend == "native":
        file_spec, draft_packed = load_draft_file(Path(draft_file), model_dir)
        if draft not in ("auto", None) and spec != file_spec:
            raise ValueError(f"--draft {draft} does not match the draft file's format {file_spec.fmt}")
        spec = file_spec
    chain = list(chain)
    if spec is not None:
        chain[0] = spec.fmt
    check_formats(chain)
    helpers = {name: check_helper(name, cfg, tok) for name in chain if is_helper(name)}  # before any weights
    upper_specs = [DraftSpec(name, name) for name in chain[1:] if name != NGRAM and not is_helper(name)]
    return _Plan(model_dir, cfg, tok, spec, draft_packed, chain, helpers, upper_specs)


def _engine(plan: _Plan, be: Backend, backend: str, cache: bool | None, ctx_size: int | None = None) -> Engine:
    """The Engine over a loaded backend, with its draft levels (helper models are loaded here)."""
    from .helper import load_helper

    levels = []  # (the torch backend has no draft: draft="auto" there is plain decoding)
    if backend == "native":
        weight_set = 0
        for name in plan.chain:
            if name == NGRAM:
                levels.append(NgramLevel())
            elif is_helper(name):
                levels.append(load_helper(name, *plan.helpers[name], cache))
            else:  # the MX casts of the target take weight sets 1, 2, ... in chain order
                weight_set += 1
                levels.append(MXLevel(be, weight_set, name))
    return Engine(plan.model_dir, plan.cfg, plan.tok, be, _eos_ids(plan.model_dir, plan.cfg, plan.tok), levels,
                  ctx_size)
