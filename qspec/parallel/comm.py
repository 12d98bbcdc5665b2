"""The collectives of tensor parallelism, on torch.distributed (the ranks' rendezvous is torchrun's
environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).

Per forward: one command from rank 0 (what to run), two row reductions per layer (after the
row-parallel O and down projections) and one logits gather to rank 0.

The row reduction keeps batch invariance (docs/architecture.md, invariant 2): every rank gets every
other rank's [m, hidden] partial sums and adds the world's partials element by element in rank
order, p0 + p1 + ... So a row's sum never depends on m, on the other rows or on how a transport
would chunk a buffer (a ring all-reduce may split it by size and change the order); every rank
computes the same bits, so the replicated hidden state stays identical on all ranks.

Transports (QSPEC_TP_TRANSPORT=auto|shm|gloo): torch.distributed's gloo always sets the group up,
exchanges the start-up checks and carries everything between hosts. When every rank is on one
host (auto), the per-forward collectives go through one shared-memory segment instead
(csrc/shm_group.h: on a 2-core VM gloo measured 0.1-4 ms per collective, the segment a few
microseconds), like the CPU paths of vLLM, SGLang and DeepSpeed. Both add in the same order: the
bits are the same.

Failures: a rank that dies closes its sockets (or leaves its pid), and the next collective of the
others raises; a rank that hangs is given up on after QSPEC_TP_TIMEOUT seconds (default 300). Both
become TensorParallelError. The followers' wait for rank 0's next command has no such limit (a
server may be idle for hours); it ends when rank 0 sends STOP or its process goes away.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from datetime import timedelta
from pathlib import Path

import numpy as np

from .. import _C
from ..errors import TensorParallelError

TIMEOUT_ENV = "QSPEC_TP_TIMEOUT"
CONNECT_TIMEOUT_ENV = "QSPEC_TP_CONNECT_TIMEOUT"
TRANSPORT_ENV = "QSPEC_TP_TRANSPORT"
HEADER = 8                    # int64s before a command's payload: op, payload length, 6 arguments
FORWARD, COPY_ROWS, STOP = 1, 2, 3
SHM_DIR = Path("/dev/shm")
REDUCE_ROWS = 256             # rows of [m, hidden] per shared-memory reduction step (more: in chunks)
LOGITS_ROWS = 16              # logits rows per shared-memory gather step


def _seconds(env: str, default: float) -> float:
    raw = os.environ.get(env, "")
    try:
        v = float(raw) if raw else default
    except ValueError:
        raise TensorParallelError(f"{env} must be a number of seconds, got {raw!r}") from None
    if v <= 0:
        raise TensorParallelError(f"{env} must be > 0, got {raw!r}")
    return v


def env_world() -> int:
    """WORLD_SIZE of the environment torchrun (or `qspec --tp`) set; 1 without one."""
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        return max(1, int(raw))
    except ValueError:
        raise TensorParallelError(f"WORLD_SIZE must be an integer, got {raw!r}") from None


def _host() -> str:
    """Names this host (and boot): ranks with the same name can share memory."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


