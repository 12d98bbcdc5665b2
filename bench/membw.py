"""STREAM-like read bandwidth per load width and thread count: `python -m bench.membw [--threads N] [--sweep] ...`.

The native probe (_C.ReadProbe, csrc/membw.cpp) sums a buffer far larger than the last-level
cache: threads claim pieces of it, each read as several streams in lockstep (the GEMM kernels
read 4 row blocks at once) with the load width of a given ISA level: sse2 (16 B), avx2 (32 B),
avx512 (64 B; only where the selected level allows it: QSPEC_ISA=avx2 on an AVX-512 machine
measures ymm). Every width is timed at every thread count, the widths interleaved pass by pass
(the bandwidth of a shared VM moves within minutes). `--sweep` also varies the streams per
thread and the software prefetch distance at the widest width: the probe's defaults
(_C.read_probe_defaults()) are the count that saturates memory here.
The other benches take their floor from this probe and a reference GEMV, sampled interleaved
with what they time (common.FloorMeter).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from .common import JsonWriter, fmt_table, parent_parser, positive_int, print_header, setup
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


def interleaved(probes: dict, reps: int) -> dict[str, list[float]]:
    """GB/s of every probe, one pass each in turn, reps rounds (after one warm-up pass)."""
    gb = {k: [] for k in probes}
    for p in probes.values():
        p.run(1)
    for _ in range(reps):
        for k, p in probes.items():
            gb[k].append(p.nbytes / p.run(1)[0] / 1e9)
    return gb


def row(kind: str, p, gb: list[float]) -> dict:
    return {"kernel": kind, "width": p.width, "load_bytes": p.load_bytes, "threads": p.threads,
            "streams": p.streams, "prefetch": p.prefetch, "chunk": p.chunk, "bytes": p.nbytes,
            "gbps": float(np.median(gb)), "gbps_min": min(gb), "gbps_max": max(gb),
            "load": os.getloadavg()[0]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, parents=[parent_parser()],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=positive_int, default=None, help="buffer size (default 512, quick 256)")
    ap.add_argument("--sweep", action="store_true",
                    help="also streams per thread x prefetch distance at the widest width")
    ap.add_argument("--no-hugepages", action="store_true", help="4 KB pages (no MADV_HUGEPAGE)")
    args = ap.parse_args(argv)
    threads = setup(args)
    ctx = print_header(args, "read bandwidth (native probe: widths interleaved, median pass)")
    d = _C.read_probe_defaults()
    print(f"# widths at isa {_C.isa_selected()}: {', '.join(_C.read_widths())}; defaults: {d['streams']} streams/thread, "
          f"prefetch {d['prefetch']} B; huge pages {'off' if args.no_hugepages else 'madvised'}", flush=True)
    nbytes = (args.size_mib or (256 if args.quick else 512)) << 20
    reps = 5 if args.quick else 9
    huge = not args.no_hugepages
    rows = []
    with JsonWriter(args.json, ctx) as out:
        for t in range(1, threads + 1):
            probes = {w: _C.ReadProbe(nbytes, t, w, hugepages=huge) for w in _C.read_widths()}
            gb = interleaved(probes, reps)
            for w, p in probes.items():
                rows.append(row("read_probe", p, gb[w]))
                out.write(rows[-1])
            del probes
        print(fmt_table(rows, ["kernel", "width", "load_bytes", "threads", "streams", "prefetch", "gbps",
                               "gbps_min", "gbps_max", "load"]), flush=True)
        if args.sweep:  # every (streams, prefetch) at the widest width, interleaved pass by pass
            sweep = []
            size = min(nbytes, 256 << 20)
            for t in range(1, threads + 1):
                probes = {(s, pf): _C.ReadProbe(size, t, "auto", s, 0, pf, huge)
                          for s in (1, 2, 4, 8, 16) for pf in (0, 1024, 4096)}
                gb = interleaved(probes, max(3, reps // 2))
                for c, p in probes.items():
                    sweep.append(row("read_sweep", p, gb[c]))
                    out.write(sweep[-1])
                del probes
            print()
            print(fmt_table(sweep, ["kernel", "width", "threads", "streams", "prefetch", "chunk", "gbps",
                                    "gbps_min", "gbps_max", "load"]))
            rows += sweep
        npbw = numpy_read_gbps(min(nbytes, 256 << 20), reps)
        out.write({"kernel": "numpy_sum", "threads": 1, "bytes": min(nbytes, 256 << 20), "gbps": npbw})
    print(f"numpy float64 sum, 1 thread: {npbw:.1f} GB/s")
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for w in _C.read_widths():
            pts = [r for r in rows if r["kernel"] == "read_probe" and r["width"] == w]
            ax.plot([r["threads"] for r in pts], [r["gbps"] for r in pts], "o-", label=w)
        ax.set_xlabel("threads")
        ax.set_ylabel("read GB/s (median pass)")
        ax.set_title(f"read bandwidth — {ctx['cpu']}")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
