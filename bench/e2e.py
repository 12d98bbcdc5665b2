"""End to end: plain BF16 vs speculative decoding in one run (docs/benchmarking.md rule 5):
`qspec bench e2e [--model NAME|DIR] [--prompt-file F] [--threads N] [--quick] [--json PATH] [--plot PATH]
[--drafts ...] [--ks ...] [--context N] [--draft-kv MODES]` (or `python -m bench.e2e ...` from a
development install).
A setting in --ks is K (1..32), "auto", or either with "@P" for draft_p_min = P (e.g.
`--ks 1,auto,auto@0.8`); without "@P" the engine's default draft_p_min applies.
An entry of --drafts is a draft chain (qspec/levels.py): level 1 (FORMAT[:LM_HEAD] or ngram), then
"+LEVEL" per level above it, e.g. `--drafts mxfp6_e2m3:mxfp6_e2m3,mxfp6_e2m3:mxfp6_e2m3+mxfp4+ngram,ngram`;
--ks sets level 1's K, the levels above choose theirs (auto; the sampling default when T > 0). Each
chain's rows add per-level acceptance (level<i>_acceptance_rate) and the share of level i-1's passes
it sat out (level<i>_skip_rate). `--prompt-file repetition` runs the prompts whose answers repeat
their own text (where n-gram drafting pays).

--model (default SmolLM2-135M; the benchmark of record is qwen2.5-coder-1.5b) over the prompt file
(default: the dev prompts), 128 new tokens, greedy and temperature 0.7: for each prompt
plain and every speculative setting run back to back (interleaved), so the ratios compare like
with like. Per setting: tokens/s (median over prompts of per-prompt tok/s), speedup = median of
per-prompt ratios to plain, total_speedup = all its decoded tokens over all its decode seconds
against plain's (a setting that wins big on a few prompts and loses a little on many has a total
above its median), acceptance (accepted / drafted), tau (tokens per verify step), and
the cost ratios measured directly at a fixed context: c = draft step / target step and
v(K) = verify of K+1 rows / target step. For a fixed K, two bounds put the measured speedup in
context: model = tau / (K c + v(K)) (docs/benchmarking.md: what the measured step costs allow, before host
overhead) and ceiling = tau / (K r + 1) with r = draft bytes / target bytes (what the same
acceptance would give if every pass ran at the memory-bandwidth floor). Synthetic-weight
Llama-3.2-1B shapes: c and v(K) only (speed, never acceptance). Peak RSS of plain vs speculative comes from separate processes.
The K settings run the chain (tree="off"). `--trees` adds draft trees (qspec/tree.py) from the
level-1 draft: for each fixed K a tree of width --tree-width at the same verify rows (N = K + 1,
depth K), and the cost model's choice (tree="auto": tree or chain, width, depth and N measured);
their rows report tree_rows (mean verify rows), tree_path (mean accepted path) and tau_vs_chain
(tau over the chain's tau at the same K).
`--context N`: instead of the prompt file, real long prompts of N tokens each (a Python
standard-library source file and a question about a function in it, bench/long_prompts.py), so
the speedup at long context is measured; c and v(K) are then measured at that context.
`--draft-kv int8,bf16`: each setting once per draft-KV mode (qspec.load(draft_kv=...): the MX
draft attends over the INT8 copy of the cache or the BF16 cache), reported in the draft_kv column;
`--draft-windows 0,2048` likewise per draft window (qspec.load(draft_window=...)), column draft_window;
`--draft-sparse 0,2048` per sparse draft attention budget (qspec.load(draft_sparse=...)), column
draft_sparse.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

from .common import (JsonWriter, TableStream, dev_prompts, fmt_table, model_parser, parent_parser,
                     positive_int, print_header, setup, time_interleaved)
from .models import (default_draft_name, load_engine, model_label, parse_chain_setting, parse_draft, step_costs,
                     synthetic_backend)
from .long_prompts import long_prompts
from qspec.cli import sparse_keys
from qspec.engine import DEFAULT_DRAFT_PARAMS
from qspec.native import DRAFT_KV_MODES
from qspec.speculative import DraftParams


def _ks(s: str) -> list[tuple]:
    """"1,auto,auto@0.8" -> [(1, None), ("auto", None), ("auto", 0.8)] (K, draft_p_min); each
    setting is checked by the engine's own DraftParams, so a bad one is one argparse error line."""
    out = []
    for item in s.split(","):
        k, _, p = item.partition("@")
        try:
            setting = (k if k == "auto" else int(k), float(p) if p else None)
            DraftParams(draft_max=setting[0], draft_p_min=setting[1] or 0.0)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{item!r}: {e}") from None
        out.append(setting)
    return out


