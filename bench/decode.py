"""Plain BF16 decode speed against its memory-bandwidth floor (BENCH.md rules 4, 6):
`qspec bench decode [--model NAME|DIR] [--prompt-file F] [--threads N] [--quick] [--json PATH] [--plot PATH]`.

  floor_tokens_per_s = read bandwidth (measured in this run, same threads) / BF16 weight bytes per token
  pct_of_floor       = tokens_per_s / floor_tokens_per_s
Real model (--model, default SmolLM2-135M): greedy, 128 new tokens, median over dev prompts; prefill reported separately.
Synthetic shapes (labelled): median of one-token steps at a fixed context.
"""

from __future__ import annotations

import argparse
import resource
import statistics

from .common import (JsonWriter, dev_prompts, fmt_table, measure_bandwidth, model_parser, parent_parser,
                     print_header, setup, time_interleaved)
from .models import load_engine, model_label, step_costs, synthetic_backend


def run(args) -> list[dict]:
    setup(args)
    ctx = print_header(args, "bench.decode: plain BF16 greedy decode vs the bandwidth floor")
    bw = measure_bandwidth(args.threads)
    print(f"# read bandwidth ({args.threads} threads): {bw:.1f} GB/s")
    rows = []
    out = JsonWriter(args.json, ctx)
    eng = load_engine(args, None)
    prompts = dev_prompts(args.prompt_file)[: 3 if args.quick else args.prompts]
    n_new = 32 if args.quick else 128
    tps, prefill = [], []
    eng.generate(prompts[0], max_new_tokens=8)  # warm-up
    eng.backend.model.profile_reset()
    for p in prompts:
        s = eng.generate(p, max_new_tokens=n_new, chat=True).stats
        tps.append(s["tokens_per_s"])
        prefill.append(s["prefill_s"] / s["prompt_tokens"])
    prof = eng.backend.model.profile()  # includes the prefills; decode dominates
    wbytes = eng.backend.target_bytes
    floor = bw * 1e9 / wbytes
    r = {"model": model_label(eng), "weights": "real", "threads": args.threads,
         "tokens_per_s": statistics.median(tps), "floor_tokens_per_s": floor,
         "pct_of_floor": 100 * statistics.median(tps) / floor, "weight_mb": wbytes / 1e6,
         "prefill_ms_per_token": 1e3 * statistics.median(prefill), "prompts": len(prompts), "new_tokens": n_new,
         "bw_gbps": bw, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
         "gemm_pct": 100 * prof["gemm_s"] / prof["total_s"], "attention_pct": 100 * prof["attention_s"] / prof["total_s"],
         "outside_kernels_pct": 100 * prof["other_s"] / prof["total_s"]}
    rows.append(r)
    out.write(r)
    del eng
    for shape in ([] if args.quick else ["llama-3.2-1b"]):
        be = synthetic_backend(shape, None, max_seq=512)
        st = step_costs(be, [], 256, 7, time_interleaved)["target"]
        floor = bw * 1e9 / be.target_bytes
        r = {"model": f"{shape} (synthetic weights)", "weights": "synthetic", "threads": args.threads,
             "tokens_per_s": 1 / st.median, "floor_tokens_per_s": floor, "pct_of_floor": 100 / st.median / floor,
             "weight_mb": be.target_bytes / 1e6, "context": 256, "bw_gbps": bw}
        rows.append(r)
        out.write(r)
        del be
    out.close()
    print(fmt_table(rows, ["model", "threads", "tokens_per_s", "floor_tokens_per_s", "pct_of_floor",
                           "weight_mb", "bw_gbps", "gemm_pct", "attention_pct", "outside_kernels_pct"]))
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4))
        names = [r["model"] for r in rows]
        ax.bar(names, [r["pct_of_floor"] for r in rows])
        ax.axhline(100, color="k", ls="--", lw=1)
        ax.set_ylabel("% of bandwidth floor (tok/s)")
        ax.set_title(f"plain BF16 decode, {args.threads} threads, {ctx['cpu']}, BW {bw:.1f} GB/s", fontsize=9)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot: {args.plot}")
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="qspec bench decode", parents=[parent_parser(), model_parser()],
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=5, help="dev prompts to decode (default 5)")
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
