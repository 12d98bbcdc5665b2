"""qspec bench batch: plain vs speculative over sequences served at once (quick mode, default model)."""

import json

import pytest

from qspec.bench import batch


def test_batch_quick_reports_each_setting(tmp_path, default_model_dir):
    out = tmp_path / "batch.jsonl"
    batch.main(["--quick", "-m", str(default_model_dir), "--batch", "3", "--settings", "k3,defaults",
                "--json", str(out)])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    rounds = {r["setting"]: r for r in lines if "round" in r}
    summary = {r["setting"]: r for r in lines if "speedup" in r}
    assert set(rounds) == set(summary) == {"plain", "k3", "defaults"}
    assert summary["plain"]["speedup"] == 1 and all(r["tokens_per_s"] > 0 for r in summary.values())
    assert rounds["plain"]["draft_forwards"] == 0
    k3 = rounds["k3"]  # in step: one verify forward a round for all three sequences
    assert k3["draft_forwards"] > 0 and k3["target_forwards"] < rounds["plain"]["target_forwards"]
    assert summary["k3"]["rows_per_target_forward"] > 3


@pytest.mark.parametrize("argv", [["--settings", "k0"], ["--settings", "tree"], ["--batch", "0"],
                                  ["--rounds", "0"]])
def test_batch_bad_arguments_are_one_line(argv, capsys):
    with pytest.raises(SystemExit) as e:
        batch.main(argv)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err.strip().splitlines()[-1]
