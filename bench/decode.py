"""Plain BF16 decode speed against its memory-bandwidth floor (BENCH.md rules 4, 6):
`qspec bench decode [--model NAME|DIR] [--prompt-file F] [--threads N] [--repeat N] [--quick] [--json PATH] [--plot PATH]`.

The floor is measured interleaved with the decode (common.FloorMeter): sample, decode for about
--window seconds, sample, decode, ..., sample; each window is paired with the mean of the samples
before and after it (the decode is paused while a sample runs).
  bytes_per_token    = packed target weight bytes streamed per token (every GEMM weight + the
                       LM head, padding included; not the embedding) + the KV cache read at the
                       window's mean context
  floor_gbps         = per pair, the best of the read probe (widest loads of the selected ISA
                       level) and a BF16 GEMV over the model's largest matrix (its LM head)
  floor_tokens_per_s = floor_gbps / bytes_per_token
  pct_of_floor       = tokens_per_s / floor_tokens_per_s, per pair; median, min/max and IQR
Real model (--model, default SmolLM2-135M): plain greedy decode (Engine.stream, no draft), 128
new tokens (quick: 32) for each of --prompts prompts of --prompt-file (spread over the file);
prefill reported separately (not in any window). Synthetic Llama-3.2-1B shapes (labelled): one
pair per window of target steps (M=1) at a fixed context of 256. --repeat N runs it all N times in the
process and reports the spread of the per-run medians; force a lower ISA level with
QSPEC_ISA=avx2 (on an AVX-512 machine).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import numpy as np

from .common import (FloorMeter, JsonWriter, dev_prompts, fmt_spread, fmt_table, model_parser, parent_parser,
                     positive_float, positive_int, print_header, setup, spread)
from .models import load_engine, model_label, synthetic_backend

SYNTHETIC_CONTEXT = 256


def kv_bytes_per_token(cfg, context: float, itemsize: int) -> float:
    """KV cache bytes one decode step reads at `context` positions (K and V of every layer)."""
    return cfg.n_layers * 2 * context * cfg.n_kv_heads * cfg.head_dim * itemsize


def pair_row(pair, tokens_per_s: float, bytes_per_token: float) -> dict:
    floor = pair.floor_gbps()
    return {"tokens_per_s": tokens_per_s, "bytes_per_token": bytes_per_token, "floor_gbps": floor,
            "probe_gbps": pair.probe_gbps, "ref_gemv_gbps": pair.kernel_gbps,
            "floor_tokens_per_s": floor * 1e9 / bytes_per_token,
            "implied_gbps": tokens_per_s * bytes_per_token / 1e9,
            "pct_of_floor": 100 * tokens_per_s * bytes_per_token / (floor * 1e9)}


class ForwardCounter:
    """Counts a backend's one-token forwards (the plain decode steps) and the positions they
    attend over, by wrapping `forward` on the instance while the bench runs."""

    def __init__(self, be):
        self.be, self.inner = be, be.forward
        self.steps, self.context = 0, 0

    def __enter__(self):
        self.be.forward = self
        return self

    def __exit__(self, *exc):
        del self.be.forward

    def __call__(self, tokens, start_pos, **kw):
        if len(tokens) == 1:
            self.steps += 1
            self.context += start_pos + 1
        return self.inner(tokens, start_pos, **kw)


def real_model_run(eng, meter: FloorMeter, prompts: list[str], n_new: int, window_s: float,
                   prefills: list[dict]) -> list[dict]:
    """Plain greedy decode of each prompt (Engine.stream, speculative off), cut into windows of
    about window_s seconds with a floor sample between them: one pair per window. Appends each
    prompt's prefill to `prefills`."""
    be, cfg = eng.backend, eng.cfg
    itemsize = be.kv.data.itemsize
    rows = []
    with ForwardCounter(be) as fc:
        for j, prompt in enumerate(prompts):
            st: dict = {}
            be.kv.forget()  # the prompts share their chat template's head: prefill each in full
            it = eng.stream(prompt, max_new_tokens=n_new, chat=True, speculative=False, stats=st)
            done = [next(it, None) is None]  # prefill and the first token(s): reported apart
            prefills.append({"prompt_tokens": st["prompt_tokens"], "prefill_s": st["prefill_s"]})

            def window():
                s0, c0, t0 = fc.steps, fc.context, time.perf_counter()
                while time.perf_counter() - t0 < window_s:
                    if next(it, None) is None:
                        done[0] = True
                        break
                return fc.steps - s0, fc.context - c0

            def windows():
                while not done[0]:
                    yield window

            for pair in meter.interleave(windows()):
                steps, context = pair.result
                if steps == 0:
                    continue
                bpt = be.target_bytes + kv_bytes_per_token(cfg, context / steps, itemsize)
                rows.append({**pair_row(pair, steps / pair.seconds, bpt), "prompt": j, "steps": steps,
                             "mean_context": context / steps})
    return rows