def _lookups(s: str) -> list[str]:
    from qspec.lookup import LOOKUP_MODES

    out = list(dict.fromkeys(x.strip() for x in s.split(",")))
    bad = [x for x in out if x not in LOOKUP_MODES]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"lookup settings must be among {', '.join(LOOKUP_MODES)}, got {s!r}")
    return out


def _chains(s: str) -> list[str]:
    """Comma list of draft chains, each checked as qspec.load checks it (one argparse error line)."""
    out = s.split(",")
    for item in out:
        try:
            parse_chain_setting(item)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{item!r}: {e}") from None
    return out


def cost_ratios(be, ks: list[int], context: int, reps: int) -> dict:
    t = step_costs(be, ks, context, reps, time_interleaved)
    base = t["target"].median
    r = {"t_target_ms": 1e3 * base, "c": t["draft"].median / base if "draft" in t else None}
    r.update({f"v{k}": t[f"verify{k}"].median / base for k in ks})
    return r


def real_model(args, ctx, out: JsonWriter) -> list[dict]:
    n_prompts = args.prompts or (4 if args.quick else 24)
    n_new = args.max_new or (64 if args.quick else 128)
    rows = []
    table = TableStream(["draft", "draft_kv", "draft_window", "draft_sparse", "k", "draft_p_min", "tree", "lookup", "temperature", "tokens_per_s",
                         "speedup", "total_speedup", "acceptance_rate", "tokens_per_step", "c", "v", "model_speedup", "ceiling_speedup",
                         "tree_rows", "tree_path", "tau_vs_chain", "lookup_rows", "lookup_acceptance"], widths={"draft": 24})
    for dspec in args.drafts:
        spec, levels = parse_chain_setting(dspec)
        eng = load_engine(args, spec, levels)
        if args.context and args.context + n_new > eng.ctx_size:
            raise SystemExit(f"bench: error: --context {args.context} + {n_new} new tokens exceed the model's "
                             f"context of {eng.ctx_size} tokens")
        prompts = long_prompts(eng, args.context, n_prompts) if args.context else \
            dev_prompts(args.prompt_file, n_prompts)
        name = model_label(eng)
        fixed = sorted({k for k, _ in args.ks if k != "auto"})
        byte_ratio = eng.backend.draft_bytes / eng.backend.target_bytes
        eng.generate(prompts[0], max_new_tokens=16)  # warm-up
        windows = args.draft_windows or [eng.backend.draft_window]
        budgets = args.draft_sparse or [eng.backend.draft_sparse]
        # a draft window and a sparse budget are over the draft copy: none with the BF16 cache
        modes = list(dict.fromkeys((t, m, 0 if m == "bf16" else w, 0 if m == "bf16" else b)
                                   for m in args.draft_kv for w in windows for b in budgets for t in args.temps))
        for temp, draft_kv, window, budget in modes:
            if draft_kv != eng.backend.draft_kv:  # the pool's draft copy is made at load: a new engine
                del eng
                eng = load_engine(args, spec, levels, draft_kv)
                eng.generate(prompts[0], max_new_tokens=16)  # warm-up
            eng.backend.draft_window = window
            eng.backend.draft_sparse = budget
            cr = cost_ratios(eng.backend, fixed, args.context or 128, 5 if args.quick else 11)
            settings = [(k, pm, "off") for k, pm in args.ks]
            if args.trees:
                settings += [(k, None, "eq") for k in fixed] + [("auto", None, "auto")]
            settings = [(k, pm, tree, lk) for k, pm, tree in settings for lk in args.lookup]
            per = {k: {"tps": [], "ratio": [], "decode_s": 0.0, "drafted": 0, "accepted": 0, "steps": 0, "tokens": 0,
                       "tree_steps": 0, "tree_rows": 0, "tree_path": 0, "lookup_rows": 0, "lookup_accepted": 0,
                       "levels": {i: [0, 0, 0, 0] for i in range(2, len(eng.levels) + 1)}}
                   for k in ["plain"] + settings}
            for i, p in enumerate(prompts):
                kw = dict(max_new_tokens=n_new, temperature=temp, seed=i)
                base = eng.generate(p, speculative=False, **kw)
                per["plain"]["tps"].append(base.stats["tokens_per_s"])
                per["plain"]["tokens"] += base.stats["new_tokens"] - 1
                per["plain"]["decode_s"] += base.stats["decode_s"]
                for k, pm, tree, lk in settings:
                    tkw = (dict(tree="off") if tree == "off" else dict(tree="auto") if tree == "auto" else
                           dict(tree="on", tree_width=args.tree_width, tree_depth=k, tree_nodes=k + 1))
                    r = eng.generate(p, draft_max=k, draft_p_min=pm, lookup=lk, **tkw, **kw)
                    if temp == 0 and r.tokens != base.tokens:
                        raise SystemExit(f"LOSSLESSNESS VIOLATED: {dspec} K={k} p_min={pm} tree={tree} lookup={lk} "
                                         f"prompt {i}")
                    s, d = r.stats, per[(k, pm, tree, lk)]
                    for key in ("tree_steps", "tree_verify_rows", "tree_accepted", "lookup_rows", "lookup_accepted"):
                        d[{"tree_verify_rows": "tree_rows", "tree_accepted": "tree_path"}.get(key, key)] += s.get(key, 0)
                    d["tps"].append(s["tokens_per_s"])
                    d["ratio"].append(s["tokens_per_s"] / base.stats["tokens_per_s"])
                    d["decode_s"] += s["decode_s"]
                    d["drafted"] += s["drafted"]
                    d["accepted"] += s["accepted"]
                    d["steps"] += s["steps"]
                    d["tokens"] += s["new_tokens"] - 1
                    for i, acc in d["levels"].items():  # drafted, accepted, skipped, rounds
                        for j, key in enumerate(("drafted", "accepted", "skipped", "rounds")):
                            acc[j] += s[f"level{i}_{key}"]
            for key, d in per.items():
                if key == "plain":
                    row = {"mode": "plain", "draft": "none", "k": 0, "speedup": 1.0, "total_speedup": 1.0}
                else:
                    k, pm, tree, lk = key
                    pm = DEFAULT_DRAFT_PARAMS.draft_p_min if pm is None else pm
                    tau = d["tokens"] / max(1, d["steps"])
                    # every step drafts K (bar the last), by one draft whose step costs were measured
                    fixed_k = k != "auto" and pm == 0 and len(eng.levels) == 1 and cr["c"] is not None \
                        and tree == "off"
                    chain = per.get((k, None, "off", lk)) if tree == "eq" else None
                    row = {"mode": "speculative", "draft": dspec, "k": k, "draft_p_min": pm,
                           "tree": {"off": "chain", "eq": f"w{args.tree_width} N=K+1", "auto": "auto"}[tree],
                           "lookup": lk, "lookup_rows": d["lookup_rows"] / max(1, d["steps"]),
                           "lookup_acceptance": d["lookup_accepted"] / d["lookup_rows"] if d["lookup_rows"] else None,
                           "tree_rows": d["tree_rows"] / d["tree_steps"] if d["tree_steps"] else None,
                           "tree_path": d["tree_path"] / d["tree_steps"] if d["tree_steps"] else None,
                           "tau_vs_chain": tau * chain["steps"] / max(1, chain["tokens"]) if chain else None,
                           "speedup": statistics.median(d["ratio"]),
                           "total_speedup": d["tokens"] / d["decode_s"] * per["plain"]["decode_s"] / per["plain"]["tokens"],
                           "acceptance_rate": d["accepted"] / max(1, d["drafted"]),
                           "tokens_per_step": tau, "c": cr["c"], "v": cr.get(f"v{k}"),
                           "model_speedup": tau / (k * cr["c"] + cr[f"v{k}"]) if fixed_k else None,
                           "ceiling_speedup": tau / (k * byte_ratio + 1) if fixed_k else None,
                           "byte_ratio": byte_ratio}
                    for i, (drafted, accepted, skipped, rounds) in d["levels"].items():
                        row[f"level{i}_acceptance_rate"] = accepted / max(1, drafted)
                        row[f"level{i}_skip_rate"] = skipped / max(1, rounds)
                row.update(model=name, weights="real", temperature=temp, draft_kv=draft_kv, draft_window=window,
                           draft_sparse=budget,
                           context=args.context or None,
                           tokens_per_s=statistics.median(d["tps"]), prompts=len(prompts), new_tokens=n_new,
                           threads=args.threads)
                rows.append(row)
                out.write(row)
                print(table.line(row)
                      + "".join(f"  L{i}: acc {row[f'level{i}_acceptance_rate']:.2f} skip {row[f'level{i}_skip_rate']:.2f}"
                                for i in range(2, len(eng.levels) + 1) if f"level{i}_skip_rate" in row),
                      flush=True)
        del eng
    return rows


