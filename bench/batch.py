"""Sequences served at once: plain vs speculative over a batch, in one run:
`qspec bench batch [--model NAME|DIR] [--prompt-file F] [--batch 4] [--settings plain,k8,auto,defaults]
[--rounds 3] [--max-new 64] [--threads N] [--quick] [--json PATH]` (or `python -m bench.batch ...` from
a development install).

Each round runs `Engine.generate_batch` of the same --batch prompts (spread over the prompt file)
once per setting, the settings interleaved (docs/benchmarking.md rule 1), greedy; every setting's
outputs are checked equal to plain's. A first batch of 8 tokens fills the prompt memo, so the rounds
skip prefill and a batch's wall time is its decode. Settings: plain (speculative=False), kN (the
chain, K = N), auto (the chain, draft_max auto), defaults (the engine's own: tree auto at the amx
level). Per setting and round: tokens/s in all (the batch's completion tokens / its wall time),
the forwards of the target and of the drafts and their mean rows (in step, the sequences verify in
one forward a round: qspec/batch.py). Summary per setting: median tokens/s over the rounds and the
speedup, the median over rounds of the ratio to plain in the same round. The cost models learn
across rounds (one engine), so the first round of an auto setting includes its exploration.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

from .common import (JsonWriter, dev_prompts, fmt_table, model_parser, parent_parser, positive_int,
                     print_header, setup)
from .models import load_engine, model_label
from qspec.speculative import DraftParams

NAMED = {"plain": dict(speculative=False), "auto": dict(tree="off"), "defaults": {}}


def _settings(s: str) -> list[str]:
    """"plain,k8,auto,defaults": each a named setting or kN with N a valid draft length (one
    argparse error line otherwise); plain is always run (the ratios' reference)."""
    names = [x for x in s.split(",") if x]
    for name in names:
        m = re.fullmatch(r"k(\d+)", name)
        if name not in NAMED and not m:
            raise argparse.ArgumentTypeError(f"{name!r}: not one of {', '.join(NAMED)} or kN")
        if m:
            try:
                DraftParams(draft_max=int(m.group(1)))
            except ValueError as e:
                raise argparse.ArgumentTypeError(f"{name!r}: {e}") from None
    return ["plain"] + [n for n in dict.fromkeys(names) if n != "plain"]


def setting_kwargs(name: str) -> dict:
    return NAMED[name] if name in NAMED else dict(tree="off", draft_max=int(name[1:]))


class ForwardLog:
    """Counts the batched forwards (Batcher steps' `backend.run` calls) per weight set and their
    rows, by wrapping `run` on the backend instance while a batch runs."""

    def __init__(self, be):
        self.be, self.inner = be, be.run
        self.forwards: dict[int, int] = {}
        self.rows: dict[int, int] = {}

    def __enter__(self):
        self.be.run = self
        return self

    def __exit__(self, *exc):
        del self.be.run

    def __call__(self, group, weight_set):
        self.forwards[weight_set] = self.forwards.get(weight_set, 0) + 1
        self.rows[weight_set] = self.rows.get(weight_set, 0) + sum(len(p.tokens) for p in group)
        return self.inner(group, weight_set)


def run(args) -> list[dict]:
    setup(args)
    ctx = print_header(args, f"{args.batch} sequences at once: plain vs speculative (generate_batch)")
    eng = load_engine(args, "auto")
    prompts = dev_prompts(args.prompt_file, args.batch)
    if len(prompts) < args.batch:
        prompts = (prompts * args.batch)[:args.batch]
    eng.generate_batch(prompts, 8)  # the prompt memo: the rounds below decode only
    label = model_label(eng)
    per: dict[str, list[dict]] = {name: [] for name in args.settings}
    with JsonWriter(args.json, ctx) as out:
        for rnd in range(args.rounds):
            plain_tokens = None
            for name in args.settings:
                with ForwardLog(eng.backend) as log:
                    t0 = time.perf_counter()
                    res = eng.generate_batch(prompts, args.max_new, **setting_kwargs(name))
                    wall = time.perf_counter() - t0
                tokens = [r.tokens for r in res]
                if name == "plain":
                    plain_tokens = tokens
                elif tokens != plain_tokens:
                    raise SystemExit(f"bench: error: {name}'s outputs differ from plain's (round {rnd})")
                row = {"model": label, "setting": name, "round": rnd, "batch": args.batch,
                       "tokens_per_s": sum(len(t) for t in tokens) / wall,
                       "target_forwards": log.forwards.get(0, 0), "target_rows": log.rows.get(0, 0),
                       "draft_forwards": sum(n for ws, n in log.forwards.items() if ws),
                       "draft_rows": sum(n for ws, n in log.rows.items() if ws)}
                per[name].append(row)
                out.write(row)
                print(f"  round {rnd} {name:>9}: {row['tokens_per_s']:6.2f} tok/s, target forwards "
                      f"{row['target_forwards']} ({row['target_rows']} rows), draft forwards "
                      f"{row['draft_forwards']} ({row['draft_rows']} rows)", flush=True)
        rows = []
        for name, rs in per.items():
            row = {"model": label, "setting": name, "batch": args.batch, "rounds": len(rs),
                   "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                   "speedup": statistics.median(r["tokens_per_s"] / p["tokens_per_s"] for r, p in zip(rs, per["plain"])),
                   "rows_per_target_forward": sum(r["target_rows"] for r in rs) / max(1, sum(r["target_forwards"] for r in rs)),
                   "rows_per_draft_forward": sum(r["draft_rows"] for r in rs) / max(1, sum(r["draft_forwards"] for r in rs))}
            rows.append(row)
            out.write(row)
    print(fmt_table(rows, ["model", "setting", "batch", "rounds", "tokens_per_s", "speedup",
                           "rows_per_target_forward", "rows_per_draft_forward"]))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, parents=[parent_parser(), model_parser()],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=positive_int, default=4, help="sequences at once (default 4)")
    ap.add_argument("--settings", type=_settings, default=None,
                    help="comma list of plain, kN, auto, defaults (default plain,k8,auto,defaults; quick plain,k4,defaults)")
    ap.add_argument("--rounds", type=positive_int, default=None, help="rounds of every setting (default 3, quick 1)")
    ap.add_argument("--max-new", type=positive_int, default=None, help="new tokens per sequence (default 64, quick 16)")
    args = ap.parse_args(argv)
    if args.batch < 1:
        ap.error(f"--batch must be >= 1, got {args.batch}")
    args.settings = args.settings or _settings("plain,k4,defaults" if args.quick else "plain,k8,auto,defaults")
    args.rounds = (1 if args.quick else 3) if args.rounds is None else args.rounds
    args.max_new = (16 if args.quick else 64) if args.max_new is None else args.max_new
    if args.rounds < 1 or args.max_new < 1:
        ap.error("--rounds and --max-new must be >= 1")
    run(args)


if __name__ == "__main__":
    main()
