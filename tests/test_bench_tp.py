"""`qspec bench tp`: the projection's arithmetic on a tiny hand-checkable model, the latency
lookup, and a real collectives run of 2 ranks on loopback gloo."""

import json

import pytest

from qspec.bench import tp
from qspec.cli import main as cli
from qspec.errors import TensorParallelError

# hidden 4, FFN 8, 1 layer, 2 heads of dim 2, 1 KV head, vocab 16:
# per layer q 4x4 + k, v 2 x 4x2 + o 4x4 + gate, up, down 3 x 4x8 = 144; LM head 16x4 = 64
TINY = tp.Shape("tiny", hidden=4, intermediate=8, layers=1, heads=2, kv_heads=1, vocab=16, head_dim=2)
KB = 1e-6  # --socket-gbs 1e-6 and --net-gbps 8e-6 are 1000 bytes per second


def links(intra_us=1000.0, net_us=1000.0):
    return tp.Links(None, intra_us, net_us, net_gbps=8e-6)


def test_shape_bytes():
    assert TINY.gemm_weights() == 208
    assert TINY.kv_bytes(10) == 2 * 1 * 1 * 2 * 10 * 2  # K and V, layers, kv heads, head dim, positions, BF16
    assert tp.SHAPES[0].gemm_weights() == pytest.approx(7.5e9, rel=0.01)  # Llama-3.1-8B minus embedding
    assert tp.SHAPES[1].gemm_weights() == pytest.approx(69.5e9, rel=0.01)


def test_projection_one_socket_by_hand():
    one = tp.Setup("1 socket", 1, 1)
    r = tp.project(TINY, one, links(), socket_gbs=KB, context=10, k=2, tau=2.0, draft_bits=4, command_bytes=64)
    # plain: 208 weights x 2 B + 80 B of KV = 496 B at 1000 B/s; draft: 208 x 0.5 + 80 = 184 B
    assert r["comm_ms"] == 0 and r["step_ms"] == pytest.approx(496)
    assert r["draft_ms"] == pytest.approx(184) and r["verify_ms"] == pytest.approx(496)
    assert r["c"] == pytest.approx(184 / 496) and r["v"] == pytest.approx(1)
    assert r["speedup"] == pytest.approx(2 / (2 * 184 / 496 + 1))
    assert r["spec_tok_s"] == pytest.approx(2 / (2 * 0.184 + 0.496))
    assert r["plain_tok_s"] == pytest.approx(1 / 0.496) and r["projection"] is True


def test_projection_sockets_and_hosts_by_hand():
    kw = dict(socket_gbs=KB, context=10, k=2, tau=2.0, draft_bits=4, command_bytes=64)
    two = tp.project(TINY, tp.Setup("2 sockets", 1, 2), links(), **kw)
    # per forward 2 reductions + 1 gather + 1 command, 1 ms each
    assert two["mem_ms"] == pytest.approx(248) and two["comm_ms"] == pytest.approx(4)
    hosts = tp.project(TINY, tp.Setup("2 hosts", 2, 2), links(), **kw)
    # 4 ranks, 2 of them remote. reduction: 1 ms intra + 1 ms net + 2 local ranks x 2 remote x 16 B at
    # 1000 B/s = 66 ms; gather: 1 + 1 ms + 2 remote slices of [1, 4] fp32 = 34 ms; command 2 ms
    assert hosts["mem_ms"] == pytest.approx(124)
    assert hosts["comm_ms"] == pytest.approx(2 * 66 + 34 + 2)
    # verify of K+1 = 3 rows: reduction 2 + 3 x 64 = 194 ms, gather 2 + 96 = 98, command 2
    assert hosts["verify_ms"] == pytest.approx(124 + 2 * 194 + 98 + 2)