def synthetic_run(be, meter: FloorMeter, pairs: int, window_s: float) -> list[dict]:
    """Target steps (M=1) at SYNTHETIC_CONTEXT: `pairs` windows of about window_s seconds each."""
    ctx = SYNTHETIC_CONTEXT
    be.kv.ensure_capacity(ctx + 2)
    rng = np.random.default_rng(0)
    toks = rng.integers(0, be.cfg.vocab_size, size=ctx + 1).tolist()
    for start in range(0, ctx, 256):  # the cache holds ctx positions of target rows
        be.forward(toks[start:min(ctx, start + 256)], start)
    be.forward(toks[ctx:], ctx)  # warm-up

    def window():
        n, t0 = 0, time.perf_counter()
        while n == 0 or time.perf_counter() - t0 < window_s:
            be.forward(toks[ctx:], ctx)
            n += 1
        return n

    bpt = be.target_bytes + kv_bytes_per_token(be.cfg, ctx + 1, be.kv.data.itemsize)
    return [{**pair_row(p, p.result / p.seconds, bpt), "steps": p.result}
            for p in meter.interleave(window for _ in range(pairs))]


def summary(label: str, weights: str, runs: list[list[dict]], args, meter: FloorMeter, extra: dict) -> dict:
    """One row per model: medians over every pair, the per-pair spread and the spread of the
    per-run medians (--repeat)."""
    pairs = [r for run in runs for r in run]
    pct = spread([r["pct_of_floor"] for r in pairs])
    run_medians = [statistics.median(r["pct_of_floor"] for r in run) for run in runs]
    med = lambda key: statistics.median(r[key] for r in pairs)  # noqa: E731
    return {"model": label, "weights": weights, "threads": args.threads, "runs": len(runs), "pairs": len(pairs),
            "tokens_per_s": med("tokens_per_s"), "floor_tokens_per_s": med("floor_tokens_per_s"),
            "pct_of_floor": pct["median"], "pct_min": pct["min"], "pct_max": pct["max"],
            "pct_q1": pct["q1"], "pct_q3": pct["q3"],
            "run_pct_min": min(run_medians), "run_pct_max": max(run_medians),
            "run_pct_medians": run_medians,
            "bytes_per_token_mb": med("bytes_per_token") / 1e6, "implied_gbps": med("implied_gbps"),
            "floor_gbps": med("floor_gbps"), "probe_gbps": med("probe_gbps"), "ref_gemv_gbps": med("ref_gemv_gbps"),
            **meter.context(), **extra}


