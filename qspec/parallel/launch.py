"""Starting the tensor-parallel ranks: from torchrun's environment, or spawned by `qspec --tp N`.

Every rank runs the same start-up: join the group, take its CPUs and thread count from the
topology (qspec/parallel/topology.py), prepare the model, and agree with the others on what was
prepared (the checkpoint's identity, qspec's version, the drafts) before any weight is read; then
pack its shard and agree again that every rank loaded it. Any disagreement or failure stops every
rank with TensorParallelError: rank 0 says why in one line, the followers exit quietly with a
non-zero status. Then rank 0 returns an Engine on a TPBackend and the others follow it
(qspec/parallel/backend.py) until it stops, and exit.
"""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys
import threading

from .. import _C, __version__
from ..errors import QspecError, TensorParallelError
from .comm import Comm, env_world

_active: Comm | None = None  # rank 0's group, released by finish() or at exit
_joined = threading.Event()   # the group is up: from here on a dead rank shows in the collectives


def world_size(requested: int | str | None) -> int:
    """The world size a load runs with: `requested` (an int, or "auto" = one rank per NUMA node)
    checked against the environment's WORLD_SIZE when one is set; None = the environment's (1 without)."""
    env = env_world() if "WORLD_SIZE" in os.environ else None
    if requested is None:
        return env or 1
    if requested == "auto":
        from .topology import default_world_size

        requested = env or default_world_size()
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        raise ValueError(f"tensor_parallel must be an integer >= 1 or 'auto', got {requested!r}")
    if env is not None and env != requested:
        raise TensorParallelError(f"tensor_parallel={requested} but this process was launched as one of "
                                  f"WORLD_SIZE={env} ranks")
    if env is None and requested > 1:
        raise TensorParallelError(f"tensor_parallel={requested} needs {requested} processes: launch with "
                                  f"torchrun --nproc-per-node {requested} (or `qspec ... --tp {requested}`)")
    return requested


def identity(model_dir, cfg, chain, draft_spec) -> dict:
    """What every rank must agree on: qspec and its packed layout, the checkpoint (its config.json
    and weight files by name and size; not its path, which may differ across hosts) and the drafts."""
    from ..draft import checkpoint_identity

    ck = checkpoint_identity(model_dir)
    return {"qspec": f"{__version__} (layout {_C.PACK_LAYOUT_VERSION})",
            "checkpoint": {"config_sha256": ck["config_sha256"],
                           "files": {n: v[0] for n, v in sorted(ck["files"].items())}},
            "drafts": [str(draft_spec), *chain[1:]]}


def agree(comm: Comm, mine: dict | str) -> None:
    """Every rank passes its identity (a dict) or its start-up error (a str); all ranks raise the
    same TensorParallelError unless every rank succeeded with rank 0's identity."""
    every = comm.exchange(mine)
    problem = None
    for r, theirs in enumerate(every):
        if isinstance(theirs, str):
            problem = theirs if r == 0 or theirs == every[0] else f"rank {r}: {theirs}"
            break
        if theirs != every[0]:
            what = ", ".join(k for k in every[0] if theirs.get(k) != every[0].get(k)) or "the set-up"
            problem = (f"tensor parallelism: rank {r} differs from rank 0 in {what} ({_short(theirs, every[0], what)}): "
                       "every rank needs the same checkpoint and qspec version")
            break
    if problem is not None:
        e = TensorParallelError(problem)
        e.quiet = comm.rank != 0  # rank 0 reports it; the followers exit quietly, non-zero
        raise e


def _short(theirs: dict, ours: dict, what: str) -> str:
    k = what.split(", ")[0]
    a, b = theirs.get(k), ours.get(k)
    if isinstance(a, dict) and isinstance(b, dict):
        diff = [kk for kk in b if a.get(kk) != b.get(kk)] + [kk for kk in a if kk not in b]
        return f"{k}: {', '.join(map(str, diff[:3]))}"
    return f"{a} vs {b}"


def load_tensor_parallel(prepare, make_backend, make_engine, threads: int | None):
    """The start-up of every rank (module docstring). `prepare()` -> plan (cheap checks, no
    weights), `make_backend(plan, shard)` -> NativeBackend of the shard, `make_engine(plan,
    backend)` -> Engine (rank 0 only). Returns the Engine on rank 0; never returns on the others."""
    global _active
    from .backend import TPBackend, follow
    from .shard import Shard
    from .topology import apply, place

    comm = Comm()
    _joined.set()
    placement = place(int(os.environ.get("LOCAL_RANK", comm.rank)),
                      int(os.environ.get("LOCAL_WORLD_SIZE", comm.world)))
    apply(placement)
    _C.set_num_threads(threads or placement.threads)
    try:
        try:
            if comm.problem:
                raise TensorParallelError(comm.problem)
            plan = prepare()
            shards = [Shard.plan(plan.cfg, r, comm.world) for r in range(comm.world)]
            mine: dict | str = identity(plan.model_dir, plan.cfg, plan.chain, plan.spec)
        except (QspecError, ValueError) as e:
            plan, mine = None, str(e)
        agree(comm, mine)
        cfg = plan.cfg
        try:
            comm.open_shm(cfg.hidden_size, max(s.vocab_rows for s in shards), 2 * cfg.max_seq_len + 64)
        except TensorParallelError as e:  # the same on every rank: rank 0 reports it
            e.quiet = comm.rank != 0
            raise
        try:
            backend = make_backend(plan, shards[comm.rank])
            status: dict | str = {}
        except (QspecError, ValueError) as e:
            backend, status = None, str(e)
        agree(comm, status)
    except BaseException:
        comm.close()
        raise
    if comm.rank == 0:
        _active = comm
        atexit.register(comm.stop, 0)
        return make_engine(plan, TPBackend(backend, comm))
    try:
        code = follow(backend, comm)
    finally:
        comm.close()
    raise SystemExit(code)


def finish(code: int) -> None:
    """Rank 0 is done (`code`: its exit status): the followers exit with the same status."""
    if _active is not None:
        _active.stop(code)


def spawn(world: int, command: list[str]) -> None:
    """`qspec ... --tp N` on one host: this process becomes rank 0 of `world`, and starts ranks
    1.. as `command` (`python -m qspec` with the same arguments; their stdout discarded, stderr
    shared). A rank
    that exits with an error before the group is up ends this process too, with one line, rather
    than leaving it to wait for the connect timeout."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
              "LOCAL_WORLD_SIZE": str(world)}
    procs = []
    for r in range(1, world):
        env = {**os.environ, **common, "RANK": str(r), "LOCAL_RANK": str(r)}
        procs.append(subprocess.Popen(command, env=env,
                                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
    os.environ.update(common, RANK="0", LOCAL_RANK="0")

    def watch():
        for r, p in enumerate(procs, start=1):
            code = p.wait()
            if code and not _joined.wait(timeout=5):  # the group never came up: nothing else would notice
                print(f"qspec: error: tensor-parallel rank {r} exited with status {code} during start-up",
                      file=sys.stderr, flush=True)
                os._exit(1)

    def reap():
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()

    threading.Thread(target=watch, daemon=True).start()
    atexit.register(reap)
