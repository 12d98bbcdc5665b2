"""CPU topology for tensor-parallel ranks: NUMA nodes, physical cores, and where a rank runs.

One rank per NUMA node by default (each streams its weight shard from its own node's memory);
ranks that share a node split its physical cores into contiguous groups, SMT siblings together.
Everything is read from sysfs (Linux) and intersected with the process's CPU affinity, so a
container or `taskset` limit is respected; without sysfs the affinity set is one node of cores
of one CPU each.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

NODE_ROOT = "/sys/devices/system/node"
CPU_ROOT = "/sys/devices/system/cpu"


def parse_cpulist(s: str) -> list[int]:
    """"0-3,8-11" -> [0, 1, 2, 3, 8, 9, 10, 11] (the kernel's cpulist format; "" -> [])."""
    out: list[int] = []
    for part in s.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return sorted(set(out))


def allowed_cpus() -> set[int]:
    """The CPUs this process may run on."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return set(range(os.cpu_count() or 1))


def cpu_nodes(node_root: str = NODE_ROOT) -> list[list[int]]:
    """The CPUs of each NUMA node (nodeN/cpulist) this process may run on, nodes in N order;
    nodes without an allowed CPU are dropped. No readable node -> one node of the affinity set."""
    allowed = allowed_cpus()
    dirs = []
    for d in Path(node_root).glob("node*"):
        if d.name[4:].isdigit():
            dirs.append((int(d.name[4:]), d))
    nodes = []
    for _, d in sorted(dirs):
        try:
            cpus = set(parse_cpulist((d / "cpulist").read_text())) & allowed
        except (OSError, ValueError):
            continue
        if cpus:
            nodes.append(sorted(cpus))
    return nodes or [sorted(allowed)]


def _core_key(cpu: int, cpu_root: Path):
    topo = cpu_root / f"cpu{cpu}" / "topology"
    try:
        return ("siblings", tuple(parse_cpulist((topo / "thread_siblings_list").read_text())))
    except (OSError, ValueError):
        pass
    try:
        return ("ids", int((topo / "physical_package_id").read_text()), int((topo / "core_id").read_text()))
    except (OSError, ValueError):
        return ("cpu", cpu)


def physical_cores(cpus: list[int], cpu_root: str = CPU_ROOT) -> list[list[int]]:
    """`cpus` grouped by physical core (cpuN/topology/thread_siblings_list, else
    physical_package_id + core_id; neither -> each CPU its own core). Groups hold only CPUs of
    `cpus`, sorted, and are ordered by their lowest CPU."""
    groups: dict = {}
    for c in sorted(set(cpus)):
        groups.setdefault(_core_key(c, Path(cpu_root)), []).append(c)
    return sorted(groups.values())


def default_world_size() -> int:
    """Ranks on this host by default: one per NUMA node with an allowed CPU (>= 1)."""
    return len(cpu_nodes())


@dataclass
class Placement:
    """Where one rank runs: the CPUs it may use, its thread count, whether to pin it to them."""
    cpus: list[int]
    threads: int
    pin: bool


def place(local_rank: int, local_world: int, nodes: list[list[int]] | None = None,
          cpu_root: str = CPU_ROOT) -> Placement:
    """The placement of rank `local_rank` of `local_world` ranks on this host over `nodes`
    (default: cpu_nodes(); cores from physical_cores(..., cpu_root)). With no more ranks than nodes, rank r takes node r; with more,
    consecutive ranks share a node (4 ranks on 2 nodes: 0, 1 on node 0; 2, 3 on node 1) and
    split its physical cores into contiguous groups as even as possible, SMT siblings together;
    threads = physical cores in the group. More ranks than cores on a node: each rank gets one
    core (ranks share cores), 1 thread."""
    if isinstance(local_world, bool) or not isinstance(local_world, int) or local_world < 1:
        raise ValueError(f"local world size must be an integer >= 1, got {local_world!r}")
    if isinstance(local_rank, bool) or not isinstance(local_rank, int) or not 0 <= local_rank < local_world:
        raise ValueError(f"local rank must be an integer in 0..{local_world - 1}, got {local_rank!r}")
    nodes = [n for n in (cpu_nodes() if nodes is None else nodes) if n]
    if not nodes:
        raise ValueError("no CPUs to place ranks on")
    n = len(nodes)

    def node_of(r: int) -> int:
        return r if local_world <= n else r * n // local_world

    node = node_of(local_rank)
    sharing = [r for r in range(local_world) if node_of(r) == node]
    k, i = len(sharing), sharing.index(local_rank)
    cores = physical_cores(nodes[node], cpu_root)
    if k <= len(cores):
        group = cores[i * len(cores) // k:(i + 1) * len(cores) // k]
    else:
        group = [cores[i * len(cores) // k]]
    cpus = sorted(c for core in group for c in core)
    # Ranks that share cores (more ranks than cores) are left to the scheduler: pinned, a waiting
    # rank could not give its core to the rank it waits for.
    return Placement(cpus=cpus, threads=len(group), pin=k <= len(cores))


def apply(p: Placement) -> None:
    """Pin the calling thread, and the threads it starts from now on (the compute pool), to p.cpus
    when p.pin. Call it after torch.distributed's group is up: gloo's I/O threads, started by then,
    stay unpinned. Measured on a 2-core VM with one rank per core: the compute thread pinned gave
    1.5B decode steps of 86-99 ms against 130-137 ms unpinned (the scheduler put both ranks on
    one core at times), while a rank pinned whole, gloo's threads included, made each gloo
    collective wait for a scheduler tick (3.8 ms against 80 us)."""
    if p.pin:
        os.sched_setaffinity(0, p.cpus)
