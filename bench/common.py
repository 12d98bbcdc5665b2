"""Shared benchmark plumbing (BENCH.md): header, timing, JSON lines, the bandwidth floor.

Every bench module builds its CLI from `parent_parser()` (--threads/--json/--plot/--quick; those
that run a model add `model_parser()`: --model NAME|DIR, --prompt-file), calls `setup(args)` +
`print_header(args)`, times with `time_fn` / `time_interleaved` (or, against the memory
bandwidth, `FloorMeter`: probe, work, probe, work, ...), and writes one JSON line per case with
`JsonWriter` (header context is added to every line).

A/B of two builds of the extension, in any bench: QSPEC_BENCH_SO=/path/to/_C.cpython-*.so loads
that file in place of qspec._C (qspec/__init__.py: it must happen before the package loads its own,
and one process can hold one build only; run the two builds as alternating processes, compare
medians). `print_header` names the file a run used.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from qspec import _C
from qspec.cli import int_at_least

HERE = Path(__file__).resolve().parent
DEV_PROMPTS = HERE / "prompts" / "dev.jsonl"  # the dev prompt set, shipped with the benchmarks
# prompts whose answers repeat their own text (rewrite code with a rename, summarise or extract
# from a passage given in the prompt): where n-gram drafting pays. `--prompt-file repetition`
REPETITION_PROMPTS = HERE / "prompts" / "repetition.jsonl"
SHIPPED_PROMPTS = {"dev": DEV_PROMPTS, "repetition": REPETITION_PROMPTS}

# argparse types for the bench flags: a count or size of 0 or less is one usage line, not a
# kernel error or a run that never ends
positive_int = int_at_least(1)


def positive_float(s: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {s}")
    return v


def int_list(s: str) -> list[int]:
    """An argparse type: "1,2,4" -> [1, 2, 4], each >= 1."""
    return [positive_int(x) for x in s.split(",")]


def str_list(s: str) -> list[str]:
    """An argparse type: "a,b" -> ["a", "b"]."""
    return [x for x in s.split(",") if x]


def free_port() -> int:
    """A free loopback TCP port (for a server started next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parent_parser() -> argparse.ArgumentParser:
    """Options every bench module takes; use as `argparse.ArgumentParser(parents=[...])`."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--threads", type=positive_int, default=None,
                   help="threads for qspec and torch (default: all cores)")
    p.add_argument("--json", metavar="PATH", default=None, help="append one JSON line per case")
    p.add_argument("--plot", metavar="PATH", default=None, help="write a PNG plot (matplotlib)")
    p.add_argument("--quick", action="store_true", help="representative subset, < 1 minute")
    return p


def model_parser(prompts: bool = True) -> argparse.ArgumentParser:
    """--model (a known name such as qwen2.5-coder-1.5b, see `qspec fetch --list`, or a model
    directory; default: the default model) and, for modules that generate, --prompt-file."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("-m", "--model", metavar="NAME|DIR", default=None,
                   help="model name (qspec fetch --list) or directory (default: SmolLM2-135M-Instruct)")
    if prompts:
        p.add_argument("--prompt-file", metavar="JSONL", type=_prompt_file, default=str(DEV_PROMPTS),
                       help="JSON lines with a 'prompt' field, or the name of a set shipped in bench/prompts: "
                       "dev (the default) or repetition (answers that repeat the prompt's text)")
    return p


