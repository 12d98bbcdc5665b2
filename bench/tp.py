"""Tensor parallelism: what its collectives cost here, and a paper model of sockets and hosts:
`qspec bench tp [--what collectives,projection,e2e] [--world N] [--transport shm,gloo] [--reps N]
[--quick] [--json PATH] [projection options]` (or `python -m bench.tp ...` from a development
install).

collectives  W local ranks (--world, default 2; one thread each, placed by
             qspec.parallel.topology) on loopback time the collectives a TP forward runs, through
             the engine's own qspec.parallel.comm.Comm, once per transport (--transport: shm, the
             shared-memory group ranks on one host use, and gloo, what runs between hosts).
             Each rep runs from a common start (shm: a one-float reduction; gloo: a barrier; both
             untimed) to the end of the op on its slowest rank; median / p10 / p90 of --reps
             (default 200) after 20 warm-up reps:
               reduce   the ordered row reduction after a row-parallel layer (every rank gets the
                        others' [m, d] float32 partials and adds all of them in rank order;
                        m in 1, 5, 9, 16; d in 576, 1536, 4096, 8192), called from Python (the
                        forward calls the shm group from C++: ~1 us less)
               gather   the logits gather of [m, vocab/W] float32 slices to rank 0
                        (vocab 151936 and 128256; m in 1, 9)
               command  rank 0's FORWARD command to the followers with 1 or 9 token ids
e2e          The model end to end at world sizes --worlds (default 1,2), alternated --repeat
             times: plain and speculative tok/s and rank 0's time in collectives per forward
             (bench/tp_e2e.py; --model, --prompts, --max-new, --draft-max).
projection   A PROJECTION, not a measurement: decode step time and tok/s of Llama-3.1-8B and
             -70B shapes on 1 socket, 2 sockets (TP 2) and 2 or 4 hosts of 2 sockets (TP 4, 8).
             Assumptions (printed with the table):
             - decode is memory-bound: a forward of m rows streams each rank's weight shard once
               (BF16 target 16 bits, MXFP4 draft 4.25 bits per weight, LM head included) and
               its share of the BF16 KV cache at --context positions, at --socket-gbs per socket
               (one rank per socket; default 250 GB/s = 8-channel DDR5-4800, 307 GB/s peak, at
               ~80%); compute and the embedding lookup are ignored, so a verify of K+1 rows costs
               one plain step's bytes;
             - per forward: 2 x layers row reductions of [m, hidden], 1 logits gather of
               [m, vocab/TP] to rank 0, 1 command; between sockets of a host each costs what
               the shared-memory transport measured here for its size (a Theil-Sen line
               a + b * bytes through the medians of the collectives section at W = 2, measured
               now if that section does not run), or --intra-latency-us;
             - between hosts each adds --net-latency-us (default 25) plus its bytes through one
               host's NIC at --net-gbps (default 100 Gb/s): a reduction sends every rank's
               partial to each rank of the other hosts, the gather brings the remote hosts'
               vocab slices to rank 0; network and intra-host parts are not overlapped (this
               models a transport that uses shared memory within a host; the engine today runs
               all its collectives on gloo once the ranks span hosts);
             - speculative step: K (--k, 8) draft steps of one row with the MXFP4 weights, each
               with the same collectives, and a verify of K+1 rows; speedup over plain decoding
               on the same ranks = tau / (K c + v), tau = --tau (default 6.4: the measured MXFP4
               K=8 tau of qwen2.5-coder-1.5b), c = draft step / plain step, v = verify / plain step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from qspec.errors import TensorParallelError
from qspec.parallel.comm import FORWARD, HEADER

from .common import (JsonWriter, fmt_table, free_port, model_parser, parent_parser, positive_float,
                     positive_int, print_header, setup)
from .tp_e2e import add_e2e_args, run_e2e

REDUCE_M, REDUCE_D = (1, 5, 9, 16), (576, 1536, 4096, 8192)
GATHER_M, GATHER_VOCAB = (1, 9), (151936, 128256)
COMMAND_TOKENS = (1, 9)  # a decode step's command and a K = 8 verify's
F32 = 4


# ------------------------------------------------------------------------------- collectives
def collective_cases(quick: bool, world: int) -> list[dict]:
    """The cases of the collectives section, each with its bytes per message."""
    ms, ds = ((1, 9), (1536, 8192)) if quick else (REDUCE_M, REDUCE_D)
    cases = [{"op": "reduce", "m": m, "d": d, "bytes": m * d * F32} for m in ms for d in ds]
    for v in GATHER_VOCAB[:1] if quick else GATHER_VOCAB:
        cases += [{"op": "gather", "m": m, "vocab": v, "bytes": m * (-(-v // world)) * F32} for m in GATHER_M]
    return cases + [{"op": "command", "m": m, "bytes": (HEADER + m) * 8} for m in COMMAND_TOKENS]


PER_FORWARD = ("qwen2.5-coder-1.5b", 28, 1536, 151936)  # model, layers, hidden, vocab


def per_forward(rows: list[dict]) -> list[dict]:
    """Collective time of one forward of the PER_FORWARD model at m = 1 and 9 from the medians of
    `rows`, per transport (where its sizes were measured)."""
    model, layers, hidden, vocab = PER_FORWARD
    med = {(r["transport"], r["op"], r["m"], r.get("d") or r.get("vocab")): r["median_us"] for r in rows}
    out = []
    for t in dict.fromkeys(r["transport"] for r in rows):
        for m in (1, 9):
            keys = [(t, "reduce", m, hidden), (t, "gather", m, vocab), (t, "command", m, None)]
            if all(k in med for k in keys):
                us = 2 * layers * med[keys[0]] + med[keys[1]] + med[keys[2]]
                out.append({"op": "per_forward", "transport": t, "model": model, "layers": layers, "hidden": hidden,
                            "m": m, "per_forward_us": us})
    return out


def _op(case: dict, comm):
    """This rank's timed call of one case through the engine's collectives (qspec.parallel.comm):
    run() -> seconds (inputs refilled untimed), and a check of the last result."""
    rank, world = comm.rank, comm.world
    m = case["m"]
    if case["op"] == "reduce":
        x = np.empty((m, case["d"]), np.float32)
        reduce = comm.shm.reduce if comm.shm is not None else comm.reduce_rows  # the forward's reducer

        def run():
            x.fill(rank + 1)
            _sync(comm)
            t0 = time.perf_counter()
            reduce(x)
            return time.perf_counter() - t0
        return run, lambda: bool((x == world * (world + 1) / 2).all())
    if case["op"] == "gather":
        width = -(-case["vocab"] // world)
        columns = [(r * width, min((r + 1) * width, case["vocab"])) for r in range(world)]
        local = np.full((m, columns[rank][1] - columns[rank][0]), rank + 1, np.float32)
        out = np.zeros((m, case["vocab"]), np.float32) if rank == 0 else None

        def run():
            _sync(comm)
            t0 = time.perf_counter()
            comm.gather_logits(local, out, columns)
            return time.perf_counter() - t0
        return run, lambda: rank > 0 or all(bool((out[:, lo:hi] == r + 1).all()) for r, (lo, hi) in enumerate(columns))
    tokens = np.arange(100, 100 + m, dtype=np.int64)
    got = []

    def run():  # a forward's command: position, rows, which weights; the token ids as payload
        _sync(comm)
        t0 = time.perf_counter()
        if rank == 0:
            comm.send(FORWARD, (512, m, 1), tokens)
        else:
            got[:] = [comm.receive()]
        return time.perf_counter() - t0
    return run, lambda: rank == 0 or (got[0][0] == FORWARD and got[0][1][:3] == [512, m, 1]
                                      and list(got[0][2]) == list(tokens))


def _sync(comm) -> None:
    """The common start of a rep: a one-float reduction through the transport itself (a spin on
    shared memory: the ranks leave it within microseconds), or gloo's barrier."""
    if comm.shm is not None:
        comm.shm.reduce(np.zeros(1, np.float32))
    else:
        comm._dist.barrier()


