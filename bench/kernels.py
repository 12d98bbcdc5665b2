"""GEMM kernels vs measured read bandwidth and vs torch BF16 F.linear (same shape, same run,
interleaved): `python -m bench.kernels [--threads N] [--model NAME|DIR] [--quick] [--json PATH] [--plot PATH]`.

Weights are SYNTHETIC (random) in the real shapes of SmolLM2-135M, Llama-3.2-1B and
Llama-3-8B, or with --model in the GEMM shapes of that model's config.json (fused qkv, o,
fused gate_up, down, lm_head): they measure speed only. `--real-weights` (with --model) takes the
model's own middle layer and LM head instead (MX formats cast as the drafts are,
qspec.draft.cast_rule): the amx MXFP4 path's decode depends on how a row block's block scales spread (a block with an output
4+ binades below its largest takes a slower table), and the synthetic scales (uniform over 8
binades) spread far wider than a real cast's. Each case rotates through enough copies
of the weight to exceed the last-level cache, so bytes really come from DRAM (as in decoding).
  gbps      = (packed weight bytes incl. scales + x + y) / median time
  pct_of_bw = per round of the case (every path and torch once), gbps / the floor of that round
              (common.FloorMeter: the best of the read probe and a reference BF16 GEMV sampled
              before and after the round, and of every kernel's rate in the round); the median
              over rounds, with min / max (pct_min, pct_max)
  vs_torch  = torch time / our time (> 1: we are faster)
Each line names the GEMM path it timed; `*` marks the path the dispatcher takes for that M
(gemm_choose: e.g. amx for BF16 at every M on an AMX machine). The summary gives, per shape and
format, the dispatcher's path(s) over M <= 64 (one path: batch invariance) and v(M) = M / M=1 time.
Variants of a path that give its bits, timed beside it: avx512_maddubs and avx2_maddubs (MXFP4
without AVX512-VNNI / AVX-VNNI, where the CPU has them; the avx2 path takes AVX-VNNI from
_C.AVX_VNNI_ROWS rows) and,
where the avx512_bf16 path takes FMAs (Intel, from _C.BF16_FMA_ROWS rows), avx512_dpbf16.

`--shapes 1536x576,4096x4096` benchmarks just those N x K shapes (model "custom");
`--no-torch` skips the torch baseline. A/B against a saved build of the extension:
QSPEC_BENCH_SO (bench/common.py).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

import numpy as np
import torch
import torch.nn.functional as F

from .common import (FloorMeter, JsonWriter, Rotating, copies_of, fmt_table, int_list, llc_bytes,
                     model_parser, parent_parser, positive_int, print_header, reps_for, setup, spread, str_list)
from qspec import _C
from qspec.draft import cast_rule
from qspec.memory import page_aligned, page_aligned_empty

# (model, layer, N, K): y[M, N] = x[M, K] @ W[N, K]^T
MODELS = {
    "SmolLM2-135M": [("q/o", 576, 576), ("k/v", 192, 576), ("gate/up", 1536, 576),
                     ("down", 576, 1536), ("lm_head", 49152, 576)],
    "Llama-3.2-1B": [("q/o", 2048, 2048), ("k/v", 512, 2048), ("gate/up", 8192, 2048),
                     ("down", 2048, 8192), ("lm_head", 128256, 2048)],
    "Llama-3-8B": [("q/o", 4096, 4096), ("k/v", 1024, 4096), ("gate/up", 14336, 4096),
                   ("down", 4096, 14336), ("lm_head", 128256, 4096)],
}
# How often each GEMM of MODELS runs per token (q/o, k/v and gate/up stand for two matrices per
# layer), for the whole-model d(M) and c of the summary.
LAYERS = {"SmolLM2-135M": 30, "Llama-3.2-1B": 16, "Llama-3-8B": 32}
PER_LAYER = {"q/o": 2, "k/v": 2, "gate/up": 2, "down": 1, "qkv": 1, "o": 1, "gate_up": 1}
QUICK = [("SmolLM2-135M", "gate/up"), ("SmolLM2-135M", "lm_head"), ("Llama-3.2-1B", "gate/up"),
         ("Llama-3-8B", "q/o")]
MS = [1, 2, 4, 8, 16, 64, 256]
QUICK_MS = [1, 2, 8, 64]
FORMATS = ["bf16", "mxfp4", "mxfp6_e2m3", "mxfp8_e4m3"]
QUICK_FORMATS = ["bf16", "mxfp4"]


def synthetic_weight(rng, fmt: str, n: int, k: int, wbits: np.ndarray):
    """Packed weight of random values in a realistic range (BF16 bits shared with torch)."""
    if fmt == "bf16":
        return _C.pack_bf16(wbits)
    bits = {"mxfp4": 4, "mxfp6_e2m3": 6, "mxfp6_e3m2": 6}.get(fmt, 8)
    kp = (k + 31) // 32 * 32
    codes = rng.integers(0, 1 << bits, size=(n, kp), dtype=np.uint8)
    if fmt in ("mxfp8_e4m3", "mxfp8_e5m2"):
        codes &= 0x3F  # no NaN / Inf codes
    scales = rng.integers(118, 126, size=(n, kp // 32), dtype=np.uint8)
    return _C.pack_mx(fmt, codes, scales, k)


def cast_weight(fmt: str, w: np.ndarray):
    """Packed weight of a real BF16 matrix (bits [n, k] uint16): as is, or its MX cast (the
    drafts' own, qspec.draft.cast_rule, so the scales spread as a real draft's do)."""
    if fmt == "bf16":
        return _C.pack_bf16(w)
    codes, scales = _C.mx_quantize((w.astype(np.uint32) << 16).view(np.float32), fmt, cast_rule(fmt))
    return _C.pack_mx(fmt, codes, scales, w.shape[1])


@contextlib.contextmanager
def model_errors():
    """--model's errors (a bad name or directory, an unreadable config or weights file) end the
    bench with one line."""
    from qspec.errors import QspecError

    try:
        yield
    except (QspecError, ValueError) as e:
        raise SystemExit(f"bench: error: {e}") from None


def model_config(model: str):
    """(directory, ModelConfig) of --model NAME|DIR."""
    from qspec.config import ModelConfig
    from qspec.fetch import resolve_model

    with model_errors():
        d = resolve_model(model)
        return d, ModelConfig.from_file(d / "config.json")


def model_weights(model: str) -> dict[str, np.ndarray]:
    """BF16 bits of the middle layer's GEMMs (and the LM head) of a model, by model_shapes' layer
    names: fused qkv and gate_up as the native model packs them (--real-weights)."""
    from qspec.loader import load_weights

    d, cfg = model_config(model)
    with model_errors():
        w = load_weights(d, cfg)
        lw = w.layers[cfg.n_layers // 2]
    bits = lambda *ts: torch.cat(ts).contiguous().view(torch.int16).numpy().view(np.uint16)  # noqa: E731
    return {"qkv": bits(lw.wq, lw.wk, lw.wv), "o": bits(lw.wo), "gate_up": bits(lw.w_gate, lw.w_up),
            "down": bits(lw.w_down), "lm_head": bits(w.lm_head)}


def model_shapes(model: str) -> tuple[str, list[tuple[str, int, int]]]:
    """(label, [(layer, N, K)]) of a model's GEMMs, from its config.json (--model NAME|DIR);
    records the layer count in LAYERS for the whole-model summary."""
    d, c = model_config(model)
    LAYERS[d.name] = c.n_layers
    return d.name, [("qkv", (c.n_heads + 2 * c.n_kv_heads) * c.head_dim, c.hidden_size),
                    ("o", c.hidden_size, c.n_heads * c.head_dim),
                    ("gate_up", 2 * c.intermediate_size, c.hidden_size),
                    ("down", c.hidden_size, c.intermediate_size),
                    ("lm_head", c.vocab_size, c.hidden_size)]


def run(args) -> list[dict]:
    threads = setup(args)
    ctx = print_header(args, "GEMM kernels vs the bandwidth floor and torch F.linear ("
                       + ("the model's own weights)" if args.real_weights else "synthetic weights)"))
    rng = np.random.default_rng(0)
    cases = [(mdl, lay, n, k) for mdl, layers in MODELS.items() for lay, n, k in layers
             if (not args.quick or (mdl, lay) in QUICK) and (not args.models or mdl in args.models)]
    if args.model:
        label, layers = model_shapes(args.model)
        cases = [(label, lay, n, k) for lay, n, k in layers]
    if args.shapes:
        cases = [("custom", f"{n}x{k}", n, k) for n, k in args.shapes]
    real = model_weights(args.model) if args.real_weights else None
    meter = FloorMeter(threads, probe_bytes=4 * llc_bytes() if args.quick else None)
    ctx.update(meter.context())
    print(meter.describe())
    rotate_bytes = 3 * llc_bytes()  # each case streams at least this many distinct bytes
    ms = args.ms or (QUICK_MS if args.quick else MS)
    formats = args.formats or (QUICK_FORMATS if args.quick else FORMATS)
    budget = 0.15 if args.quick else 0.5
    rows = []
    with JsonWriter(args.json, ctx) as out:
        for mdl, lay, n, k in cases:
            if real is not None:
                wbits = real[lay]
            else:
                wbits = (rng.standard_normal((n, k), dtype=np.float32) * 0.02).view(np.uint32)
                wbits = ((wbits + 0x7FFF + ((wbits >> 16) & 1)) >> 16).astype(np.uint16)
            tw = torch.from_numpy(wbits.view(np.int16)).view(torch.bfloat16)
            tbytes = tw.numel() * 2
            tws = [] if args.no_torch else [tw] + [tw.clone() for _ in range(max(0, -(-rotate_bytes // tbytes) - 1))]
            for fmt in formats:
                w0 = cast_weight(fmt, wbits) if real is not None else synthetic_weight(rng, fmt, n, k, wbits)
                ws = copies_of(w0, rotate_bytes)
                for m in ms:
                    if m >= 64 and n * k > 64e6 and args.quick:
                        continue
                    x = page_aligned(rng.standard_normal((m, k), dtype=np.float32))  # x, y on lines as
                    tx = torch.from_numpy(x).to(torch.bfloat16)                      # the engine's buffers
                    y = page_aligned_empty((m, n), np.float32)
                    paths = [p for p in _C.gemm_paths(ws[0], m) if p != "ref"]
                    cursor = [0]  # one rotation for every path of the case (common.Rotating)
                    fns = {p: Rotating(ws, lambda w, p=p: _C.gemm(w, x, y, p), cursor) for p in paths}
                    if fmt == "mxfp4" and "avx512" in paths and _C.mx_vnni():
                        # the avx512 path's two integer-dot instructions, side by side
                        fns["avx512_maddubs"] = Rotating(ws, lambda w: _maddubs(w, x, y), cursor)
                        paths.append("avx512_maddubs")
                        for nb in args.mx_row_blocks:  # the VNNI kernel at a forced stream count
                            fns[f"avx512_vnni_rb{nb}"] = Rotating(ws, lambda w, nb=nb: _row_blocks(w, x, y, nb), cursor)
                            paths.append(f"avx512_vnni_rb{nb}")
                    if fmt == "mxfp4" and "avx2" in paths and _C.mx_avx_vnni():
                        # vpmaddubsw beside the avx2 path, which takes AVX-VNNI from _C.AVX_VNNI_ROWS rows
                        fns["avx2_maddubs"] = Rotating(ws, lambda w: _maddubs_avx2(w, x, y), cursor)
                        paths.append("avx2_maddubs")
                    if fmt == "bf16" and "avx512_bf16" in paths and _C.bf16_fma() and m >= _C.BF16_FMA_ROWS:
                        # the avx512_bf16 path takes FMAs from here (same bits): vdpbf16ps beside it
                        fns["avx512_dpbf16"] = Rotating(ws, lambda w: _dpbf16(w, x, y), cursor)
                        paths.append("avx512_dpbf16")
                    with torch.inference_mode():
                        if tws:
                            fns["torch"] = Rotating(tws, lambda w: F.linear(tx, w))
                        reps = min(reps_for(f, budget / len(fns)) for f in fns.values())
                        st = meter.time_interleaved(fns, warmup=1, reps=reps)
                    nbytes = ws[0].nbytes + 4 * m * (k + n)
                    moved = {p: nbytes for p in paths} | ({"torch": tbytes + 2 * m * (k + n)} if tws else {})
                    # per round: the floor of its window (probe, reference GEMV, every kernel's rate)
                    floors = [pr.floor_gbps(*(moved[q] / pr.result[q] / 1e9 for q in moved)) for pr in meter.pairs]
                    fl = spread(floors)
                    for p in paths:
                        s = st[p].median
                        ts = st["torch"].median if tws else float("nan")
                        gbps = nbytes / s / 1e9
                        pct = spread([100 * nbytes / pr.result[p] / 1e9 / f for pr, f in zip(meter.pairs, floors)])
                        label = "avx512_vnni" if p == "avx512" and fmt == "mxfp4" and _C.mx_vnni() else p
                        isa = "avx512" if p.startswith("avx512_") and fmt == "mxfp4" else \
                            "avx2" if p.startswith("avx2_") else \
                            "avx512_bf16" if p == "avx512_dpbf16" else p  # the variants
                        row = {"kernel": f"gemm_{fmt}", "fmt": fmt, "path": label, "isa": isa,
                               "chosen": p == _C.gemm_choose(ws[0], m), "model": mdl, "layer": lay,
                               "synthetic": real is None, "m": m, "k": k, "n": n, "threads": threads,
                               "us_median": s * 1e6, "us_min": st[p].min * 1e6,
                               "us_max": st[p].max * 1e6, "reps": st[p].n, "bytes": nbytes,
                               "gbps": gbps, "pct_of_bw": pct["median"], "pct_min": pct["min"],
                               "pct_max": pct["max"], "bw_gbps": fl["median"],
                               "probe_gbps": statistics.median(pr.probe_gbps for pr in meter.pairs),
                               "ref_gemv_gbps": statistics.median(pr.kernel_gbps for pr in meter.pairs),
                               "tflops": 2 * m * n * k / s / 1e12,
                               "us_torch": ts * 1e6, "vs_torch": ts / s}
                        rows.append(row)
                        out.write(row)
                        mark = "*" if row["chosen"] else " "
                        print(f"{mdl:13s} {lay:8s} {fmt:11s} {label:14s}{mark} M={m:<4d} {n:6d}x{k:<6d} "
                              f"{s * 1e6:9.1f} us {gbps:6.1f} GB/s {row['pct_of_bw']:5.0f}% "
                              f"[{pct['min']:3.0f}..{pct['max']:3.0f}] of {fl['median']:5.1f} "
                              f"{row['tflops'] * 1e3:6.1f} GFLOP/s  torch {row['us_torch']:9.1f} us "
                              f"x{row['vs_torch']:.2f}", flush=True)
                del ws
    summarize(rows)
    if args.plot:
        plot(rows, args.plot, ctx)
    return rows


def _variant(setter, value, path):
    """A runner of `path` with one of its same-bits switches set (setter: a _C.set_* that returns
    the previous setting), restored after each call."""
    def run(w, x, y):
        old = setter(value)
        try:
            _C.gemm(w, x, y, path)
        finally:
            setter(old)
    return run


# the variants timed beside a path: vpmaddubsw instead of vpdpbusd (MXFP4), vdpbf16ps where the
# avx512_bf16 path would take FMAs, n row blocks streamed at once by the VNNI MXFP4 kernel
_maddubs = _variant(_C.set_mx_vnni, False, "avx512")
_maddubs_avx2 = _variant(_C.set_mx_vnni, False, "avx2")
_dpbf16 = _variant(_C.set_bf16_fma, False, "avx512_bf16")


def _row_blocks(w, x, y, n):
    _variant(_C.set_mx_row_blocks, n, "avx512")(w, x, y)


def model_d_table(rows: list[dict]) -> list[dict]:
    """Whole-model figures per (model, format, path), each GEMM weighted by how often it runs per
    token: d(M) = time of M rows / time of 1 row on the dispatcher's M = 1 path (what a multi-row
    draft pass costs in draft steps), and c = MX pass / BF16 pass at M = 1 (the dispatcher's paths)."""
    t = {}  # (model, fmt, path, m) -> weighted us; chosen paths also under path "*"
    shapes = {}
    for r in rows:
        wgt = PER_LAYER.get(r["layer"], 1) * (LAYERS.get(r["model"], 1) if r["layer"] in PER_LAYER else 1)
        shapes.setdefault((r["model"], r["fmt"], r["path"], r["m"]), set()).add(r["layer"])
        for path in [r["path"]] + (["*"] if r["chosen"] else []):
            key = (r["model"], r["fmt"], path, r["m"])
            t[key] = t.get(key, 0.0) + wgt * r["us_median"]
    layers = {mdl: len({r["layer"] for r in rows if r["model"] == mdl}) for mdl in {r["model"] for r in rows}}
    table = []
    for (mdl, fmt, path, m), us in sorted(t.items()):
        if m != 1 or path == "*" or len(shapes[(mdl, fmt, path, 1)]) != layers[mdl]:
            continue  # whole models only
        one = t.get((mdl, fmt, "*", 1))
        bf16 = t.get((mdl, "bf16", "*", 1))
        row = {"model": mdl, "fmt": fmt, "path": path, "M1_ms": us / 1e3,
               "c": one / bf16 if (one and bf16 and fmt != "bf16") else float("nan")}
        for mm in (2, 4, 8, 16, 32, 64):
            v = t.get((mdl, fmt, path, mm))
            full = v is not None and len(shapes[(mdl, fmt, path, mm)]) == layers[mdl]
            row[f"d({mm})"] = v / one if (full and one) else float("nan")
        table.append(row)
    return table


def summarize(rows: list[dict]) -> None:
    """Per (shape, format): the dispatcher's path(s) for M <= 64, M=1 speed, M / M=1 time ratios."""
    by = {}
    for r in rows:
        if r["chosen"]:
            by.setdefault((r["model"], r["layer"], r["fmt"]), {})[r["m"]] = r
    table = []
    for (mdl, lay, fmt), d in by.items():
        if 1 in d:
            paths = sorted({r["path"] for m, r in d.items() if m <= 64})
            table.append({"model": mdl, "layer": lay, "fmt": fmt, "path": "/".join(paths),
                          "M1_us": d[1]["us_median"], "M1_pct_bw": d[1]["pct_of_bw"],
                          "M1_vs_torch": d[1]["vs_torch"],
                          **{f"M{m}/M1": d[m]["us_median"] / d[1]["us_median"] if m in d else float("nan")
                             for m in (2, 4, 8, 16, 64)}})
    print()
    print(fmt_table(table, ["model", "layer", "fmt", "path", "M1_us", "M1_pct_bw", "M1_vs_torch",
                            "M2/M1", "M4/M1", "M8/M1", "M16/M1", "M64/M1"]))
    whole = model_d_table(rows)
    if whole:
        print("\nWhole model (each GEMM weighted by its count per token): d(M) = M rows / 1 row on the "
              "dispatcher's M = 1 path; c = MX / BF16 at M = 1")
        print(fmt_table(whole, ["model", "fmt", "path", "M1_ms", "c", "d(2)", "d(4)", "d(8)", "d(16)",
                                "d(32)", "d(64)"]))


def plot(rows: list[dict], path: str, ctx: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    chosen = [r for r in rows if r["chosen"]]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.5))
    for fmt in sorted({r["fmt"] for r in chosen}):
        pts = [r for r in chosen if r["fmt"] == fmt and r["m"] == 1]
        a1.plot(range(len(pts)), [r["pct_of_bw"] for r in pts], "o-", label=fmt)
        a1.set_xticks(range(len(pts)), [f"{r['model']}\n{r['layer']}\n{r['n']}x{r['k']}"
                                        for r in pts], fontsize=6)
    a1.axhline(85, color="gray", ls="--", lw=0.8)
    a1.set_ylabel("% of the bandwidth floor (per round)")
    a1.set_title("M = 1 (decode)")
    a1.legend()
    big = max(chosen, key=lambda r: (r["n"] * r["k"] if r["n"] < 100000 else 0))
    for fmt in sorted({r["fmt"] for r in chosen}):
        pts = sorted((r for r in chosen if r["fmt"] == fmt and (r["n"], r["k"]) == (big["n"], big["k"])),
                     key=lambda r: r["m"])
        a2.plot([r["m"] for r in pts], [r["us_median"] for r in pts], "o-", label=f"qspec {fmt}")
    tp = sorted({r["m"]: r for r in chosen if (r["n"], r["k"]) == (big["n"], big["k"])}.values(),
                key=lambda r: r["m"])
    a2.plot([r["m"] for r in tp], [r["us_torch"] for r in tp], "k--", label="torch bf16 F.linear")
    a2.set_xscale("log", base=2)
    a2.set_yscale("log")
    a2.set_xlabel("M (rows of x)")
    a2.set_ylabel("time per GEMM (us)")
    a2.set_title(f"{big['model']} {big['layer']} {big['n']}x{big['k']}")
    a2.legend(fontsize=7)
    fig.suptitle(f"{ctx['cpu']} isa={ctx['isa']} threads={ctx['threads']} commit={ctx['commit']} (synthetic weights)",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def _shapes(s: str) -> list[tuple[int, int]]:
    """An argparse type: "1536x1536,8960x1536" -> [(1536, 1536), (8960, 1536)], each dimension >= 1."""
    try:
        return [(positive_int(n), positive_int(k)) for n, k in (x.split("x") for x in s.split(","))]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of NxK, got {s!r}") from None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, parents=[parent_parser(), model_parser(prompts=False)],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", type=str_list, default=None,
                    help=f"comma list (default {','.join(FORMATS)}; quick {','.join(QUICK_FORMATS)})")
    ap.add_argument("--ms", type=int_list, default=None, help="comma list of M (default 1,2,4,8,16,64,256)")
    ap.add_argument("--models", type=str_list, default=None, help=f"comma list of {', '.join(MODELS)}")
    ap.add_argument("--shapes", type=_shapes, default=None,
                    help="comma list of NxK shapes (instead of the model layers)")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch F.linear baseline")
    ap.add_argument("--real-weights", action="store_true",
                    help="with --model: the model's own weights (its middle layer and LM head; MX formats "
                         "cast as the drafts are) instead of synthetic ones: the amx MXFP4 path's speed "
                         "depends on how its block scales spread")
    ap.add_argument("--mx-row-blocks", type=int_list, default=[],
                    help="also time the VNNI MXFP4 kernel at these forced row-block counts (1, 2, 4: paths "
                         "avx512_vnni_rbN), beside the count this CPU takes (csrc/gemm.h)")
    args = ap.parse_args(argv)
    if any(n not in (1, 2, 4) for n in args.mx_row_blocks):
        ap.error("--mx-row-blocks takes 1, 2 or 4")
    if args.real_weights and (not args.model or args.shapes):
        ap.error("--real-weights needs --model (and no --shapes)")
    run(args)


if __name__ == "__main__":
    main()
