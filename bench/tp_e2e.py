"""Tensor parallelism end to end on this machine: `qspec bench tp --what e2e` (bench/tp.py).

For each world size (--worlds, default 1,2) a fresh process runs the model (for W > 1 it becomes
rank 0 and spawns the other ranks, as `qspec --tp W` does; one rank per core by default, W = 1
with all cores): per prompt, plain greedy decoding and then speculative decoding (the default
draft, --draft-max) on the same prompt, and on rank 0 the time of every forward and of its
collectives (row reductions, the command and the logits gather; waiting for a slower rank
included). World sizes alternate for --repeat rounds; the figures are medians over rounds.
The machine's read bandwidth is measured before and after (bench.membw's probe).
Greedy speculative output must equal greedy plain output at every world size: a mismatch aborts.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

from .common import JsonWriter, dev_prompts, fmt_table, positive_int

CHILD_FLAG = "--tp-e2e-child"


def _child(spec: dict) -> None:
    """One world size's run (rank 0 prints one JSON line; the followers serve inside load)."""
    import qspec
    from qspec.parallel.launch import spawn

    if spec["world"] > 1 and "WORLD_SIZE" not in os.environ:
        spawn(spec["world"], [sys.executable, "-m", __spec__.name, CHILD_FLAG, json.dumps(spec)])
    eng = qspec.load(spec["model"], threads=spec["threads"])
    be = eng.backend
    comm = getattr(be, "comm", None)
    prompts = spec["prompts"]
    eng.generate(prompts[0], max_new_tokens=8, speculative=False)  # warm-up
    out = {"world": spec["world"], "threads": qspec._C.get_num_threads(),
           "transport": "shm" if comm is not None and comm.shm is not None else ("gloo" if comm else "-"),
           "runs": []}
    for p in prompts:
        for mode in ("plain", "spec"):
            be.model.profile_reset()
            if comm is not None:
                comm.collective_s, comm.collectives = 0.0, 0
            kw = {"speculative": False} if mode == "plain" else {"draft_max": spec["draft_max"]}
            r = eng.generate(p, max_new_tokens=spec["max_new"], **kw)
            prof = be.model.profile()
            calls = max(1, prof["calls"])
            coll = prof["reduce_s"] + (comm.collective_s if comm is not None else 0.0)
            out["runs"].append({"prompt": prompts.index(p), "mode": mode, "tokens": r.tokens,
                                "tok_s": r.stats["tokens_per_s"], "forwards": prof["calls"],
                                "forward_ms": 1e3 * prof["total_s"] / calls, "coll_ms": 1e3 * coll / calls,
                                "reduce_ms": 1e3 * prof["reduce_s"] / calls,
                                "collectives": 2 * eng.cfg.n_layers + comm.collectives / calls if comm else 0})
    print(json.dumps(out), flush=True)


def _run_world(spec: dict) -> dict:
    p = subprocess.run([sys.executable, "-m", __spec__.name, CHILD_FLAG, json.dumps(spec)],
                       capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"bench tp e2e: world {spec['world']} failed: {p.stderr.strip()[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def run_e2e(args, writer: JsonWriter) -> list[dict]:
    from .tp import membw_reference

    worlds = [int(w) for w in str(args.worlds).split(",")]
    prompts = dev_prompts(args.prompt_file, 2 if args.quick else args.prompts)
    max_new = 24 if args.quick else args.max_new
    bw0 = membw_reference(args.threads or os.cpu_count() or 1)
    rounds: dict[int, list[dict]] = {w: [] for w in worlds}
    for _ in range(1 if args.quick else args.repeat):
        for w in worlds:
            spec = {"world": w, "model": args.model, "prompts": prompts, "max_new": max_new,
                    "draft_max": int(args.draft_max) if str(args.draft_max).isdigit() else args.draft_max, "threads": args.threads if w == 1 else None}
            rounds[w].append(_run_world(spec))
    bw1 = membw_reference(args.threads or os.cpu_count() or 1)
    rows = []
    for w in worlds:
        for mode in ("plain", "spec"):
            per_round = [[r for r in rd["runs"] if r["mode"] == mode] for rd in rounds[w]]
            toks = [sum(len(r["tokens"]) for r in runs) for runs in per_round]
            secs = [sum(len(r["tokens"]) / max(r["tok_s"], 1e-9) for r in runs) for runs in per_round]
            fwd = [r for runs in per_round for r in runs]
            n = sum(r["forwards"] for r in fwd) or 1
            rows.append({"world": w, "mode": mode, "transport": rounds[w][0]["transport"],
                         "threads/rank": rounds[w][0]["threads"],
                         "tok_s": statistics.median(t / s for t, s in zip(toks, secs)),
                         "forward_ms": sum(r["forward_ms"] * r["forwards"] for r in fwd) / n,
                         "coll_ms": sum(r["coll_ms"] * r["forwards"] for r in fwd) / n,
                         "collectives/fwd": statistics.median(r["collectives"] for r in fwd)})
            rows[-1]["coll_pct"] = 100 * rows[-1]["coll_ms"] / rows[-1]["forward_ms"]
        for rd in rounds[w]:  # losslessness at this world size
            plain = {r["prompt"]: r["tokens"] for r in rd["runs"] if r["mode"] == "plain"}
            bad = [r["prompt"] for r in rd["runs"] if r["mode"] == "spec" and r["tokens"] != plain[r["prompt"]]]
            if bad:
                raise SystemExit(f"bench tp e2e: world {w}: speculative output != plain on prompts {bad}")
    base = {r["mode"]: r["tok_s"] for r in rows if r["world"] == worlds[0]}
    for r in rows:
        r["vs_world1"] = r["tok_s"] / base[r["mode"]]
        plain = next(x for x in rows if x["world"] == r["world"] and x["mode"] == "plain")
        r["spec_speedup"] = r["tok_s"] / plain["tok_s"] if r["mode"] == "spec" else 1.0
        writer.write({"section": "e2e", **r, "membw_gbs_before": bw0, "membw_gbs_after": bw1,
                      "prompts": len(prompts), "max_new": max_new, "rounds": len(rounds[worlds[0]])})
    print(f"\ne2e: {len(prompts)} prompts x {max_new} tokens, greedy, {len(rounds[worlds[0]])} round(s) "
          f"alternating world sizes; read bandwidth {bw0:.1f} GB/s before, {bw1:.1f} GB/s after")
    print(fmt_table(rows, ["world", "mode", "transport", "threads/rank", "tok_s", "vs_world1", "spec_speedup",
                           "forward_ms", "coll_ms", "coll_pct", "collectives/fwd"]))
    print("coll_ms: rank 0's time per forward in row reductions, commands and logits gathers, waiting for "
          "a slower rank included; greedy speculative == plain checked at every world size")
    return rows


def add_e2e_args(p) -> None:
    p.add_argument("--worlds", default="1,2", help="e2e: world sizes, alternated (default 1,2)")
    p.add_argument("--prompts", type=positive_int, default=6, help="e2e: dev prompts (default 6)")
    p.add_argument("--max-new", type=positive_int, default=48, help="e2e: new tokens per prompt (default 48)")
    p.add_argument("--draft-max", default="auto", help="e2e: K of the speculative runs (default auto)")
    p.add_argument("--repeat", type=positive_int, default=3, help="e2e: rounds over the world sizes (default 3)")


if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] == CHILD_FLAG:
    _child(json.loads(sys.argv[2]))
