"""Tensor-parallel checks run inside the ranks (tests/test_tp.py launches this script).

`python tp_worker.py SCENARIO MODEL_DIR WORLD`: this process becomes rank 0 and spawns the other
ranks running the same command (qspec.parallel.launch.spawn, as `qspec --tp N` does); the
followers serve inside qspec.load(). Rank 0 prints one JSON line of results on stdout.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

import qspec
from qspec.parallel.launch import spawn
from qspec.sampling import SamplingParams, warp

PROMPTS = [[3, 17, 42, 5, 9], [100, 7, 7, 7, 12, 64, 1], [250, 2], [11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47]]


def single_process(model_dir, draft="mxfp4"):
    """The whole model in this process (rank 0), the reference of the TP forward."""
    from qspec.config import ModelConfig
    from qspec.draft import DraftSpec
    from qspec.loader import load_weights
    from qspec.native import native_backend

    cfg = ModelConfig.from_file(model_dir / "config.json")
    return native_backend(model_dir, cfg, load_weights(model_dir, cfg), DraftSpec(draft, draft))


def logits(model_dir, eng, ref=None) -> dict:
    """Max relative error of the TP logits (every row of a 20-token pass) against one process's,
    with the target and the draft weights."""
    be, ref = eng.backend, ref or single_process(model_dir)
    prompt = list(range(1, 21))
    errs = []
    for s in (0, 1):  # target and draft weights
        be.kv.ensure_capacity(32)
        ref.kv.ensure_capacity(32)
        a = be.forward(prompt, 0, all_logits=True, draft=s)
        b = ref.forward(prompt, 0, all_logits=True, draft=s)
        errs.append(float(np.abs(a - b).max() / max(1e-6, np.abs(b).max())))
    return {"rel_err_target": errs[0], "rel_err_draft": errs[1]}


def suite(model_dir, eng) -> dict:
    be, ref = eng.backend, single_process(model_dir)
    out = {"transport": "shm" if be.comm.shm is not None else "gloo", "world": be.comm.world,
           **logits(model_dir, eng, ref)}
    prompt = list(range(1, 21))
    # batch invariance: each row of a 20-row pass == the same row run alone (bits), and a 5-row verify-sized pass
    full = be.forward(prompt, 0, all_logits=True)
    alone = np.stack([be.forward([t], i)[-1] for i, t in enumerate(prompt)])
    five = be.forward(prompt[10:15], 10, all_logits=True)
    out["batch_invariant"] = bool(np.array_equal(full, alone) and np.array_equal(full[10:15], five))
    # greedy speculative == greedy plain under TP; how often TP plain == single-process plain
    plain = [eng.generate(p, max_new_tokens=24, speculative=False).tokens for p in PROMPTS]
    runs = {"k1": dict(draft_max=1), "k4": dict(draft_max=4), "auto": dict(draft_max="auto"),
            "tree": dict(draft_max=4, tree="on", tree_width=2)}
    out["greedy_equal"] = {name: [eng.generate(p, max_new_tokens=24, **kw).tokens == t for p, t in zip(PROMPTS, plain)]
                           for name, kw in runs.items()}
    out["accepted"] = sum(eng.generate(p, max_new_tokens=24, draft_max=4, lookup="off").stats.get("accepted", 0)
                          for p in PROMPTS)
    single = qspec.Engine(model_dir, eng.cfg, eng.tokenizer, ref, eng.eos_ids)
    out["agree_single"] = [single.generate(p, max_new_tokens=24, speculative=False).tokens == t
                           for p, t in zip(PROMPTS, plain)]
    out["plain"] = plain
    return out


def sampling(model_dir, eng) -> dict:
    """The 2nd new token's marginal under TP speculative sampling against the exact target marginal
    from TP forwards (as tests/test_speculative.py does in one process)."""
    params = dict(temperature=1.0, top_k=10)
    sp = SamplingParams(**params)
    be, v = eng.backend, eng.cfg.vocab_size
    prompt = [1, 5, 7]
    be.kv.ensure_capacity(8)
    p1 = warp(be.forward(prompt, 0)[-1], sp)
    exact = np.zeros(v)
    for t1 in np.flatnonzero(p1 > 0):
        exact += p1[t1] * warp(be.forward(prompt + [int(t1)], 0)[-1], sp)
    counts = np.zeros(v)
    drafted = accepted = 0
    for s in range(int(os.environ.get("TP_SAMPLES", "2000"))):
        r = eng.generate(prompt, max_new_tokens=3, seed=s, draft_max=2, **params)
        counts[r.tokens[1]] += 1
        drafted += r.stats["drafted"]
        accepted += r.stats["accepted"]
    return {"counts": counts.tolist(), "exact": exact.tolist(), "accept_rate": accepted / max(1, drafted)}


def greedy(model_dir, eng) -> dict:
    """Greedy speculative == plain under TP on a real model (the default model needs 3 ranks).
    TP_PROMPTS: a JSON list of prompts; TP_NEW: tokens each; TP_SINGLE=1: also how often TP plain
    output equals the one-process output."""
    prompts = json.loads(os.environ.get("TP_PROMPTS", "null")) or [
        "Write a haiku about the sea.", "List three prime numbers and explain why they are prime."]
    n = int(os.environ.get("TP_NEW", "16"))
    plain = [eng.generate(p, max_new_tokens=n, speculative=False).tokens for p in prompts]
    spec = [eng.generate(p, max_new_tokens=n, draft_max=k).tokens for p in prompts for k in (4, "auto")]
    out = {"equal": [s == plain[i // 2] for i, s in enumerate(spec)]}
    if os.environ.get("TP_SINGLE") == "1":
        ref = single_process(model_dir, eng.draft.fmt)
        single = qspec.Engine(model_dir, eng.cfg, eng.tokenizer, ref, eng.eos_ids)
        out["agree_single"] = [single.generate(p, max_new_tokens=n, speculative=False).tokens == t
                               for p, t in zip(prompts, plain)]
    return out


def main() -> None:
    scenario, model_dir, world = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if "WORLD_SIZE" not in os.environ:
        spawn(world, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]])
    from pathlib import Path

    draft = os.environ.get("TP_DRAFT", "mxfp4")
    eng = qspec.load(model_dir, draft=draft, draft_lm_head=draft)  # followers never return
    result = {"suite": suite, "logits": logits, "sampling": sampling, "greedy": greedy}[scenario](Path(model_dir), eng)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