def dev_prompts(path: str | None = None, n: int | None = None) -> list[str]:
    """The "prompt" field of each JSON line of `path` (default: the shipped dev set); with `n`,
    n of them spread evenly over the file, so that a subset still covers every category."""
    p = SHIPPED_PROMPTS.get(path) or Path(path) if path else DEV_PROMPTS
    try:
        lines = [line for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
        prompts = [json.loads(line)["prompt"] for line in lines]
    except OSError as e:
        raise ValueError(f"prompt file {p}: {e.strerror or e}") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"prompt file {p}: not JSON lines with a 'prompt' field ({e})") from None
    if not prompts or not all(isinstance(x, str) and x for x in prompts):
        raise ValueError(f"prompt file {p}: needs at least one non-empty 'prompt' string per line")
    if n is not None and n < len(prompts):
        prompts = [prompts[i * len(prompts) // n] for i in range(n)]
    return prompts


def _prompt_file(s: str) -> str:
    try:
        dev_prompts(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return s


def setup(args) -> int:
    """Apply --threads to qspec's thread pool and to torch (if imported); returns the count."""
    n = args.threads or os.cpu_count() or 1
    args.threads = n
    _C.set_num_threads(n)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(n)
    return n


def git_commit() -> str:
    """The source's git commit (+"-dirty") when run from a checkout, else the installed version."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=HERE,
                               capture_output=True, text=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        try:
            return f"qspec {version('qspec')}"
        except PackageNotFoundError:
            return "unknown"


def machine_context(threads: int) -> dict:
    info = _C.cpu_info()
    f = info["features"]
    flags = [k for k in ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_bf16") if f.get(k)]
    return {
        "cpu": info["model"] or info["vendor"],
        "flags": ",".join(flags),
        "isa": info["isa_selected"],
        "threads": threads,
        "commit": git_commit(),
    }


def print_header(args, title: str = "") -> dict:
    """Print the conditions of the run (BENCH.md rule 3); returns them as a dict."""
    ctx = machine_context(args.threads)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [
        f"# {title}" if title else "#",
        f"# cpu: {ctx['cpu']}  ({platform.machine()}, {os.cpu_count()} logical cpus)",
        f"# flags: {ctx['flags']}   qspec isa_selected: {ctx['isa']} (detected {_C.isa_detected()})",
        f"# threads: {ctx['threads']}   commit: {ctx['commit']}   load avg(1m): {load:.2f}",
    ]
    if os.environ.get("QSPEC_BENCH_SO"):
        lines.append(f"# extension: {_C.__file__} (QSPEC_BENCH_SO)")
    try:
        import torch
        lines.append(f"# torch {torch.__version__} (threads {torch.get_num_threads()}), "
                     f"numpy {__import__('numpy').__version__}, python {platform.python_version()}")
    except ImportError:
        pass
    print("\n".join(lines), flush=True)
    return ctx


@dataclass
class Stats:
    median: float  # seconds
    min: float
    max: float
    mean: float
    n: int

    @property
    def us(self) -> float:
        return self.median * 1e6


def _stats(ts: list[float]) -> Stats:
    return Stats(statistics.median(ts), min(ts), max(ts), statistics.fmean(ts), len(ts))


def time_fn(fn, warmup: int = 2, reps: int = 10) -> Stats:
    """Warm up, then time `reps` calls of fn(); median of the per-call wall times."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return _stats(ts)


def time_interleaved(fns: dict, warmup: int = 2, reps: int = 10) -> dict[str, Stats]:
    """Time several functions A B C A B C ... (BENCH.md rule 1); {name: Stats}."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    ts = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            ts[name].append(time.perf_counter() - t0)
    return {name: _stats(v) for name, v in ts.items()}


def reps_for(fn, budget_s: float, lo: int = 3, hi: int = 25) -> int:
    """How many reps of fn fit a time budget (one untimed probe call)."""
    t0 = time.perf_counter()
    fn()
    dt = max(time.perf_counter() - t0, 1e-6)
    return max(lo, min(hi, int(budget_s / dt)))


class JsonWriter:
    """Appends one JSON object per line; `context` (machine, threads, commit) goes in each."""

    def __init__(self, path: str | None, context: dict | None = None):
        self.path = path
        self.context = dict(context or {})
        self._f = open(path, "a") if path else None

    def write(self, record: dict) -> None:
        if self._f:
            self._f.write(json.dumps({**self.context, **record}) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f:
            self._f.close()
            self._f = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------------------------------------
# The bandwidth floor (BENCH.md rule 4): measured beside what it bounds, never once per run.

REF_SHAPE = (8192, 2048)  # default reference GEMV (N, K): Llama-3.2-1B gate/up, BF16, 33.5 MB


def llc_bytes() -> int:
    """The last-level cache of cpu0 (sysfs), 32 MiB when unknown."""
    best = 0
    for d in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (d / "size").read_text().strip()
            best = max(best, int(size.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(size[-1], 0))
        except (OSError, ValueError):
            pass
    return best or 32 << 20


def copies_of(pw, nbytes: int) -> list:
    """The packed weight plus copies until they span nbytes (defeats the LLC)."""
    ws = [pw]
    while len(ws) * pw.nbytes < nbytes:
        ws.append(_C.PackedWeight.from_buffers(pw.fmt, pw.n, pw.k,
                                               {k: np.array(v) for k, v in pw.buffers().items()}))
    return ws


class Rotating:
    """Calls fn(item) cycling through items: one call of the benchmark. Functions timed side by
    side share one cursor (pass the first's `cursor`): every call reads the next copy, so no
    function finds its weights in the cache because the one before it just read the same copy."""

    def __init__(self, items, fn, cursor: list | None = None):
        self.items, self.fn = items, fn
        self.cursor = cursor if cursor is not None else [0]

    def __call__(self):
        self.cursor[0] = (self.cursor[0] + 1) % len(self.items)
        return self.fn(self.items[self.cursor[0]])


def spread(values) -> dict:
    """median, min, max and quartiles (q1, q3) of a list of numbers."""
    v = sorted(values)
    q = statistics.quantiles(v, n=4, method="inclusive") if len(v) > 1 else [v[0]] * 3
    return {"median": statistics.median(v), "min": v[0], "max": v[-1], "q1": q[0], "q3": q[2], "n": len(v)}


def fmt_spread(d: dict, unit: str = "") -> str:
    return f"{d['median']:.1f}{unit} [{d['min']:.1f}..{d['max']:.1f}, IQR {d['q1']:.1f}..{d['q3']:.1f}, n={d['n']}]"


@dataclass
class Pair:
    """One timed piece of work and the floor measured around it (the samples before and after)."""
    seconds: float
    result: object      # what the work returned
    probe_gbps: float   # read probe: mean of the two samples around the work
    kernel_gbps: float  # reference GEMV on a DRAM-resident matrix: mean of the two samples

    def floor_gbps(self, *kernel_rates: float) -> float:
        """The floor for this work: the best of the probe, the reference GEMV and any kernel
        streaming rate reached in the same window on a DRAM-resident matrix (kernel_rates)."""
        return max(self.probe_gbps, self.kernel_gbps, *kernel_rates)


class FloorMeter:
    """The memory-bandwidth floor, measured interleaved with the work it bounds.

    The bandwidth of a shared VM moves by up to 2x within minutes, so one measurement at the start
    of a run means little. A sample = the native read probe (_C.ReadProbe: the widest loads the
    selected ISA level allows, several streams per thread, a buffer of 8x the LLC; best of
    `passes`) + one rotation of a BF16 GEMV over a DRAM-resident matrix (`ref`: the model's
    largest, or REF_SHAPE synthetic; copies until they span 3x the LLC). `interleave` runs
    sample, work, sample, work, ..., sample and pairs each work with the mean of the samples
    around it; its floor is the best of the probe, the GEMV and any kernel rate of that window
    (Pair.floor_gbps), so a kernel that outruns the probe raises the floor instead of showing
    more than 100%."""

    def __init__(self, threads: int, ref=None, *, probe_bytes: int | None = None, passes: int = 2):
        llc = llc_bytes()
        self.threads, self.passes = threads, passes
        self.probe = _C.ReadProbe(probe_bytes or 8 * llc, threads)
        if ref is None:
            n, k = REF_SHAPE
            rng = np.random.default_rng(0)
            bits = (rng.standard_normal((n, k), dtype=np.float32) * 0.02).view(np.uint32)
            ref = _C.pack_bf16(((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16))
        self.ref = copies_of(ref, 3 * llc)
        self.ref_bytes = sum(w.nbytes for w in self.ref)
        self._x = np.full((1, ref.k), 0.01, np.float32)
        self._y = np.empty((1, ref.n), np.float32)
        self.sample()  # warm-up: page faults, thread pool

    def sample(self) -> tuple[float, float]:
        """(probe GB/s, reference GEMV GB/s) now."""
        probe = self.probe.nbytes / min(self.probe.run(self.passes)) / 1e9
        t0 = time.perf_counter()
        for w in self.ref:
            _C.gemm(w, self._x, self._y)
        return probe, self.ref_bytes / (time.perf_counter() - t0) / 1e9

    def interleave(self, steps):
        """sample, step(), sample, step(), ..., sample: yields one Pair per step."""
        before = self.sample()
        for step in steps:
            t0 = time.perf_counter()
            out = step()
            dt = time.perf_counter() - t0
            after = self.sample()
            yield Pair(dt, out, (before[0] + after[0]) / 2, (before[1] + after[1]) / 2)
            before = after

    def time_interleaved(self, fns: dict, warmup: int = 2, reps: int = 10) -> dict[str, Stats]:
        """time_interleaved (A B C, A B C, ...) with a floor sample between the rounds; the
        pairs (result = {name: seconds}) are kept in self.pairs."""
        for _ in range(warmup):
            for fn in fns.values():
                fn()

        def one_round():
            ts = {}
            for name, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                ts[name] = time.perf_counter() - t0
            return ts

        self.pairs = list(self.interleave(one_round for _ in range(reps)))
        return {name: _stats([p.result[name] for p in self.pairs]) for name in fns}

    def context(self) -> dict:
        w = self.ref[0]
        return {"probe_width": self.probe.width, "probe_load_bytes": self.probe.load_bytes,
                "probe_streams": self.probe.streams, "probe_mib": self.probe.nbytes >> 20,
                "floor_ref_gemv": f"{w.fmt} {w.n}x{w.k} x{len(self.ref)}"}

    def describe(self) -> str:
        p, w = self.probe, self.ref[0]
        return (f"# floor per timed item: best of the read probe ({p.width} loads, {p.load_bytes} B, "
                f"{p.streams} streams/thread, {p.nbytes >> 20} MiB, best of {self.passes} passes) and a "
                f"{w.fmt} GEMV {w.n}x{w.k} over {len(self.ref)} cop{'y' if len(self.ref) == 1 else 'ies'} "
                f"({self.ref_bytes / 1e6:.0f} MB), each the mean of the samples before and after it, "
                f"and of any kernel rate in the same window")


def fmt_table(rows: list[dict], cols: list[str]) -> str:
    """A plain aligned text table of dict rows."""
    cells = [[str(c) for c in cols]] + [[_fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells)


class TableStream:
    """Rows printed as they come under one header: each column as wide as its name, at least
    min_width or its entry in `widths` (fmt_table sizes columns to all rows, so it needs them
    all first)."""

    def __init__(self, cols: list[str], min_width: int = 8, widths: dict[str, int] | None = None):
        self.cols = cols
        self.widths = [max(len(c), (widths or {}).get(c, min_width)) for c in cols]
        self.started = False

    def line(self, row: dict) -> str:
        """The row's line, after the header line the first time."""
        cells = "  ".join(_fmt(row.get(c, "")).rjust(w) for c, w in zip(self.cols, self.widths))
        if self.started:
            return cells
        self.started = True
        return "  ".join(c.rjust(w) for c, w in zip(self.cols, self.widths)) + "\n" + cells


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def stats_dict(s: Stats) -> dict:
    return {k: (v * 1e6 if k != "n" else v) for k, v in asdict(s).items()}