def run(args) -> list[dict]:
    setup(args)
    ctx = print_header(args, "bench.decode: plain BF16 greedy decode vs the bandwidth floor, interleaved")
    out = JsonWriter(args.json, ctx)
    rows = []
    eng = load_engine(args, None)
    label = model_label(eng)
    meter = FloorMeter(args.threads, eng.backend.lm_head)
    print(meter.describe(), flush=True)
    prompts = dev_prompts(args.prompt_file, 3 if args.quick else args.prompts)
    n_new = 32 if args.quick else 128
    eng.generate(prompts[0], max_new_tokens=8)  # warm-up
    eng.backend.model.profile_reset()
    runs, prefills = [], []
    for i in range(args.repeat):
        run_rows = real_model_run(eng, meter, prompts, n_new, args.window, prefills)
        for j, r in enumerate(run_rows):
            out.write({"model": label, "weights": "real", "case": "pair", "run": i, "pair": j, **r})
        runs.append(run_rows)
        print(f"# {label} run {i + 1}/{args.repeat}: % of floor per window "
              + " ".join(f"{r['pct_of_floor']:.0f}" for r in run_rows)
              + f"  (tok/s {statistics.median(r['tokens_per_s'] for r in run_rows):.2f}, "
              f"floor {statistics.median(r['floor_gbps'] for r in run_rows):.1f} GB/s)", flush=True)
    prof = eng.backend.model.profile()  # includes the prefills; decode dominates
    pairs = [r for run in runs for r in run]
    r = summary(label, "real", runs, args, meter, {
        "weight_mb": eng.backend.target_bytes / 1e6, "prompts": len(prompts), "new_tokens": n_new,
        "prefill_ms_per_token": statistics.median(1e3 * p["prefill_s"] / p["prompt_tokens"] for p in prefills),
        "prefill_tokens_per_s": statistics.median(p["prompt_tokens"] / p["prefill_s"] for p in prefills),
        "prompt_tokens": statistics.median(p["prompt_tokens"] for p in prefills),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "gemm_pct": 100 * prof["gemm_s"] / prof["total_s"], "attention_pct": 100 * prof["attention_s"] / prof["total_s"],
        "outside_kernels_pct": 100 * prof["other_s"] / prof["total_s"]})
    rows.append(r)
    out.write({"case": "summary", **r})
    print(f"# {label}: % of floor {fmt_spread(spread([p['pct_of_floor'] for p in pairs]), '%')}", flush=True)
    del eng, meter
    for shape in ([] if args.quick else ["llama-3.2-1b"]):
        be = synthetic_backend(shape, None, max_seq=512)
        label = f"{shape} (synthetic weights)"
        meter = FloorMeter(args.threads, be.lm_head)
        runs = []
        for i in range(args.repeat):
            run_rows = synthetic_run(be, meter, args.pairs, args.window)
            for j, r in enumerate(run_rows):
                out.write({"model": label, "weights": "synthetic", "case": "pair", "run": i, "step": j, **r})
            runs.append(run_rows)
        r = summary(label, "synthetic", runs, args, meter, {"weight_mb": be.target_bytes / 1e6,
                                                           "context": SYNTHETIC_CONTEXT})
        rows.append(r)
        out.write({"case": "summary", **r})
        print(f"# {label}: % of floor {fmt_spread(spread([p['pct_of_floor'] for run in runs for p in run]), '%')}",
              flush=True)
        del be, meter
    out.close()
    print(fmt_table(rows, ["model", "runs", "pairs", "tokens_per_s", "floor_tokens_per_s", "pct_of_floor",
                           "pct_min", "pct_max", "run_pct_min", "run_pct_max", "floor_gbps", "probe_gbps",
                           "ref_gemv_gbps", "implied_gbps", "bytes_per_token_mb"]))
    if rows[0].get("gemm_pct") is not None:
        r = rows[0]
        print(f"# {r['model']}: prefill {r['prefill_tokens_per_s']:.0f} tok/s ({r['prefill_ms_per_token']:.2f} ms/token), "
              f"time split (incl. prefill): GEMM {r['gemm_pct']:.0f}%, attention {r['attention_pct']:.0f}%, "
              f"outside kernels {r['outside_kernels_pct']:.0f}%")
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4))
        names = [r["model"] for r in rows]
        ax.bar(names, [r["pct_of_floor"] for r in rows],
               yerr=[[r["pct_of_floor"] - r["pct_min"] for r in rows], [r["pct_max"] - r["pct_of_floor"] for r in rows]],
               capsize=4)
        ax.axhline(100, color="k", ls="--", lw=1)
        ax.set_ylabel("% of bandwidth floor (median, min..max of pairs)")
        ax.set_title(f"plain BF16 decode, {args.threads} threads, {ctx['cpu']}, isa {ctx['isa']}", fontsize=9)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot: {args.plot}")
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="qspec bench decode", parents=[parent_parser(), model_parser()],
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=positive_int, default=5, help="prompts to decode (default 5)")
    p.add_argument("--window", type=positive_float, default=2.0,
                   help="seconds of decoding per pair: a floor sample every WINDOW seconds (default 2)")
    p.add_argument("--pairs", type=positive_int, default=10, help="synthetic shapes: windows per run (default 10)")
    p.add_argument("--repeat", type=positive_int, default=1, help="run everything N times; report the spread of the run medians")
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
