"""d(M) of a model's MX GEMMs by thread CPU time, for shared machines:
`python -m bench.rows [--model NAME|DIR] [--formats mxfp4] [--ms 1,2,3,4,8,16] [--quick]`.

d(M) = time of an M-row pass over every GEMM of the model (each weighted by how often it runs
per token) / time of a one-row pass; c = the MX pass / the BF16 pass at M = 1. One thread, and
each call timed by the calling thread's CPU time (time.thread_time), so the time slices other
processes take from a busy VM drop out; memory stalls still count, and weights rotate through
enough copies (128 MB per shape) to come from DRAM, as in decoding. Use `bench.kernels` (wall
time against the measured bandwidth floor) on a quiet machine; this when the machine is not.
Weights are SYNTHETIC (random codes and scales in the model's shapes): speed only.
"""

import argparse
import statistics
import time

import numpy as np

from .common import (JsonWriter, fmt_table, int_list, model_parser, parent_parser, print_header, setup,
                     str_list)
from .kernels import LAYERS, MODELS, PER_LAYER, model_shapes, synthetic_weight
from qspec import _C

ROTATE_BYTES = 128e6


def run(args) -> list[dict]:
    args.threads = 1  # thread CPU time measures the calling thread only
    setup(args)
    ctx = print_header(args, "MX GEMMs: d(M) by thread CPU time, one thread (synthetic weights)")
    rng = np.random.default_rng(0)
    if args.model:
        label, layers = model_shapes(args.model)
    else:
        label, layers = "SmolLM2-135M", MODELS["SmolLM2-135M"]
    ms = sorted(set([1] + (args.ms or ([1, 2, 4] if args.quick else [1, 2, 3, 4, 8, 16]))))
    reps = 3 if args.quick else 9
    total: dict[tuple[str, int], float] = {}
    rows = []
    with JsonWriter(args.json, ctx) as out:
        for lay, n, k in layers:
            count = PER_LAYER.get(lay, 1) * (LAYERS.get(label, 1) if lay in PER_LAYER else 1)
            wbits = (rng.standard_normal((n, k), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16) & 0x3FFF
            for fmt in ["bf16"] + args.formats:
                first = synthetic_weight(rng, fmt, n, k, wbits)
                ws = [first] + [synthetic_weight(rng, fmt, n, k, wbits)
                                for _ in range(int(np.ceil(ROTATE_BYTES / first.nbytes)) - 1)]
                fmt_ms = [1] if fmt == "bf16" else ms
                xs = {m: rng.standard_normal((m, k), dtype=np.float32) for m in fmt_ms}
                times = {m: [] for m in fmt_ms}
                for r in range(reps):  # M values interleaved, each on the next copy
                    for i, m in enumerate(fmt_ms):
                        w = ws[(r * len(fmt_ms) + i) % len(ws)]
                        t0 = time.thread_time()
                        _C.gemm(w, xs[m])
                        times[m].append(time.thread_time() - t0)
                for m in fmt_ms:
                    s = statistics.median(times[m])
                    total[(fmt, m)] = total.get((fmt, m), 0.0) + count * s
                    row = {"model": label, "layer": lay, "fmt": fmt, "m": m, "n": n, "k": k, "count": count,
                           "path": _C.gemm_choose(ws[0], m), "cpu_us_median": s * 1e6, "synthetic": True}
                    out.write(row)
                del ws
        for fmt in args.formats:
            one = total[(fmt, 1)]
            row = {"model": label, "fmt": fmt, "M1_ms": one * 1e3, "c": one / total[("bf16", 1)],
                   **{f"d({m})": total[(fmt, m)] / one for m in ms if m > 1}}
            rows.append(row)
            out.write(row)
    print(fmt_table(rows, ["model", "fmt", "M1_ms", "c"] + [f"d({m})" for m in ms if m > 1]))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, parents=[parent_parser(), model_parser(prompts=False)],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", type=str_list, default=["mxfp4"], help="comma list of MX formats (default mxfp4)")
    ap.add_argument("--ms", type=int_list, default=None, help="comma list of M (default 1,2,3,4,8,16)")
    run(ap.parse_args(argv))


if __name__ == "__main__":
    main()
