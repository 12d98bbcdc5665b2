"""Attention over the BF16 cache per path, decode / verify / prefill shapes:
`qspec bench attention [--model NAME|DIR] [--contexts 512,2048,8192] [--ms 1,5,9,16] [--paths avx512,amx]
[--draft-kv int8|int4 [--draft-sparse 0,2048]]`.

--draft-kv times the MX drafts' attention instead: over that draft copy of the cache (every whole
page's INT4 K written, as a draft step past the prompt reads it; csrc/x86/attention_q8_impl.h),
each row's latest qspec.native.DRAFT_RECENT_KEYS keys from the BF16 rows as the drafts read them,
kv_gbps then counting the copy's bytes. --draft-sparse repeats each path per sparse draft attention
budget (csrc/draft_pages.cpp; 0 = every page), column draft_sparse.

For every usable path (`_C.attn_paths()`, or --paths) and context L, the rows of one step at
positions L - M .. L - 1 (M = 1: decode; K + 1: a verify; --prefill adds M = L from position 0)
over a synthetic cache in the model's shape (query heads, KV heads, head_dim), one layer's call
timed and scaled to all the model's layers. Paths and M values are interleaved per repetition
(BENCH.md rule 1), the cache rotates over enough layers to come from DRAM (decode reads each
layer's K/V once), and the read bandwidth is measured in the same run. Columns: ms per step
(all layers), a(M) = time(M rows) / time(1 row) per path, GFLOP/s of QKᵀ + PV, the GB/s of K/V
read (one pass) against the measured bandwidth, and each path's time against the first fast one.
The cache is SYNTHETIC (random BF16 rows): speed only.
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import numpy as np

from .common import (JsonWriter, fmt_table, int_list, llc_bytes, parent_parser, positive_int, print_header,
                     setup, str_list)
from qspec import _C
from qspec.cli import sparse_keys
from qspec.memory import PAGE_SIZE, draft_copy_arrays, draft_copy_of, page_aligned
from qspec.native import DRAFT_RECENT_KEYS

SHAPES = {"SmolLM2-135M": (9, 3, 64, 30), "qwen2.5-coder-1.5b": (12, 2, 128, 28)}  # heads, kv, hd, layers


def model_shape(model: str | None) -> tuple[str, tuple[int, int, int, int]]:
    """(label, (query heads, KV heads, head_dim, layers)) from --model's config.json, or the 1.5B's."""
    if model is None:
        return "qwen2.5-coder-1.5b", SHAPES["qwen2.5-coder-1.5b"]
    from qspec.config import ModelConfig
    from qspec.errors import QspecError
    from qspec.fetch import resolve_model

    try:
        d = resolve_model(model)
        c = ModelConfig.from_file(d / "config.json")
    except (QspecError, ValueError) as e:
        raise SystemExit(f"bench: error: {e}") from None
    return d.name, (c.n_heads, c.n_kv_heads, c.head_dim, c.n_layers)


def run(args) -> list[dict]:
    usable = _C.attn_paths()
    paths = args.paths or [p for p in usable if p != "ref"] or ["ref"]
    bad = [p for p in paths if p not in usable]
    if bad:
        raise SystemExit(f"bench: error: attention path(s) {', '.join(bad)} not usable here (usable: {', '.join(usable)})")
    label, (heads, kv_heads, hd, layers) = model_shape(args.model)
    threads = setup(args)
    ctx = print_header(args, "Attention per path: decode / verify / prefill shapes (synthetic cache)")
    contexts = args.contexts or ([512, 2048] if args.quick else [512, 2048, 8192])
    ms = sorted(set([1] + (args.ms or ([1, 5] if args.quick else [1, 5, 9, 16]))))
    reps = args.reps or (3 if args.quick else 7)
    rng = np.random.default_rng(0)
    variants = [(p, b) for p in paths for b in (args.draft_sparse or [0])]  # (path, sparse budget)
    probe = _C.ReadProbe(8 * llc_bytes(), threads)
    rows: list[dict] = []
    print(f"# model shape {label}: {heads} query heads, {kv_heads} KV heads, head_dim {hd}, {layers} layers; "
          f"paths {', '.join(paths)}; {reps} reps; over " + (f"the {args.draft_kv} draft copy" if args.draft_kv
                                                              else "the BF16 cache"), flush=True)
    with JsonWriter(args.json, {**ctx, "model": label}) as out:
        for L in contexts:
            layer_bytes = 2 * L * kv_heads * hd * 2
            if args.draft_kv:  # the copy's bytes of one layer: values, scales and flags per position
                one_layer = SimpleNamespace(n_layers=1, n_kv_heads=kv_heads, head_dim=hd)
                layer_bytes = L * sum(int(np.prod(shape)) for shape, _ in draft_copy_arrays(one_layer, args.draft_kv, 1))
            n_layers = max(2, min(layers, int(np.ceil(3 * llc_bytes() / layer_bytes))))  # from DRAM
            n_rows = -(-(L + max(ms)) // PAGE_SIZE) * PAGE_SIZE  # whole pages
            kv = page_aligned((rng.standard_normal((n_layers, 2, n_rows, kv_heads, hd), dtype=np.float32)
                               .view(np.uint32) >> 16).astype(np.uint16))  # as the pool's (qspec/memory.py)
            kw = {"q8": draft_copy_of(kv, args.draft_kv, L // PAGE_SIZE * PAGE_SIZE),
                  "recent": DRAFT_RECENT_KEYS} if args.draft_kv else {}
            cases = [(m, L - m) for m in ms if m <= L] + ([(L, 0)] if args.prefill else [])
            qs = {m: rng.standard_normal((m, heads, hd), dtype=np.float32) for m, _ in cases}
            times: dict[tuple[str, int, int], list[float]] = {(p, b, m): [] for p, b in variants for m, _ in cases}
            layer = 0
            for r in range(reps + 1):  # the first round warms up
                for m, start in cases:
                    for p, b in variants:
                        t0 = time.perf_counter()
                        _C.attention(qs[m], kv, layer, start, path=p, sparse=b, **kw)
                        dt = time.perf_counter() - t0
                        layer = (layer + 1) % n_layers
                        if r:
                            times[(p, b, m)].append(dt)
            gbps = probe.nbytes / min(probe.run(2)) / 1e9
            base = {m: statistics.median(times[(*variants[0], m)]) for m, _ in cases}
            for m, start in cases:
                pair_keys = sum(start + i + 1 for i in range(m)) * heads
                for p, b in variants:
                    s = statistics.median(times[(p, b, m)])
                    one = statistics.median(times[(p, b, 1)])
                    row = {"path": p, "draft_sparse": b, "context": L, "m": m, "ms_per_step": s * layers * 1e3,
                           "a(M)": s / one, "gflops": 4 * pair_keys * hd / s / 1e9,
                           "kv_gbps": layer_bytes / s / 1e9, "read_gbps": gbps,
                           f"vs_{paths[0]}": s / base[m], "draft_kv": args.draft_kv or "bf16", "synthetic": True}
                    rows.append(row)
                    out.write(row)
            del kv, kw
    print(fmt_table(rows, ["path", *(["draft_sparse"] if args.draft_sparse else []), "context", "m", "ms_per_step", "a(M)", "gflops", "kv_gbps", "read_gbps",
                           f"vs_{paths[0]}"]))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, parents=[parent_parser()],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", metavar="NAME|DIR", default=None,
                    help="model whose attention shape to use (default: Qwen2.5-Coder-1.5B's 12/2/128, 28 layers)")
    ap.add_argument("--contexts", type=int_list, default=None, help="comma list of contexts L (default 512,2048,8192)")
    ap.add_argument("--ms", type=int_list, default=None, help="comma list of rows M per step (default 1,5,9,16)")
    ap.add_argument("--paths", type=str_list, default=None, help="comma list of paths (default: every fast path usable here)")
    ap.add_argument("--prefill", action="store_true", help="add M = L rows from position 0 (a whole prompt)")
    ap.add_argument("--reps", type=positive_int, default=None, help="repetitions (default 7, --quick 3)")
    ap.add_argument("--draft-kv", choices=["int8", "int4"], default=None,
                    help="attend over this draft copy of the cache (the MX drafts' attention) instead of BF16")
    ap.add_argument("--draft-sparse", type=lambda v: [sparse_keys(x) for x in v.split(",")], default=None,
                    help="with --draft-kv int4: comma list of sparse draft attention budgets to compare (0 = every "
                    "page; default 0)")
    args = ap.parse_args(argv)
    if args.draft_sparse and args.draft_kv != "int4":
        ap.error("--draft-sparse needs --draft-kv int4")
    for name in ("contexts", "ms"):
        if any(v < 1 for v in getattr(args, name) or []):
            ap.error(f"--{name} values must be >= 1")
    if args.reps is not None and args.reps < 1:
        ap.error("--reps must be >= 1")
    run(args)


if __name__ == "__main__":
    main()
