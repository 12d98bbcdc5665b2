"""Shared benchmark plumbing (BENCH.md): header, timing, JSON lines, measured read bandwidth.

Every bench module builds its CLI from `parent_parser()` (--threads/--json/--plot/--quick; those
that run a model add `model_parser()`: --model NAME|DIR, --prompt-file), calls `setup(args)` +
`print_header(args)`, times with `time_fn` / `time_interleaved`, and
writes one JSON line per case with `JsonWriter` (header context is added to every line).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from qspec import _C

HERE = Path(__file__).resolve().parent
DEV_PROMPTS = HERE / "prompts" / "dev.jsonl"  # the dev prompt set, shipped with the benchmarks


def parent_parser() -> argparse.ArgumentParser:
    """Options every bench module takes; use as `argparse.ArgumentParser(parents=[...])`."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--threads", type=int, default=None,
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
                       help="JSON lines with a 'prompt' field (default: the dev set shipped in bench/prompts)")
    return p


def dev_prompts(path: str | None = None, n: int | None = None) -> list[str]:
    """The "prompt" field of each JSON line of `path` (default: the shipped dev set); with `n`,
    n of them spread evenly over the file, so that a subset still covers every category."""
    p = Path(path) if path else DEV_PROMPTS
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
    """Apply --threads to qspec's OpenMP pool and to torch (if imported); returns the count."""
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


_BW_CACHE: dict[tuple[int, int], float] = {}


def measure_bandwidth(threads: int, nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Streaming read bandwidth in GB/s (1e9 B/s) with `threads` threads: the median pass of a
    native SSE2 sum over a buffer far larger than the caches (_C.read_bandwidth_probe).
    Cached per (threads, nbytes) within the process."""
    key = (threads, nbytes)
    if key not in _BW_CACHE:
        secs = _C.read_bandwidth_probe(nbytes, reps, threads)
        _BW_CACHE[key] = nbytes / statistics.median(secs) / 1e9
    return _BW_CACHE[key]


def fmt_table(rows: list[dict], cols: list[str]) -> str:
    """A plain aligned text table of dict rows."""
    cells = [[str(c) for c in cols]] + [[_fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def stats_dict(s: Stats) -> dict:
    return {k: (v * 1e6 if k != "n" else v) for k, v in asdict(s).items()}
