"""Prefill: time to first token and prompt tokens/s of long prompts, against the CPU's compute peak,
torch's own BF16 GEMM and llama.cpp:
`qspec bench prefill [--model NAME|DIR] [--lengths 512,2048,8192] [--reps N] [--threads N] [--quick]
[--peer-server LLAMA_SERVER --peer-gguf GGUF | --no-peer] [--json PATH]` (or `python -m bench.prefill ...` from a
development install).

Per prompt length L (real text: a standard-library source file and a question, bench/long_prompts.py;
--quick: 128 and 512 tokens, one repetition), the median over --reps runs of:
  ttft_s         qspec.generate(ids, max_new_tokens=1) wall time, the cache's record of earlier
                 rows forgotten first (a full prefill every time)
  prompt_tok_s   L / the prefill time of the stats
  gemm_gflops    FLOPs of the prefill's GEMMs (2 · L · the GEMM weights of every layer, plus the LM
                 head's one row) / their time in qspec's forward profile; gemm_share = that time /
                 prefill time, attention_share = attention's
  peak_gflops    the CPU's peak for the kernel family the GEMMs run at the selected ISA level,
                 measured in the same run (_C.compute_peak: register-only chains of vfmadd231ps
                 on AVX2 / AVX-512 (and AVX512-BF16 where _C.bf16_fma(): Intel), vdpbf16ps on
                 AVX512-BF16 elsewhere, TDPBF16PS on AMX, on every thread);
                 of_peak = gemm_gflops / peak_gflops. clock_peak_gflops is the clock-based figure
                 beside it: threads x clock x FLOPs per cycle and core (FP32 FMA: 2 x 8 lanes x 2
                 on AVX2, 2 x 16 x 2 on AVX-512; vdpbf16ps: 2 x 32 x 2; AMX TDPBF16PS: 1024),
                 clock = the highest 'cpu MHz' of /proc/cpuinfo (or the cpufreq maximum). A VM
                 shows neither the real clock nor the issue rate (Zen 4 issues one 512-bit
                 vdpbf16ps a cycle; a Sapphire Rapids Xeon one every other cycle, against two
                 FMAs a cycle), so the measured peak is the one to use.
  torch_gflops   torch.nn.functional.linear (oneDNN) BF16 on the model's MLP gate|up shape
                 [min(L, 2048), hidden] x [2 · intermediate, hidden]^T, same run and threads;
                 qspec_mlp_gflops is qspec's gate|up GEMM in the prefill
  llama.cpp      with --peer-server: that llama-server binary on --peer-gguf (the model's weights
                 in BF16), its own timings.prompt_ms for the same prompt ids (no cached prefix);
                 else with the `peer` extra (llama-cpp-python) installed: the model's GGUF
                 requantized to BF16 (bench/peer.py), the same prompt ids, time to its first
                 token, as `llama-bench -p L` measures a prompt; otherwise (or with --no-peer) one
                 line says it was skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

from .common import (JsonWriter, fmt_table, free_port, model_parser, parent_parser, positive_int,
                     print_header, setup)
from .load import LlamaServer
from .long_prompts import long_prompts
from .models import load_engine, model_label
from qspec import _C

# FLOPs per cycle and core of the GEMM kernel family at each ISA level (module docstring)
FLOPS_PER_CYCLE = {"scalar": 2, "avx2": 32, "avx512": 64, "avx512_bf16": 128, "amx": 1024}
# the GEMM kernel family's instruction at each ISA level, as _C.compute_peak names it
PEAK_KIND = {"avx2": "fma_avx2", "avx512": "fma_avx512", "avx512_bf16": "dpbf16", "amx": "amx_bf16"}


def cpu_clock_hz() -> float | None:
    """The highest 'cpu MHz' in /proc/cpuinfo, else cpufreq's cpuinfo_max_freq; None if neither."""
    try:
        mhz = [float(line.split(":")[1]) for line in open("/proc/cpuinfo") if line.startswith("cpu MHz")]
        if mhz:
            return max(mhz) * 1e6
    except (OSError, ValueError, IndexError):
        pass
    try:
        return float(open("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq").read()) * 1e3
    except (OSError, ValueError):
        return None


def gemm_family(isa: str) -> str:
    """The ISA level whose GEMM instruction a prefill runs: avx512_bf16 takes FMAs (avx512's) for
    its many rows where _C.bf16_fma() (Intel: the same bits as vdpbf16ps, csrc/gemm.h)."""
    return "avx512" if isa == "avx512_bf16" and _C.bf16_fma() else isa