def test_links_fit_a_line_through_measured_latencies():
    rows = [{"op": "reduce", "bytes": 100 * i, "median_us": 10.0 * i + 3} for i in range(1, 6)]
    rows[3]["median_us"] = 4000  # one size disturbed by other load: the line ignores it
    rows += [{"op": "command", "bytes": 64, "median_us": 5.0}, {"op": "command", "bytes": 256, "median_us": 4.0}]
    rows = [{**r, "transport": "shm"} for r in rows]
    gloo = [{"op": "reduce", "bytes": 100, "median_us": 500.0, "transport": "gloo"}]
    lk = tp.Links(rows + gloo, None, 25, 100)  # shared memory where measured
    assert lk.lines["reduce"] == pytest.approx((3e-6, 0.1e-6))
    assert lk.intra("reduce", 150) == pytest.approx(18e-6)
    assert lk.intra("reduce", 1000) == pytest.approx(103e-6)
    assert lk.intra("command", 64) == pytest.approx(4.5e-6)  # falling with size: slope 0, median
    assert tp.Links(rows, 7.0, 25, 100).intra("reduce", 1e9) == pytest.approx(7e-6)  # --intra-latency-us wins
    assert tp.theil_sen([(10, 2.0)]) == (2.0, 0.0)
    assert tp.Links(gloo, None, 25, 100).intra("reduce", 1) == pytest.approx(500e-6)  # else gloo


def test_projection_section_with_given_latency(tmp_path, capsys):
    out = tmp_path / "tp.jsonl"
    tp.main(["--what", "projection", "--intra-latency-us", "100", "--json", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == len(tp.SHAPES) * len(tp.SETUPS)
    assert all(r["projection"] is True and r["section"] == "projection" for r in rows)
    one = {r["model"]: r for r in rows if r["tp"] == 1}
    for r in rows:
        assert (r["comm_ms"] > 0) == (r["tp"] > 1) and r["step_ms"] == pytest.approx(r["mem_ms"] + r["comm_ms"])
        assert r["mem_ms"] == pytest.approx(one[r["model"]]["mem_ms"] / r["tp"])
    assert "PROJECTION" in capsys.readouterr().out


def test_bad_options(capsys):
    for argv in (["--what", "collectives,e2f"], ["--world", "1"], ["--net-gbps", "0"], ["--reps", "3"],
                 ["--transport", "tcp"]):
        with pytest.raises(SystemExit) as e:
            tp.main(argv)
        assert e.value.code == 2


def test_a_failing_rank_is_one_clear_error():
    with pytest.raises(TensorParallelError, match="rank 0 of the collectives run failed: .*"):
        tp.measure(2, [{"op": "gather", "m": -1, "vocab": 8, "bytes": 4}], reps=10, warmup=1)


def test_bench_tp_collectives_quick(tmp_path):
    out = tmp_path / "tp.jsonl"
    png = tmp_path / "tp.png"
    assert cli(["bench", "tp", "--what", "collectives", "--quick", "--world", "2", "--json", str(out),
                "--plot", str(png)]) in (0, None)
    assert png.stat().st_size > 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    ops = ["reduce"] * 4 + ["gather"] * 2 + ["command"] * 2
    assert [(r["transport"], r["op"]) for r in rows[:16]] == [("shm", op) for op in ops] + [("gloo", op) for op in ops]
    fwd = rows[16:]
    assert [(r["transport"], r["m"]) for r in fwd] == [("shm", 1), ("shm", 9), ("gloo", 1), ("gloo", 9)]
    for r in fwd:  # 56 reductions of [m, 1536] + the gather of 151936 / 2 columns + the command
        parts = [x["median_us"] for x in rows[:16] if x["transport"] == r["transport"] and x["m"] == r["m"]
                 and x.get("d", 1536) == 1536]
        assert r["per_forward_us"] == pytest.approx(56 * parts[0] + parts[1] + parts[2])
    rows = rows[:16]
    for r in rows:
        assert r["section"] == "collectives" and r["world"] == 2 and r["reps"] == 200
        assert 0 < r["p10_us"] <= r["median_us"] <= r["p90_us"] < 1e6, r
        assert r["rank0_median_us"] > 0 and "commit" in r
    assert [r["bytes"] for r in rows[4:8]] == [1 * 75968 * 4, 9 * 75968 * 4, 9 * 8, 17 * 8]  # logits, commands
