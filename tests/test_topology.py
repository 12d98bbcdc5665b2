"""qspec.parallel.topology on fake sysfs trees: NUMA nodes, physical cores, rank placement."""

import os

import pytest

from qspec.parallel import topology as topo
from qspec.parallel.topology import Placement, cpu_nodes, parse_cpulist, physical_cores, place


def fake_nodes(root, nodes: dict[int, str]) -> str:
    for n, cpulist in nodes.items():
        d = root / "node" / f"node{n}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpulist + "\n")
    (root / "node" / "possible").write_text("0-7\n")  # a file, not a node: ignored
    return str(root / "node")


def fake_cpus(root, cpus: dict[int, dict[str, str]]) -> str:
    for c, files in cpus.items():
        d = root / "cpu" / f"cpu{c}" / "topology"
        d.mkdir(parents=True)
        for name, text in files.items():
            (d / name).write_text(text + "\n")
    return str(root / "cpu")


@pytest.fixture
def affinity(monkeypatch):
    """Set the CPUs this process may run on, as seen by topology."""
    def set_(cpus):
        monkeypatch.setattr(topo.os, "sched_getaffinity", lambda pid: set(cpus))
    return set_


def test_parse_cpulist():
    assert parse_cpulist("0-3,8-11\n") == [0, 1, 2, 3, 8, 9, 10, 11]
    assert parse_cpulist("5") == [5]
    assert parse_cpulist("") == []
    assert parse_cpulist("2,0-1") == [0, 1, 2]


def test_cpu_nodes_ordered_and_intersected_with_affinity(tmp_path, affinity):
    root = fake_nodes(tmp_path, {0: "0-3,8-11", 1: "4-7,12-15", 10: "16-17", 2: ""})
    affinity(range(16))
    assert cpu_nodes(root) == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]
    affinity([1, 2, 16, 17])  # node 1 has no allowed cpu: dropped; node10 sorts after node2
    assert cpu_nodes(root) == [[1, 2], [16, 17]]


def test_cpu_nodes_without_sysfs_is_the_affinity_set(tmp_path, affinity):
    affinity([3, 1, 2])
    assert cpu_nodes(str(tmp_path / "missing")) == [[1, 2, 3]]
    root = fake_nodes(tmp_path, {0: "8-9"})  # nodes exist but none is allowed
    assert cpu_nodes(root) == [[1, 2, 3]]


def test_cpu_nodes_of_this_machine():
    nodes = cpu_nodes()
    assert nodes and all(nodes)
    assert sorted(c for n in nodes for c in n) == sorted(os.sched_getaffinity(0))
    assert topo.default_world_size() == len(nodes) >= 1
    p = place(0, len(nodes))  # the default: nodes and cores of this machine
    assert p.cpus and set(p.cpus) <= set(nodes[0]) and 1 <= p.threads <= len(p.cpus)


def test_physical_cores_from_thread_siblings(tmp_path):
    sib = {c: {"thread_siblings_list": f"{c % 4},{c % 4 + 4}"} for c in range(8)}
    root = fake_cpus(tmp_path, sib)
    assert physical_cores([0, 1, 2, 3, 4, 5, 6, 7], root) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert physical_cores([5, 1, 6], root) == [[1, 5], [6]]  # only the cpus asked for


def test_physical_cores_from_package_and_core_id(tmp_path):
    # core_id repeats across packages: (package, core) is the key
    ids = {c: {"physical_package_id": str(c // 4), "core_id": str(c % 2)} for c in range(8)}
    root = fake_cpus(tmp_path, ids)
    assert physical_cores(list(range(8)), root) == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_physical_cores_without_topology_files(tmp_path):
    assert physical_cores([2, 0, 1], str(tmp_path)) == [[0], [1], [2]]


def test_place_one_rank_per_node(tmp_path):
    nodes, root = [[0, 1, 2, 3], [4, 5, 6, 7]], str(tmp_path)
    assert place(0, 2, nodes, root) == Placement([0, 1, 2, 3], 4, True)
    assert place(1, 2, nodes, root) == Placement([4, 5, 6, 7], 4, True)
    assert place(0, 1, nodes, root) == Placement([0, 1, 2, 3], 4, True)  # fewer ranks than nodes


def test_place_ranks_sharing_a_node_split_its_cores(tmp_path):
    # 2 nodes of 3 cores with 2 SMT threads each: siblings c and c + 12
    sib = {c: {"thread_siblings_list": f"{c % 12},{c % 12 + 12}"} for c in range(24)}
    root = fake_cpus(tmp_path, sib)
    nodes = [[0, 1, 2, 12, 13, 14], [3, 4, 5, 15, 16, 17]]
    got = [place(r, 4, nodes, root) for r in range(4)]
    # ranks 0, 1 on node 0 (cores {0,12} | {1,13},{2,14}), 2, 3 on node 1
    assert got == [Placement([0, 12], 1, True), Placement([1, 2, 13, 14], 2, True),
                   Placement([3, 15], 1, True), Placement([4, 5, 16, 17], 2, True)]
    # 3 ranks on 2 nodes: 0, 1 share node 0; 2 has node 1 alone
    assert [place(r, 3, nodes, root).cpus for r in range(3)] == [[0, 12], [1, 2, 13, 14], [3, 4, 5, 15, 16, 17]]
    # more ranks than cores on a node: ranks share cores, 1 thread each
    got = [place(r, 8, nodes, root) for r in range(8)]
    assert [p.cpus for p in got[:4]] == [[0, 12], [0, 12], [1, 13], [2, 14]]
    assert all(p.threads == 1 for p in got)


def test_ranks_pinned_unless_they_share_cores(tmp_path):
    root = str(tmp_path)  # no topology files: each cpu its own core
    assert place(0, 2, [[0], [1]], root) == Placement([0], 1, True)
    assert place(1, 2, [[0, 1]], root) == Placement([1], 1, True)
    assert place(2, 3, [[0, 1]], root) == Placement([1], 1, False)  # 3 ranks on 2 one-thread cores


def test_every_core_used_once_when_ranks_fit(tmp_path):
    nodes = [list(range(7))]
    for world in range(1, 8):
        ps = [place(r, world, nodes, str(tmp_path)) for r in range(world)]
        assert sorted(c for p in ps for c in p.cpus) == list(range(7))
        assert max(p.threads for p in ps) - min(p.threads for p in ps) <= 1


@pytest.mark.parametrize("rank,world", [(-1, 2), (2, 2), (0, 0), (1.0, 2), (0, "2"), (True, 2)])
def test_place_bad_rank_or_world(rank, world):
    with pytest.raises(ValueError, match="local"):
        place(rank, world, [[0, 1]])


def test_place_without_cpus():
    with pytest.raises(ValueError, match="no CPUs"):
        place(0, 1, [])


def test_apply_pins_only_when_asked(monkeypatch):
    calls = []
    monkeypatch.setattr(topo.os, "sched_setaffinity", lambda pid, cpus: calls.append((pid, list(cpus))))
    topo.apply(Placement([0], 1, False))
    assert calls == []
    topo.apply(Placement([0, 1], 2, True))
    assert calls == [(0, [0, 1])]