class Comm:
    """This process's membership in the tensor-parallel group, and the collectives the forward uses.

    `reducer` is what the native forward calls on its partial sums (the shared-memory group itself,
    called without Python, or reduce_rows). `collective_s` / `collectives` count the time spent in
    the commands and logits gathers (waiting for a slower rank included) and their number; the
    model's profile has the reductions' time (reduce_s)."""

    def __init__(self):
        import torch
        import torch.distributed as dist

        self._torch, self._dist = torch, dist
        # a bad setting is kept in `problem` (defaults used meanwhile) and reported once the ranks
        # have met, so that rank 0 says it once (qspec/parallel/launch.py) rather than every rank
        self.problem: str | None = None
        self.transport = os.environ.get(TRANSPORT_ENV, "auto").strip().lower() or "auto"
        if self.transport not in ("auto", "shm", "gloo"):
            self.problem = f"{TRANSPORT_ENV} must be auto, shm or gloo, got {self.transport!r}"
            self.transport = "auto"
        connect = self._setting(CONNECT_TIMEOUT_ENV, 60.0)
        self.timeout = self._setting(TIMEOUT_ENV, 300.0)
        for k in ("MASTER_ADDR", "MASTER_PORT", "RANK"):
            if k not in os.environ:
                raise TensorParallelError(f"tensor parallelism needs {k} in the environment: launch the ranks "
                                          "with torchrun or `qspec ... --tp N`")
        try:
            dist.init_process_group("gloo", timeout=timedelta(seconds=connect))
        except Exception as e:  # the store or a peer cannot be reached in time
            addr = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
            raise TensorParallelError(f"tensor parallelism: rank {os.environ['RANK']} could not meet the other "
                                      f"ranks at {addr} within {connect:g} s ({_first_line(e)})") from None
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.peers = [r for r in range(self.world) if r != self.rank]
        # forwards' collectives give up after the timeout; the command wait (idle followers) never does
        self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout))
        self._commands = dist.new_group(backend="gloo", timeout=timedelta(days=3650))
        self._parts: dict[int, object] = {}
        self._sum = np.empty(0, dtype=np.float32)
        self.shm = None
        self.broken: TensorParallelError | None = None
        self.stopped = False
        self.collective_s, self.collectives = 0.0, 0

    def _setting(self, env: str, default: float) -> float:
        try:
            return _seconds(env, default)
        except TensorParallelError as e:
            self.problem = self.problem or str(e)
            return default

    @property
    def reducer(self):
        return self.shm if self.shm is not None else self.reduce_rows

    # ----------------------------------------------------------- the shared-memory transport
    def open_shm(self, hidden: int, logits_width: int, max_payload: int) -> str:
        """Every rank: move the per-forward collectives to shared memory when QSPEC_TP_TRANSPORT and
        the hosts allow it; the transport in use ("shm" or "gloo", with why)."""
        hosts = self.exchange((_host(), os.getpid()))
        one_host = all(h == hosts[0][0] for h, _ in hosts)
        if self.transport == "gloo" or not one_host:
            if self.transport == "shm":
                raise TensorParallelError(f"{TRANSPORT_ENV}=shm needs every rank on one host")
            return "gloo" + ("" if one_host else " (ranks on several hosts)")
        pids = [pid for _, pid in hosts]
        path = str(SHM_DIR / f"qspec-tp-{uuid.uuid4().hex}") if self.rank == 0 else ""
        caps = (REDUCE_ROWS * hidden, LOGITS_ROWS * logits_width, HEADER + max_payload)
        group, error = None, ""
        if self.rank == 0:
            try:
                group = _C.ShmGroup(path, 0, self.world, True, pids, *caps)
            except (RuntimeError, ValueError) as e:
                error = _first_line(e)
        path, error = self.exchange((path, error))[0]
        if not error and self.rank:
            try:
                group = _C.ShmGroup(path, self.rank, self.world, False, pids, *caps)
            except (RuntimeError, ValueError) as e:
                error = f"rank {self.rank}: {_first_line(e)}"
        errors = [e for e in self.exchange(error) if e]
        if self.rank == 0 and path:
            Path(path).unlink(missing_ok=True)  # every rank has mapped it (or given up): no file left behind
        if errors:
            if self.transport == "shm":
                raise TensorParallelError(f"tensor parallelism: shared memory: {errors[0]}")
            return f"gloo (shared memory failed: {errors[0]})"
        group.set_timeout(self.timeout)
        self.shm = group
        return "shm"

    # ----------------------------------------------------------- forward collectives
    def reduce_rows(self, x: np.ndarray) -> None:
        """x [m, hidden] float32, this rank's partial sums: replaced in place by p0 + p1 + ... in
        rank order (bit-identical on every rank, whatever m). The gloo transport's reducer."""
        self._check()
        torch, dist = self._torch, self._dist
        n = x.size
        mine = torch.from_numpy(x.reshape(-1))
        try:
            reqs = [dist.isend(mine, p, group=self._group) for p in self.peers]
            for p in self.peers:
                buf = self._parts.get(p)
                if buf is None or buf.numel() < n:
                    buf = self._parts[p] = torch.empty(max(n, 2 * (0 if buf is None else buf.numel())))
                reqs.append(dist.irecv(buf[:n], p, group=self._group))
            for r in reqs:
                r.wait()
        except Exception as e:
            raise self.broke("a row reduction", e) from None
        if self._sum.size < n:
            self._sum = np.empty(n, dtype=np.float32)
        acc = self._sum[:n].reshape(x.shape)
        parts = [x if r == self.rank else self._parts[r][:n].numpy().reshape(x.shape) for r in range(self.world)]
        np.add(parts[0], parts[1], out=acc)
        for p in parts[2:]:
            np.add(acc, p, out=acc)
        x[...] = acc

    def gather_logits(self, local: np.ndarray, out: np.ndarray | None, columns: list[tuple[int, int]]) -> None:
        """Rank 0: fill out[:, columns[r]] with rank r's logits (its own from `local`); the others
        send `local` [rows, their vocab rows] to rank 0 (`out` None)."""
        self._check()
        t0 = time.perf_counter()
        local = np.ascontiguousarray(local)
        try:
            if self.shm is not None:
                self.shm.gather(local, out, columns)
            elif self.rank:
                self._dist.send(self._torch.from_numpy(local), 0, group=self._group)
            else:
                rows = local.shape[0]
                bufs = {p: self._torch.empty((rows, columns[p][1] - columns[p][0])) for p in self.peers}
                reqs = [self._dist.irecv(bufs[p], p, group=self._group) for p in self.peers]
                lo, hi = columns[0]
                out[:rows, lo:hi] = local
                for p, r in zip(self.peers, reqs):
                    r.wait()
                    lo, hi = columns[p]
                    out[:rows, lo:hi] = bufs[p].numpy()
        except Exception as e:
            raise self.broke("the logits gather", e) from None
        self._count(t0)

    # ----------------------------------------------------------- rank 0's commands
    def send(self, op: int, args: tuple[int, ...] = (), payload=()) -> None:
        """Rank 0: tell the followers what to run next (op, up to 6 int arguments, int payload)."""
        self._check()
        payload = np.asarray(payload, dtype=np.int64).reshape(-1)
        cmd = np.zeros(HEADER + payload.size, dtype=np.int64)
        cmd[0], cmd[1] = op, payload.size
        cmd[2:2 + len(args)] = args
        cmd[HEADER:] = payload
        t0 = time.perf_counter()
        try:
            if self.shm is not None:
                self.shm.send(cmd)
            else:
                self._dist.broadcast(self._torch.from_numpy(cmd[:HEADER].copy()), 0, group=self._commands)
                if payload.size:
                    self._dist.broadcast(self._torch.from_numpy(payload), 0, group=self._commands)
        except Exception as e:
            raise self.broke("sending a command to the ranks", e) from None
        self._count(t0)

    def receive(self) -> tuple[int, list[int], np.ndarray]:
        """A follower: the next command of rank 0 (op, the 6 arguments, payload)."""
        try:
            if self.shm is not None:
                cmd = self.shm.receive()
                payload = cmd[HEADER:]
            else:
                head = self._torch.zeros(HEADER, dtype=self._torch.int64)
                self._dist.broadcast(head, 0, group=self._commands)
                cmd = head.numpy()
                payload = self._torch.empty(int(cmd[1]), dtype=self._torch.int64)
                if payload.numel():
                    self._dist.broadcast(payload, 0, group=self._commands)
                payload = payload.numpy()
        except Exception as e:
            raise self.broke("the wait for rank 0", e) from None
        return int(cmd[0]), [int(v) for v in cmd[2:HEADER]], payload

    # ----------------------------------------------------------- start and end
    def exchange(self, obj) -> list:
        """Every rank's `obj` (picklable), in rank order."""
        out = [None] * self.world
        try:
            self._dist.all_gather_object(out, obj, group=self._group)
        except Exception as e:
            raise self.broke("the start-up exchange", e) from None
        return out

    def stop(self, code: int = 0) -> None:
        """Rank 0: release the followers (they exit with `code`); once, and quietly when the group
        is already broken."""
        if self.rank or self.stopped:
            return
        self.stopped = True
        if self.broken is None:
            try:
                self.send(STOP, (int(code),))
            except TensorParallelError:
                pass

    def close(self) -> None:
        self.shm = None
        try:
            self._dist.destroy_process_group()
        except Exception:  # a broken group cannot always be torn down cleanly; the process is ending
            pass

    def broke(self, what: str, e: BaseException) -> TensorParallelError:
        """The group is unusable from now on: the error every later call raises."""
        if self.broken is None:
            self.broken = TensorParallelError(
                f"tensor parallelism: {what} failed: {_first_line(e)}" if isinstance(e, _C.PeerLost) else
                f"tensor parallelism: {what} failed, a rank stopped answering or exited ({_first_line(e)})")
        return self.broken

    def _count(self, t0: float) -> None:
        self.collective_s += time.perf_counter() - t0
        self.collectives += 1

    def _check(self) -> None:
        if self.broken is not None:
            raise self.broken