def synthetic(args, ctx, out: JsonWriter) -> list[dict]:
    rows = []
    fixed = sorted({k for k, _ in args.ks if k != "auto"})
    level1 = dict.fromkeys(d.split("+")[0] for d in args.drafts)  # the MX drafts at level 1, once each
    for dspec in [d for d in level1 if d != "ngram"]:
        be = synthetic_backend("llama-3.2-1b", parse_draft(dspec), max_seq=512)
        cr = cost_ratios(be, fixed, 256, 5)
        for k in fixed:
            row = {"model": "Llama-3.2-1B shapes (synthetic weights)", "weights": "synthetic",
                   "mode": "cost", "draft": dspec, "k": k, "c": cr["c"], "v": cr[f"v{k}"],
                   "t_target_ms": cr["t_target_ms"], "threads": args.threads}
            rows.append(row)
            out.write(row)
        print(fmt_table(rows[-len(fixed):], ["model", "draft", "k", "c", "v", "t_target_ms"]), flush=True)
        del be
    return rows


def peak_rss(args) -> dict:
    """Peak RSS (MB) of plain vs speculative generation, each in a fresh process."""
    res = {}
    for mode in ("plain", "speculative"):
        cmd = [sys.executable, "-m", __spec__.name, "--rss-probe", mode, "--drafts", args.drafts[0],
               "--threads", str(args.threads), "--prompt-file", args.prompt_file]
        if args.model:
            cmd += ["--model", args.model]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            err = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise SystemExit(f"bench: error: peak-RSS probe ({mode}) failed: {err}")
        res[mode] = float(proc.stdout.split()[-1])
    return res