def clock_peak_gflops(threads: int, isa: str) -> float | None:
    hz = cpu_clock_hz()
    return None if hz is None else threads * hz * FLOPS_PER_CYCLE[gemm_family(isa)] / 1e9


def measured_peak_gflops(isa: str) -> float | None:
    """The GEMM family's measured peak on the pool's threads (median of 3 probes), None on scalar."""
    kind = PEAK_KIND.get(gemm_family(isa))
    return None if kind is None else statistics.median(_C.compute_peak(kind, 0.25) for _ in range(3))


def gemm_flops(eng, n: int) -> float:
    """FLOPs of the GEMMs of a prefill of n tokens (the LM head runs for the last row only)."""
    cfg = eng.cfg
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    per_layer = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size
    return 2.0 * (n * cfg.n_layers * per_layer + cfg.hidden_size * cfg.vocab_size)


def torch_mlp_gflops(cfg, m: int, reps: int) -> float:
    """torch's BF16 GEMM (oneDNN) on the gate|up shape: GFLOP/s, median of reps."""
    import torch

    x = torch.randn(m, cfg.hidden_size).to(torch.bfloat16)
    w = torch.randn(2 * cfg.intermediate_size, cfg.hidden_size).to(torch.bfloat16)
    ts = []
    with torch.inference_mode():
        torch.nn.functional.linear(x, w)  # warm-up
        for _ in range(reps):
            t = time.perf_counter()
            torch.nn.functional.linear(x, w)
            ts.append(time.perf_counter() - t)
    return 2.0 * m * w.shape[0] * w.shape[1] / statistics.median(ts) / 1e9


def qspec_prefill(eng, ids: list[int]) -> dict:
    model = eng.backend.model
    eng.backend.kv.forget()
    model.profile_reset()
    t = time.perf_counter()
    r = eng.generate(ids, max_new_tokens=1, speculative=False)
    ttft = time.perf_counter() - t
    prof = model.profile()
    pre = r.stats["prefill_s"]
    return {"ttft_s": ttft, "prefill_s": pre, "gemm_s": prof["gemm_s"] - prof["gemm_lm_head_s"],
            "lm_head_s": prof["gemm_lm_head_s"], "mlp_s": prof["gemm_gate_up_s"], "attention_s": prof["attention_s"]}


