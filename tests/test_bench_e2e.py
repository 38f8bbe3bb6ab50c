"""quads bench e2e on the CPU at a tiny size: every recipe row filled, ratios computed in one run."""

import json

import pytest

from quads.cli import main


@pytest.mark.slow  # a benchmark run: every recipe on both expert paths, plus the trainer
def test_bench_e2e_quick(tmp_path, capsys):
    out = tmp_path / "e2e.json"
    assert main(["bench", "e2e", "--quick", "--preset", "tiny", "--device", "cpu", "--experts", "grouped,loop",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = data["rows"]
    roll = {(r["recipe"], r["experts"]): r for r in rows if r["suite"] == "rollout"}
    recipes = {"bf16", "fp8", "w4a16", "w4a4", "w4a4+rac50"}
    assert set(roll) == {(n, p) for n in recipes for p in ("grouped", "loop")}
    assert all(r["tokens_per_s"] > 0 and r["decode_ms_per_step"] > 0 for r in roll.values())
    assert roll["bf16", "grouped"]["vs_bf16"] == 1.0 and roll["w4a4", "loop"]["vs_grouped"] > 0
    tr = [r for r in rows if r["suite"] == "trainer"]
    assert [r["recipe"] for r in tr] == ["bf16", "w4a16-qat"] and tr[-1]["vs_bf16"] > 0
    assert data["info"]["device"] == "cpu"
    assert "rollout" in capsys.readouterr().out