def _rank_main(rank: int, spec: dict) -> None:
    """One rank of the collectives run (a process of its own: RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT and QSPEC_TP_TRANSPORT set); rank 0 writes the results as JSON to spec["out"]."""
    import torch

    from qspec.parallel.comm import Comm
    from qspec.parallel.topology import apply, place

    world, reps, warmup, cases = spec["world"], spec["reps"], spec["warmup"], spec["cases"]
    torch.set_num_threads(1)
    comm = Comm()
    if comm.problem:
        raise TensorParallelError(comm.problem)
    placement = place(rank, world)
    apply(placement)  # after the group is up, as the engine's ranks (qspec/parallel/launch.py)
    try:
        width = max([-(-c["vocab"] // world) for c in cases if c["op"] == "gather"] or [1])
        transport = comm.open_shm(max([c.get("d", 1) for c in cases]), width, max(COMMAND_TOKENS))
        results = []
        for case in cases:
            run, check = _op(case, comm)
            for _ in range(warmup):
                run()
            if not check():
                raise RuntimeError(f"rank {rank}: wrong result of {case}")
            ts = [run() for _ in range(reps)]
            every = comm.exchange(ts)
            results.append({**case, "slowest": [max(t) for t in zip(*every)], "rank0": ts})
        placements = comm.exchange([placement.cpus, placement.pin])
        if rank == 0:
            with open(spec["out"], "w") as f:
                json.dump({"results": results, "placements": placements, "transport": transport}, f)
    finally:
        comm.close()


def _spawn(world: int, spec: dict, tmp: str) -> None:
    """Run _rank_main in `world` processes on loopback; TensorParallelError (with the failing rank's
    last stderr line) if one fails or all have not finished in time; the others are ended."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world),
               LOCAL_WORLD_SIZE=str(world), QSPEC_TP_TRANSPORT=spec["transport"])
    module = __spec__.name if __spec__ else __name__
    code = f"import json, sys; from {module} import _rank_main; _rank_main(int(sys.argv[1]), json.loads(sys.argv[2]))"
    logs = [open(os.path.join(tmp, f"rank{r}.err"), "w+") for r in range(world)]
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r), json.dumps(spec)], stdout=subprocess.DEVNULL,
                              stderr=logs[r], env=dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in range(world)]
    deadline = time.monotonic() + 120 + 0.05 * spec["reps"] * len(spec["cases"])
    try:
        while any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        for r, p in enumerate(procs):
            if p.poll() is None:
                p.kill()
                p.wait()
                if not failed:
                    raise TensorParallelError(f"the collectives run did not finish in time (rank {r} still running)")
            elif p.returncode:
                logs[r].seek(0)
                lines = [x for x in logs[r].read().splitlines() if x.strip()]
                raise TensorParallelError(f"rank {r} of the collectives run failed: {lines[-1] if lines else p.returncode}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()


def measure(world: int, cases: list[dict], reps: int, transport: str = "shm", warmup: int = 20) -> tuple[list[dict], dict]:
    """Spawn `world` ranks on loopback with QSPEC_TP_TRANSPORT=transport and time `cases`; one
    row per case (microseconds: median, p10, p90 of the slowest rank per rep, rank 0's median)
    and {"placements": [[cpus, pinned] by rank], "transport": what the ranks used}."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tp.json")
        spec = {"world": world, "cases": cases, "reps": reps, "warmup": warmup, "out": path, "transport": transport}
        _spawn(world, spec, tmp)
        with open(path) as f:
            got = json.load(f)
    rows = []
    for r in got["results"]:
        q = statistics.quantiles(r.pop("slowest"), n=10, method="inclusive")
        rows.append({**r, "transport": got["transport"], "median_us": 1e6 * q[4], "p10_us": 1e6 * q[0],
                     "p90_us": 1e6 * q[8], "rank0_median_us": 1e6 * statistics.median(r.pop("rank0")),
                     "world": world, "reps": reps})
    return rows, {"placements": got["placements"], "transport": got["transport"]}


def run_collectives(args, writer: JsonWriter) -> list[dict]:
    print(f"\n## collectives: {args.world} ranks on loopback, 1 thread each, through qspec.parallel.comm "
          f"(transports: {', '.join(args.transports)}); per case {args.reps} reps after 20 warm-up, each from a "
          "common start (shm: a one-float reduction; gloo: a barrier) to the op's end on its slowest rank; "
          "reductions called from Python (the forward calls the shm group from C++)", flush=True)
    rows = []
    for transport in args.transports:
        got, info = measure(args.world, collective_cases(args.quick, args.world), args.reps, transport)
        print(f"# {transport}: the ranks used {info['transport']}; placements (cpus, pinned) by rank: "
              + ", ".join(f"{c} {'pinned' if p else 'unpinned'}" for c, p in info["placements"]), flush=True)
        rows += got
    for r in rows:
        writer.write({"section": "collectives", **r})
    table = [{**r, "size": f"[{r['m']}, {r.get('d') or -(-r['vocab'] // args.world)}]" if "d" in r or "vocab" in r
              else f"{r['m']} tokens"} for r in rows]
    print(fmt_table(table, ["transport", "op", "size", "bytes", "median_us", "p10_us", "p90_us", "rank0_median_us"]),
          flush=True)
    for r in per_forward(rows):
        writer.write({"section": "collectives", **r})
        print(f"# per forward of {r['model']} ({r['layers']} layers: {2 * r['layers']} reductions of [{r['m']}, "
              f"{r['hidden']}], 1 logits gather, 1 command), {r['transport']}: {r['per_forward_us']:.0f} us")
    if args.world == 2:
        args.measured = rows
    if args.plot:
        plot(rows, args.plot, f"{args.world} ranks on loopback, 1 thread each")
    return rows


def plot(rows: list[dict], path: str, title: str) -> None:
    """Median (bars: p10..p90) microseconds against bytes, one line per transport and op."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for key in sorted({(r["transport"], r["op"]) for r in rows}):
        pts = sorted((r for r in rows if (r["transport"], r["op"]) == key), key=lambda r: r["bytes"])
        ax.errorbar([r["bytes"] for r in pts], [r["median_us"] for r in pts], fmt="o-", capsize=2, label=" ".join(key),
                    yerr=[[r["median_us"] - r["p10_us"] for r in pts], [r["p90_us"] - r["median_us"] for r in pts]])
    ax.set(xscale="log", yscale="log", xlabel="bytes per rank", ylabel="us (median, p10..p90)", title=title)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


# ------------------------------------------------------------------------------- projection
@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    head_dim: int = 128

    def gemm_weights(self) -> int:
        """Weights every decode step streams: QKV, O, gate, up, down of every layer + LM head."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate
        return self.layers * per_layer + self.vocab * self.hidden

    def kv_bytes(self, context: int) -> int:
        """BF16 K and V of `context` positions, all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * context * 2


SHAPES = (Shape("Llama-3.1-8B", 4096, 14336, 32, 32, 8, 128256),
          Shape("Llama-3.1-70B", 8192, 28672, 80, 64, 8, 128256))


@dataclass(frozen=True)
class Setup:
    name: str
    hosts: int
    sockets: int  # per host; one rank per socket

    @property
    def ranks(self) -> int:
        return self.hosts * self.sockets


SETUPS = (Setup("1 socket", 1, 1), Setup("2 sockets", 1, 2), Setup("2 hosts", 2, 2), Setup("4 hosts", 4, 2))


class Links:
    """What a collective costs. intra(op, nbytes): between the sockets of one host, a constant
    (--intra-latency-us) or a line a + b * bytes through the medians measured for that op with
    the shared-memory transport (gloo's when shm was not measured), fitted by Theil-Sen (the
    median of the pairwise slopes, b >= 0, then the median intercept: a few sizes disturbed by
    other load do not bend it); between hosts net_s + bytes / net_Bps more."""

    def __init__(self, measured: list[dict] | None, intra_us: float | None, net_us: float, net_gbps: float):
        self.net_s, self.net_Bps = net_us * 1e-6, net_gbps * 1e9 / 8
        self.const = None if intra_us is None else intra_us * 1e-6
        rows = measured or []
        self.transport = "shm" if any(r["transport"] == "shm" for r in rows) else "gloo"
        points: dict = {}
        for r in rows:
            if r["transport"] == self.transport:
                points.setdefault(r["op"], []).append((r["bytes"], r["median_us"] * 1e-6))
        self.lines = {op: theil_sen(pts) for op, pts in points.items()}

    def intra(self, op: str, nbytes: float) -> float:
        if self.const is not None:
            return self.const
        a, b = self.lines[op]
        return max(0.0, a + b * nbytes)


def theil_sen(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope >= 0) of the Theil-Sen line through (x, y) points."""
    slopes = [(y1 - y0) / (x1 - x0) for i, (x0, y0) in enumerate(points) for x1, y1 in points[i + 1:] if x1 != x0]
    b = max(0.0, statistics.median(slopes)) if slopes else 0.0
    return statistics.median(y - b * x for x, y in points), b


def comm_s(shape: Shape, setup: Setup, m: int, links: Links, command_bytes: int) -> float:
    """Collectives of one forward of m rows: 2 x layers reductions, 1 logits gather, 1 command."""
    if setup.ranks == 1:
        return 0.0
    red_b = m * shape.hidden * F32
    slice_b = m * -(-shape.vocab // setup.ranks) * F32
    red, gat, cmd = links.intra("reduce", red_b), links.intra("gather", slice_b), links.intra("command", command_bytes)
    if setup.hosts > 1:
        remote = setup.ranks - setup.sockets  # ranks on other hosts
        red += links.net_s + setup.sockets * remote * red_b / links.net_Bps
        gat += links.net_s + remote * slice_b / links.net_Bps
        cmd += links.net_s
    return 2 * shape.layers * red + gat + cmd


def step_s(shape: Shape, setup: Setup, m: int, bits: float, links: Links, socket_gbs: float, context: int,
           command_bytes: int) -> tuple[float, float]:
    """(memory seconds, collective seconds) of one forward of m rows with `bits` per weight."""
    nbytes = (shape.gemm_weights() * bits / 8 + shape.kv_bytes(context)) / setup.ranks
    return nbytes / (socket_gbs * 1e9), comm_s(shape, setup, m, links, command_bytes)


def project(shape: Shape, setup: Setup, links: Links, *, socket_gbs: float, context: int, k: int, tau: float,
            draft_bits: float, command_bytes: int) -> dict:
    """One row of the projection: plain and speculative decode of `shape` on `setup`."""
    def total(m, bits):
        mem, comm = step_s(shape, setup, m, bits, links, socket_gbs, context, command_bytes)
        return mem, comm, mem + comm

    mem, comm, t = total(1, 16)
    d_mem, d_comm, d = total(1, draft_bits)
    _, v_comm, v = total(k + 1, 16)
    c, vr = d / t, v / t
    return {"projection": True, "model": shape.name, "setup": setup.name, "tp": setup.ranks,
            "gb_per_rank": shape.gemm_weights() * 2 / setup.ranks / 1e9,
            "mem_ms": 1e3 * mem, "comm_ms": 1e3 * comm, "step_ms": 1e3 * t, "plain_tok_s": 1 / t,
            "draft_ms": 1e3 * d, "verify_ms": 1e3 * v, "c": c, "v": vr, "speedup": tau / (k * c + vr),
            "spec_tok_s": tau / (k * d + v), "comm_share_spec": (k * d_comm + v_comm) / (k * d + v)}


def membw_reference(threads: int) -> float:
    """This machine's read bandwidth (GB/s) by bench.membw's native probe (its default 512 MiB
    buffer), best of 3 passes."""
    from qspec import _C

    p = _C.ReadProbe(512 << 20, threads)
    return p.nbytes / min(p.run(3)) / 1e9


def run_projection(args, writer: JsonWriter) -> list[dict]:
    command_bytes = (HEADER + COMMAND_TOKENS[-1]) * 8
    measured = getattr(args, "measured", None)
    if args.intra_latency_us is None and measured is None:
        print("\n## shared-memory latencies for the projection (2 ranks, the sizes it needs)", flush=True)
        cases = [{"op": "reduce", "m": m, "d": d, "bytes": m * d * F32} for m in (1, args.k + 1)
                 for d in sorted({s.hidden for s in SHAPES})]
        cases += [{"op": "gather", "m": m, "vocab": v, "bytes": m * (-(-v // 2)) * F32} for m in (1, args.k + 1)
                  for v in sorted({s.vocab for s in SHAPES})]
        cases += [{"op": "command", "m": m, "bytes": (HEADER + m) * 8} for m in COMMAND_TOKENS]
        measured, _ = measure(2, cases, args.reps, "shm")
        print(fmt_table(measured, ["transport", "op", "bytes", "median_us", "p10_us", "p90_us"]), flush=True)
    links = Links(measured, args.intra_latency_us, args.net_latency_us, args.net_gbps)
    intra = (f"{args.intra_latency_us:g} us per collective" if args.intra_latency_us is not None
             else f"a + b * bytes through the {links.transport} medians measured above (2 ranks on this machine): "
             + ", ".join(f"{op} {a * 1e6:.1f} us + {b * 1e12:.0f} us/MB" for op, (a, b) in links.lines.items()))
    here = membw_reference(args.threads)
    print(f"\n## PROJECTION (a paper model, not a measurement; assumptions in `qspec bench tp --help`)\n"
          f"# per socket {args.socket_gbs:g} GB/s (this machine, bench.membw read probe, {args.threads} threads: "
          f"{here:.1f} GB/s, for reference only); between sockets: {intra}; between hosts that plus "
          f"{args.net_latency_us:g} us + bytes at {args.net_gbps:g} Gb/s\n"
          f"# weights BF16 target, MXFP4 draft {args.draft_bits:g} bits (LM head included); KV cache at "
          f"{args.context} positions; compute ignored (a verify of {args.k + 1} rows streams the weights once); "
          f"K = {args.k}, tau = {args.tau:g}; speedup = tau / (K c + v) over plain decoding on the same ranks",
          flush=True)
    rows = [project(s, st, links, socket_gbs=args.socket_gbs, context=args.context, k=args.k, tau=args.tau,
                    draft_bits=args.draft_bits, command_bytes=command_bytes) for s in SHAPES for st in SETUPS]
    for r in rows:
        writer.write({"section": "projection", **r, "socket_gbs": args.socket_gbs, "membw_here_gbps": here,
                      "intra_latency_us": args.intra_latency_us, "net_latency_us": args.net_latency_us,
                      "net_gbps": args.net_gbps, "context": args.context, "k": args.k, "tau": args.tau})
    table = [{"kind": "projection", **r} for r in rows]
    print(fmt_table(table, ["kind", "model", "setup", "tp", "gb_per_rank", "mem_ms", "comm_ms", "step_ms",
                            "plain_tok_s", "c", "v", "speedup", "spec_tok_s", "comm_share_spec"]), flush=True)
    return rows


# ------------------------------------------------------------------------------- main
SECTIONS = {"collectives": run_collectives, "projection": run_projection, "e2e": run_e2e}


def _what(s: str) -> list[str]:
    names = [x.strip() for x in s.split(",") if x.strip()]
    bad = [x for x in names if x not in SECTIONS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"{s!r}: sections are {', '.join(SECTIONS)} (comma list)")
    return [x for x in SECTIONS if x in names]  # in SECTIONS order: collectives feed the projection


def _transports(s: str) -> list[str]:
    names = [x.strip() for x in s.split(",") if x.strip()]
    if not names or any(x not in ("shm", "gloo") for x in names):
        raise argparse.ArgumentTypeError(f"{s!r}: transports are shm and gloo (comma list)")
    return sorted(set(names), key=names.index)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="qspec bench tp", parents=[parent_parser(), model_parser()], description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--what", type=_what, default=_what("collectives,projection"),
                   help=f"sections, comma list of {', '.join(SECTIONS)} (default: collectives,projection)")
    p.add_argument("--world", type=positive_int, default=2, help="ranks of the collectives section (default 2)")
    p.add_argument("--transport", dest="transports", type=_transports, default=["shm", "gloo"],
                   help="transports of the collectives section, comma list of shm, gloo (default: both)")
    p.add_argument("--reps", type=positive_int, default=200, help="timed repetitions per collective (default 200)")
    p.add_argument("--intra-latency-us", type=positive_float, default=None,
                   help="projection: a collective between sockets costs this (default: measured by size)")
    p.add_argument("--net-latency-us", type=positive_float, default=25.0, help="projection: between hosts (default 25)")
    p.add_argument("--net-gbps", type=positive_float, default=100.0, help="projection: NIC Gb/s per host (default 100)")
    p.add_argument("--socket-gbs", type=positive_float, default=250.0,
                   help="projection: memory GB/s per socket (default 250: 8-channel DDR5-4800 at ~80%%)")
    p.add_argument("--context", type=positive_int, default=1024, help="projection: KV cache positions (default 1024)")
    p.add_argument("--k", type=positive_int, default=8, help="projection: draft tokens per step (default 8)")
    p.add_argument("--tau", type=positive_float, default=6.4, help="projection: tokens per verify step (default 6.4)")
    p.add_argument("--draft-bits", type=positive_float, default=4.25, help="projection: draft bits per weight (default 4.25)")
    add_e2e_args(p)
    args = p.parse_args(argv)
    for name, low in (("world", 2), ("reps", 10), ("k", 1), ("context", 0)):
        if getattr(args, name) < low:
            p.error(f"--{name} must be >= {low}")
    for name in ("net_latency_us", "net_gbps", "socket_gbs", "tau", "draft_bits"):
        if not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    if args.intra_latency_us is not None and args.intra_latency_us < 0:
        p.error("--intra-latency-us must be >= 0")
    setup(args)
    ctx = print_header(args, "bench.tp: tensor-parallel collectives on loopback gloo, and a projection")
    with JsonWriter(args.json, ctx) as writer:
        for name in args.what:
            SECTIONS[name](args, writer)


if __name__ == "__main__":
    main()