def llama_cpp_runner(args, eng, stack):
    """A function ids -> seconds to llama.cpp's first token on the BF16 GGUF, or None (printed why)."""
    if args.peer_server:
        n_ctx = -(-(max(args.lengths) + 16) // 256) * 256
        srv = LlamaServer(args.peer_server, args.peer_gguf, 1, n_ctx, args.threads, free_port())
        stack.callback(srv.stop)
        print(f"# llama.cpp: {args.peer_server} on {args.peer_gguf}, {args.threads} threads (timings.prompt_ms)",
              flush=True)
        return srv.prefill_s
    if args.no_peer:
        print("# llama.cpp: skipped (--no-peer)", flush=True)
        return None
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("# llama.cpp: skipped (llama-cpp-python is not installed; pip install 'qspec[peer]' for the "
              "llama-bench -p comparison)", flush=True)
        return None
    from .peer import LlamaCppEngine, import_llama_cpp, original_gguf, requantized

    lc = import_llama_cpp()
    src = original_gguf(args.model, None)
    path = requantized(lc, src, "bf16", args.threads)
    n_ctx = -(-(max(args.lengths) + 16) // 256) * 256
    peer = LlamaCppEngine(lc, "bf16", path, args.threads, n_ctx, None)
    print(f"# llama.cpp bf16: {peer.desc} ({path.name})", flush=True)
    return lambda ids: peer.generate(ids, 1, set(eng.eos_ids))["prefill_s"]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="qspec bench prefill", parents=[parent_parser(), model_parser(prompts=False)],
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="prompt lengths in tokens (default 512,2048,8192; --quick: 128,512)")
    p.add_argument("--reps", type=positive_int, default=None, help="runs per length (default 3; --quick: 1)")
    p.add_argument("--peer-server", help="llama.cpp's llama-server binary: its prompt time on --peer-gguf "
                   "(instead of llama-cpp-python)")
    p.add_argument("--peer-gguf", help="the GGUF llama-server loads (the model's weights in BF16)")
    p.add_argument("--no-peer", action="store_true", help="skip llama.cpp even where the peer extra is installed")
    args = p.parse_args(argv)
    if bool(args.peer_server) != bool(args.peer_gguf):
        p.error("--peer-server and --peer-gguf go together")
    if args.no_peer and args.peer_server:
        p.error("--no-peer and --peer-server exclude each other")
    args.lengths = args.lengths or ([128, 512] if args.quick else [512, 2048, 8192])
    args.reps = args.reps or (1 if args.quick else 3)
    if min(args.lengths) < 64 or args.reps < 1:
        p.error("--lengths must be >= 64 tokens and --reps >= 1")
    setup(args)
    ctx = print_header(args, "bench.prefill: time to first token and prompt throughput")
    eng = load_engine(args, None)
    fit = eng.cfg.max_seq_len - 64  # room for the question's template and the first new token
    if any(n > fit for n in args.lengths):
        print(f"# lengths above {fit} tokens run at {fit} (the model's context is {eng.cfg.max_seq_len})", flush=True)
        args.lengths = sorted({min(n, fit) for n in args.lengths})
    isa = _C.isa_selected()
    clock_peak, clock = clock_peak_gflops(args.threads, isa), cpu_clock_hz()
    print(f"# model {model_label(eng)}; GEMM clock peak {clock_peak and f'{clock_peak:.0f}'} GFLOP/s = {args.threads} "
          f"threads x {clock and f'{clock / 1e9:.2f}'} GHz x {FLOPS_PER_CYCLE[gemm_family(isa)]} FLOP/cycle ({isa})", flush=True)
    prompts = {n: long_prompts(eng, n, 1)[0] for n in args.lengths}
    qspec_prefill(eng, prompts[args.lengths[0]][:64])  # warm-up: page the weights in
    rows = []
    with contextlib.ExitStack() as stack, JsonWriter(args.json, ctx) as out:
        peer = llama_cpp_runner(args, eng, stack)
        for n, ids in prompts.items():
            runs = [qspec_prefill(eng, ids) for _ in range(args.reps)]
            peak = measured_peak_gflops(isa)  # beside every length: the host's load moves it
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            gf = gemm_flops(eng, len(ids)) - 2.0 * eng.cfg.hidden_size * eng.cfg.vocab_size
            mlp = 2.0 * len(ids) * eng.cfg.n_layers * 2 * eng.cfg.intermediate_size * eng.cfg.hidden_size
            row = {"mode": "prefill", "model": model_label(eng), "prompt_tokens": len(ids), "ttft_s": med["ttft_s"],
                   "prompt_tok_s": len(ids) / med["prefill_s"], "gemm_gflops": gf / med["gemm_s"] / 1e9,
                   "peak_gflops": peak, "clock_peak_gflops": clock_peak, "gemm_share": med["gemm_s"] / med["prefill_s"],
                   "attention_share": med["attention_s"] / med["prefill_s"],
                   "qspec_mlp_gflops": mlp / med["mlp_s"] / 1e9,
                   "torch_gflops": torch_mlp_gflops(eng.cfg, min(len(ids), 2048), 3 if args.quick else 5),
                   "isa": isa, "threads": args.threads, "reps": args.reps}
            row["of_peak"] = row["gemm_gflops"] / peak if peak else None
            row["qspec_mlp_vs_torch"] = row["qspec_mlp_gflops"] / row["torch_gflops"]
            if peer is not None:
                t = statistics.median(peer(ids) for _ in range(args.reps))
                row.update(llama_cpp_prompt_tok_s=len(ids) / t, vs_llama_cpp=row["prompt_tok_s"] * t / len(ids))
            rows.append(row)
            out.write(row)
            if peak is not None:
                print(f"# measured GEMM peak ({PEAK_KIND[gemm_family(isa)]}, {args.threads} threads): {peak:.0f} GFLOP/s", flush=True)
            print(f"# {len(ids)} tokens: TTFT {row['ttft_s']:.2f} s, {row['prompt_tok_s']:.0f} tok/s", flush=True)
        cols = ("prompt_tokens", "ttft_s", "prompt_tok_s", "gemm_gflops", "peak_gflops", "of_peak", "clock_peak_gflops", "gemm_share",
                "attention_share", "qspec_mlp_gflops", "torch_gflops", "qspec_mlp_vs_torch",
                "llama_cpp_prompt_tok_s", "vs_llama_cpp")
        print(fmt_table(rows, [c for c in cols if c in rows[0]]), flush=True)
        if len(rows) > 1:
            r = rows[-1]["prompt_tok_s"] / rows[0]["prompt_tok_s"]
            print(f"# prompt tok/s at {rows[-1]['prompt_tokens']} tokens = {r:.2f} x the rate at "
                  f"{rows[0]['prompt_tokens']}", flush=True)


if __name__ == "__main__":
    main()
