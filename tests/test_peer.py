"""qspec bench peer: llama.cpp beside qspec (the optional `peer` extra, llama-cpp-python).

The run itself needs llama_cpp and is skipped without it (CI does not install the extra); the
one-line message for a missing extra is checked always, with llama_cpp hidden from import.
"""

import importlib.util
import json
import sys

import pytest

from qspec.bench import peer

HAVE_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None


def test_missing_llama_cpp_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp -> ImportError
    from qspec.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "peer", "--prompts", "1"])
    msg = str(e.value.code)
    assert "\n" not in msg and "llama-cpp-python" in msg and peer.INSTALL_COMMAND in msg


def test_first_difference():
    assert peer.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert peer.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert peer.first_difference([1, 2, 3], [1, 2]) == 2


def test_unknown_config_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        peer.main(["--configs", "bf16,fp8"])
    assert e.value.code == 2 and "unknown config 'fp8'" in capsys.readouterr().err


@pytest.mark.skipif(not HAVE_LLAMA_CPP, reason="llama-cpp-python (the optional `peer` extra) is not installed")
def test_peer_bench_on_the_default_model(default_model_dir, tmp_path, capsys):
    out = tmp_path / "peer.jsonl"
    peer.main(["--threads", "2", "--prompts", "2", "--max-new", "8", "--configs", "bf16,gguf,bf16+lookup",
               "--json", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    cases = {(r["engine"], r["config"]): r for r in rows if r["mode"] == "case"}
    assert set(cases) == {("qspec", "plain"), ("qspec", "speculative"), ("llama.cpp", "bf16"),
                          ("llama.cpp", "gguf"), ("llama.cpp", "bf16+lookup")}
    for r in cases.values():
        assert r["tokens_per_s"] > 0 and r["prefill_ms"] > 0 and r["prompts"] == 2
        assert 2 <= r["new_tokens"] <= 16 and r["llama_cpp_python"]
    assert cases[("qspec", "plain")]["vs_qspec_plain"] == 1.0
    assert "Q4_1" in cases[("llama.cpp", "gguf")]["weights"] and "BF16" in cases[("llama.cpp", "bf16")]["weights"]
    compares = [r for r in rows if r["mode"] == "compare"]
    assert [c["prompt"] for c in compares] == [0, 1]
    for c in compares:
        assert c["qspec_spec_equals_plain"] is True  # lossless
        assert "bf16_first_diff" in c and isinstance(c["bf16+lookup_equals_bf16"], bool)
    text = capsys.readouterr().out
    assert "llama.cpp bf16 vs qspec plain: identical on" in text and "llama-cpp-python" in text
