"""Where the time of one draft step and of one target pass of M rows goes:
`qspec bench breakdown [--model NAME|DIR] [--draft FMT[:HEAD]] [--context N] [--ms 1,2,4] [--draft-ms 1,4,8] [--reps N]
[--threads N] [--quick] [--json PATH] [--plot PATH]` (or `python -m bench.breakdown ...` from a
development install).

speedup = tau / (K c + v(K+1)) with c = draft step / target step and v(M) = target pass of M rows /
one-row pass (M = K + 1 is a verify), so a kernel change counts by what it does to c and v. With
the cache filled to --context positions, the draft step (M=1, draft weights), a draft pass at every M
of --draft-ms (the pass a tree or a second level costs: d(M) = draft pass of M rows / draft step) and a
target pass at every M of --ms run interleaved (docs/benchmarking.md rule 1), the native profile (Model.profile)
reset around each call. Per case, median ms per step of each piece (docs/benchmarking.md, "The
per-step breakdown"):
  qkv o gate_up down lm_head  GEMM kernels per weight (wall, minus prep and idle)
  prep        activation preparation inside the GEMM driver (Q8 for MXFP4/MXFP6-E2M3, bf16, K padding)
  gemm_idle   the idle share of the GEMM thread regions (waking, waiting for the slowest thread)
  attention   attention kernels (minus their idle share), attn_idle that share
  rowwise     embedding, norms, RoPE + K/V row writes, SiLU*up, residual adds
  host        the step as Python times it minus the native forward (binding, backend.forward)
and c (draft) or v(M) (target). Then a real speculative generation on --prompts prompts of
--prompt-file (default draft settings, greedy): the share of decode time inside the native
forward, in Python around the draft/verify calls, and in the rest of the controller.
"""

from __future__ import annotations

import argparse
import statistics
import time

from .common import (JsonWriter, dev_prompts, fmt_table, model_parser, parent_parser, positive_int,
                     print_header, setup, time_interleaved)
from .models import default_draft_name, load_engine, model_label, parse_draft, step_costs

GEMMS = ("qkv", "o", "gate_up", "down", "lm_head")
PIECES = GEMMS + ("prep", "gemm_idle", "attention", "attn_idle", "rowwise", "host")
MAX_M = 64  # decode/verify sizes: one GEMM path for M = 1..64 (csrc/gemm.h)