def rss_probe(args) -> None:
    setup(args)
    spec, levels = parse_chain_setting(args.drafts[0])
    eng = load_engine(args, None, ()) if args.rss_probe == "plain" else load_engine(args, spec, levels)
    eng.generate(dev_prompts(args.prompt_file)[0], max_new_tokens=64)
    # VmHWM, not ru_maxrss: ru_maxrss survives exec, so a child reports its parent's peak
    hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    print(int(hwm.split()[1]) / 1024)


def plot(rows: list[dict], path: str, ctx: dict, model: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    spec = [r for r in rows if r.get("mode") == "speculative"]
    def key(r: dict) -> tuple:
        return r["draft"], r["temperature"], r["draft_p_min"], r["tree"], r.get("lookup", "auto")

    for (draft, temp, pm, tree, lk) in sorted({key(r) for r in spec}):
        pts = [r for r in spec if key(r) == (draft, temp, pm, tree, lk) and r["k"] != "auto"]
        if not pts:
            continue
        lab = f"{draft}, T={temp}" + (f", p_min={pm}" if pm else "") + ("" if tree == "chain" else f", tree {tree}") \
            + ("" if lk == "auto" else f", lookup {lk}")
        line, = a1.plot([r["k"] for r in pts], [r["speedup"] for r in pts], "o-", label=lab)
        ceil = [r for r in pts if r.get("ceiling_speedup")]
        if ceil:
            a1.plot([r["k"] for r in ceil], [r["ceiling_speedup"] for r in ceil], ":", color=line.get_color(),
                    label=f"{lab}: bandwidth ceiling")
        a2.plot([r["k"] for r in pts], [r["tokens_per_step"] for r in pts], "o-", label=lab)
    a1.axhline(1.0, color="k", ls="--", lw=1)
    a1.set_xlabel("K (draft_max)")
    a1.set_ylabel("speedup vs plain BF16 (same run)")
    a2.set_xlabel("K (draft_max)")
    a2.set_ylabel("tau: tokens per verify step")
    for a in (a1, a2):
        a.legend(fontsize=8)
        a.grid(alpha=0.3)
    fig.suptitle(f"{model}, {ctx['threads']} threads, {ctx['cpu']} ({ctx['isa']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def _windows(s: str) -> list[int]:
    """"0,2048" -> [0, 2048]: draft windows, each an integer >= 0."""
    try:
        ws = [int(x) for x in s.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: expected a comma list of integers") from None
    if any(w < 0 for w in ws):
        raise argparse.ArgumentTypeError(f"{s!r}: every window must be >= 0")
    return ws


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="qspec bench e2e", parents=[parent_parser(), model_parser()], description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafts", type=_chains, default=None,
                   help="comma list of draft chains: FORMAT[:LM_HEAD_FORMAT] or ngram, then +LEVEL per level "
                   "above it (e.g. mxfp6_e2m3:mxfp6_e2m3+mxfp4+ngram; default: the engine's default draft)")
    p.add_argument("--ks", type=_ks, default=None,
                   help="comma list of K, auto, K@P or auto@P (P = draft_p_min; default 1..8,auto)")
    p.add_argument("--temps", type=lambda s: [float(t) for t in s.split(",")], default=[0.0, 0.7])
    p.add_argument("--prompts", type=positive_int, default=None, help="prompts (default 24, quick 4)")
    p.add_argument("--max-new", type=positive_int, default=None, help="new tokens per prompt (default 128, quick 64)")
    p.add_argument("--no-synthetic", action="store_true")
    p.add_argument("--trees", action="store_true",
                   help="add draft trees: at N = K + 1 verify rows per fixed K, and the cost model's choice")
    p.add_argument("--lookup", type=_lookups, default=["auto"],
                   help="prompt-lookup candidates in the verify, comma-separated settings side by side: auto, off "
                   "(default: auto, the engine's default)")
    p.add_argument("--tree-width", type=positive_int, default=3, choices=range(1, 9), metavar="1..8",
                   help="width of the --trees rows at N = K + 1 (default 3)")
    p.add_argument("--context", type=positive_int, default=None, metavar="N",
                   help="real long prompts of N tokens (standard-library source + a question) instead of "
                   "the prompt file")
    p.add_argument("--draft-kv", type=lambda s: s.split(","), default=["auto"],
                   help="comma list of draft KV modes to compare: auto, int8, int4, bf16 (default auto)")
    p.add_argument("--draft-windows", type=_windows, default=None,
                   help="comma list of draft windows to compare (qspec.load(draft_window=N): the drafts attend the "
                   "first 64 and the N most recent tokens over the draft KV copy; 0 = every token; default: the "
                   "engine's)")
    p.add_argument("--draft-sparse", type=lambda s: [sparse_keys(x) for x in s.split(",")], default=None,
                   help="comma list of sparse draft attention budgets to compare (qspec.load(draft_sparse=N): "
                   "over the INT4 copy each draft row attends about N tokens of its pages; 0 = every page; "
                   "default: the engine's)")
    p.add_argument("--rss-probe", choices=("plain", "speculative"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.context is not None and args.context < 64:
        p.error("--context must be at least 64 tokens")
    if bad := [m for m in args.draft_kv if m not in DRAFT_KV_MODES]:
        p.error(f"--draft-kv: {bad[0]!r} is not one of {', '.join(DRAFT_KV_MODES)}")
    if args.drafts is None:
        args.drafts = [default_draft_name(args)]
    if args.ks is None:
        args.ks = _ks("1,2,4,auto" if args.quick else "1,2,3,4,5,6,7,8,auto")
    if args.rss_probe:
        return rss_probe(args)
    setup(args)
    ctx = print_header(args, "bench.e2e: plain BF16 vs self-speculative decoding")
    with JsonWriter(args.json, ctx) as out:
        rss = peak_rss(args)  # first: separate processes, nothing else loaded
        rows = real_model(args, ctx, out)
        if not args.quick and not args.no_synthetic:
            rows += synthetic(args, ctx, out)
        r = {"mode": "memory", "draft": args.drafts[0], "peak_rss_plain_mb": rss["plain"],
             "peak_rss_speculative_mb": rss["speculative"], "ratio": rss["speculative"] / rss["plain"]}
        out.write(r)
        print(f"# peak RSS plain {rss['plain']:.0f} MB, speculative {rss['speculative']:.0f} MB "
              f"({r['ratio']:.2f}x)")
    if args.plot:
        plot(rows, args.plot, ctx, next((r["model"] for r in rows if r.get("weights") == "real"), "?"))


if __name__ == "__main__":
    main()
