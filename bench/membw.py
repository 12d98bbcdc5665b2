"""STREAM-like read bandwidth per thread count: `python -m bench.membw [--threads N] ...`.

The native probe (_C.read_bandwidth_probe) sums a buffer much larger than the last-level cache
with SSE2 loads, threads splitting it, each thread reading 4 interleaved streams with a software
prefetch (the GEMM kernels' pattern; one plain stream under-measures a Zen 3 core by ~30%).
Every other bench reports % of this figure.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from .common import JsonWriter, fmt_table, parent_parser, print_header, setup
from qspec import _C


def numpy_read_gbps(nbytes: int, reps: int) -> float:
    """Single-threaded numpy sum, for comparison (not used as the reference)."""
    a = np.ones(nbytes // 8, dtype=np.float64)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a.sum()
        ts.append(time.perf_counter() - t0)
    return nbytes / float(np.median(ts)) / 1e9


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, parents=[parent_parser()],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=None, help="buffer size (default 1024, quick 256)")
    args = ap.parse_args(argv)
    threads = setup(args)
    ctx = print_header(args, "read bandwidth (native SSE2 sum, 4 streams/thread + prefetch, median pass)")
    nbytes = (args.size_mib or (256 if args.quick else 1024)) << 20
    reps = 5 if args.quick else 9
    rows = []
    with JsonWriter(args.json, ctx) as out:
        for t in range(1, threads + 1):
            secs = _C.read_bandwidth_probe(nbytes, reps, t)
            gb = [nbytes / s / 1e9 for s in secs]
            row = {"kernel": "read_probe", "threads": t, "bytes": nbytes,
                   "gbps": float(np.median(gb)), "gbps_min": min(gb), "gbps_max": max(gb)}
            rows.append(row)
            out.write(row)
        npbw = numpy_read_gbps(min(nbytes, 256 << 20), reps)
        out.write({"kernel": "numpy_sum", "threads": 1, "bytes": min(nbytes, 256 << 20), "gbps": npbw})
    print(fmt_table(rows, ["kernel", "threads", "bytes", "gbps", "gbps_min", "gbps_max"]))
    print(f"numpy float64 sum, 1 thread: {npbw:.1f} GB/s")
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot([r["threads"] for r in rows], [r["gbps"] for r in rows], "o-")
        ax.set_xlabel("threads")
        ax.set_ylabel("read GB/s")
        ax.set_title(f"read bandwidth — {ctx['cpu']}")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