def _ms(s: str) -> list[int]:
    """"1,2,4" -> [1, 2, 4]: rows per target pass, each 1..MAX_M."""
    try:
        ms = sorted({int(x) for x in s.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: expected a comma list of integers") from None
    if not ms or ms[0] < 1 or ms[-1] > MAX_M:
        raise argparse.ArgumentTypeError(f"{s!r}: every M must be in 1..{MAX_M}")
    return ms


def _draft(s: str) -> str:
    """"mxfp4" or "mxfp4:mxfp4" (format:LM head), checked; returned as "format:lm_head"."""
    try:
        d = parse_draft(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return f"{d.fmt}:{d.lm_head}"


def pieces(wall_s: float, p: dict) -> dict:
    """One step's pieces in seconds from its wall time and its native profile; they add up to wall_s."""
    out = {g: p[f"gemm_{g}_s"] - p[f"gemm_{g}_prep_s"] - p[f"gemm_{g}_idle_s"] for g in GEMMS}
    out.update(prep=p["gemm_prep_s"], gemm_idle=p["gemm_idle_s"],
               attention=p["attention_s"] - p["attention_idle_s"], attn_idle=p["attention_idle_s"],
               rowwise=p["rowwise_s"], reduce=p["reduce_s"], host=wall_s - p["total_s"])
    return out


def profiled_time_fn(model, samples: dict):
    """A `time_fn` for step_costs: time_interleaved over the same calls, each with the profile reset
    before it and read after it; samples[name] gets (wall seconds, profile) per timed call."""
    def wrap(name, fn):
        def call():
            model.profile_reset()
            t0 = time.perf_counter()
            fn()
            wall = time.perf_counter() - t0
            samples.setdefault(name, []).append((wall, model.profile()))
        return call

    def time_fn(fns: dict, warmup: int, reps: int):
        time_interleaved({name: wrap(name, fn) for name, fn in fns.items()}, warmup=warmup, reps=reps)
        for name in fns:
            samples[name] = samples[name][-reps:]  # the timed calls, not the warm-up
        return samples
    return time_fn


def case_rows(samples: dict, ms: list[int], draft_ms: list[int]) -> list[dict]:
    """One row per case: median ms of the step and of each piece, ratio (step / the target's
    one-row step: c, c·d(M) or v(M)) and vs_m1 (step / the same weights' one-row step: d(M) or v(M))."""
    def med(name):
        steps = [pieces(wall, p) for wall, p in samples[name]]
        row = {k: 1e3 * statistics.median(s[k] for s in steps) for k in PIECES}
        row["step_ms"] = 1e3 * statistics.median(wall for wall, _ in samples[name])
        row["native_ms"] = 1e3 * statistics.median(p["total_s"] for _, p in samples[name])
        return row

    one, draft = med("target"), med("draft")
    cases = ([("draft", m, draft if m == 1 else med(f"draft{m}")) for m in draft_ms] +
             [("target", m, one if m == 1 else med(f"verify{m - 1}")) for m in ms])
    return [{"case": case, "m": m, **r, "ratio": r["step_ms"] / one["step_ms"],
             "vs_m1": r["step_ms"] / (draft if case == "draft" else one)["step_ms"]} for case, m, r in cases]


def controller_share(eng, prompts: list[str], n_new: int, tree: str | None = None) -> dict:
    """Speculative decoding (default settings, greedy; `tree`: the engine's tree mode unless
    given) of each prompt, token ids as they come (Engine.tokens): the native profile is reset
    once the first token is out, after the prefill, so it covers exactly the decode. Shares of
    decode time: native forward, Python around the draft/verify forwards of chain, tree and
    lookup-alone steps (backend.forward, the draft loop), the rest of the controller."""
    model = eng.backend.model
    decode = phases = native = 0.0
    steps = tokens = 0
    for p in prompts:
        s: dict = {}
        it = eng.tokens(p, max_new_tokens=n_new, stats=s, tree=tree)
        next(it)  # the prefill and the first token
        model.profile_reset()
        for _ in it:
            pass
        decode += s["decode_s"]
        phases += s["draft_s"] + s["verify_s"] + s.get("tree_draft_s", 0.0) + s.get("tree_verify_s", 0.0) \
            + s.get("lookup_s", 0.0)
        native += model.profile()["total_s"]
        steps += s["steps"]
        tokens += s["new_tokens"] - 1
    return {"case": "controller", "prompts": len(prompts), "new_tokens": n_new, "decode_s": decode,
            "native_pct": 100 * native / decode, "around_forward_pct": 100 * (phases - native) / decode,
            "controller_pct": 100 * (decode - phases) / decode, "tokens_per_step": tokens / max(1, steps),
            "host_ms_per_step": 1e3 * (decode - native) / max(1, steps)}


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(7.0, 0.7 * len(rows) + 4), 4.5))
    labels = [f"draft M={r['m']}" if r["case"] == "draft" else f"M={r['m']}" for r in rows]
    bottom = [0.0] * len(rows)
    colors = plt.get_cmap("tab20").colors
    for i, k in enumerate(PIECES):
        vals = [max(0.0, r[k]) for r in rows]
        ax.bar(labels, vals, bottom=bottom, label=k, color=colors[i % len(colors)])
        bottom = [b + v for b, v in zip(bottom, vals)]
    for x, (r, b) in enumerate(zip(rows, bottom)):
        name = "v" if r["case"] == "target" else "c" if r["m"] == 1 else "d"
        ax.text(x, b, f"{name}={r['ratio'] if name != 'd' else r['vs_m1']:.2f}", ha="center", va="bottom", fontsize=7)
    ax.set_ylabel("ms per step (median of each piece)")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def run(args) -> list[dict]:
    setup(args)
    ctx = print_header(args, "bench.breakdown: where a draft step and a target pass of M rows spend their time")
    eng = load_engine(args, parse_draft(args.draft))
    be, label = eng.backend, model_label(eng)
    byte_ratio = be.draft_bytes / be.target_bytes
    print(f"# model {label}, draft {args.draft}, context {args.context}, {args.reps} reps, "
          f"weight bytes draft/target {byte_ratio:.3f}", flush=True)
    samples: dict = {}
    step_costs(be, [m - 1 for m in args.ms if m > 1], args.context, args.reps, profiled_time_fn(be.model, samples),
               draft_ms=args.draft_ms)
    rows = case_rows(samples, args.ms, args.draft_ms)
    with JsonWriter(args.json, {**ctx, "model": label, "draft": args.draft, "context": args.context,
                                "reps": args.reps}) as out:
        for r in rows:
            out.write({**r, "byte_ratio": byte_ratio})
        print(fmt_table(rows, ["case", "m", "step_ms", *PIECES, "ratio", "vs_m1"]))
        print("# ms per step, median of each piece over the reps (they need not add up to the median "
              "step); ratio = step / target step at M=1 (c for the one-row draft step, v(M) for the "
              "target); vs_m1 = step / the same weights' one-row step (d(M) for the draft)", flush=True)
        ctl = controller_share(eng, dev_prompts(args.prompt_file, args.prompts), args.max_new)
        out.write({**ctl, "byte_ratio": byte_ratio})
    print(f"# speculative decode (prompts {ctl['prompts']} x {ctl['new_tokens']} new tokens, tau "
          f"{ctl['tokens_per_step']:.2f}): native forward {ctl['native_pct']:.1f}%, Python around the "
          f"draft/verify forwards {ctl['around_forward_pct']:.1f}%, rest of the controller "
          f"{ctl['controller_pct']:.1f}% ({ctl['host_ms_per_step']:.2f} ms host per step)")
    if args.plot:
        plot(rows, args.plot, f"{label}, draft {args.draft}, context {args.context}\n"
                              f"{args.threads} threads, {ctx['cpu']} ({ctx['isa']})")
    return rows + [ctl]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="qspec bench breakdown", parents=[parent_parser(), model_parser()],
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft", metavar="FMT[:HEAD]", type=_draft, default=None,
                   help="draft format[:LM head format] (default: the model's default draft)")
    p.add_argument("--context", type=positive_int, default=512, help="positions in the cache before each step (default 512)")
    p.add_argument("--ms", type=_ms, default=None,
                   help=f"rows per target pass, comma list in 1..{MAX_M} (default 1,2,3,4,5,6,8,12,16; quick 1,2,4)")
    p.add_argument("--draft-ms", type=_ms, default=None,
                   help=f"rows per draft pass (a tree or a second level checked by the draft), comma list in "
                        f"1..{MAX_M} (default 1,2,4,8; quick 1,4)")
    p.add_argument("--reps", type=positive_int, default=None, help="timed repetitions per case (default 15, quick 3)")
    p.add_argument("--prompts", type=positive_int, default=None, help="prompts of the speculative run (default 4, quick 2)")
    p.add_argument("--max-new", type=positive_int, default=None, help="new tokens per prompt there (default 64, quick 32)")
    args = p.parse_args(argv)
    for name, low in (("context", 1), ("reps", 1), ("prompts", 1), ("max_new", 2)):
        if getattr(args, name) is not None and getattr(args, name) < low:
            p.error(f"--{name.replace('_', '-')} must be >= {low}")
    args.draft = args.draft or default_draft_name(args)
    args.ms = args.ms or ([1, 2, 4] if args.quick else [1, 2, 3, 4, 5, 6, 8, 12, 16])
    args.draft_ms = sorted({1, *(args.draft_ms or ([1, 4] if args.quick else [1, 2, 4, 8]))})
    args.reps = args.reps or (3 if args.quick else 15)
    args.prompts = args.prompts or (2 if args.quick else 4)
    args.max_new = args.max_new or (32 if args.quick else 64)
    run(args)


if __name__ == "__main__":
    main()
