"""scripts/budget_curve.py on fabricated run folders: one point per run that scored the trainer's own
policy, its change taken at the series' common step and against the series' alpha-1 runs."""

import json
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def make_run(path: Path, recipe: str, alpha: float, evals: dict[int, float] | None, k3: float, steps: int) -> None:
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump({"recipe": {"name": recipe, "rollout_error_scale": alpha}}))
    recs = []
    for s in range(steps + 1):
        r = {"step": s}
        if s:
            r.update({"mismatch/k3": k3, "mismatch/seq_gap_mean": 100 * k3})
        if evals and s in evals:
            r["eval/trainer_pass@1"] = evals[s]
        recs.append(r)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_budget_curve_points(tmp_path):
    runs = tmp_path / "runs"
    make_run(runs / "bf16-s0", "bf16", 1.0, {0: 0.4, 10: 0.5, 20: 0.6}, 1e-4, 20)
    make_run(runs / "nvfp4-s0", "nvfp4", 1.0, {0: 0.4, 10: 0.45, 20: 0.5}, 1e-3, 20)
    make_run(runs / "nvfp4x8-s0", "nvfp4", 8.0, {0: 0.4, 10: 0.2, 15: 0.1}, 1.0, 15)  # stopped earlier
    make_run(tmp_path / "more" / "quads-s0", "quads", 1.0, None, 1e-4, 20)  # no trainer's policy evals: skipped
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, str(ROOT / "scripts/budget_curve.py"), "--out", str(out),
                          "--series", f"toy={runs}/*,{tmp_path}/more/*,{runs}/bf16-s0"], capture_output=True, text=True, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "MPLBACKEND": "Agg"})
    assert res.returncode == 0, res.stderr
    assert "3 runs in 1 series" in res.stdout and "skipped" in res.stdout
    data = json.loads((out / "budget_curve.json").read_text())
    (label, pts), = data["series"].items()
    assert label == "toy, at step 15" and data["skipped"] == [str(tmp_path / "more" / "quads-s0")]
    by = {Path(p["run"]).name: p for p in pts}
    # at step 15 (the last step every run reached): bf16 +0.1, nvfp4 +0.05 -> the alpha-1 reference +0.075
    assert abs(by["bf16-s0"]["change"] - 0.025) < 1e-9 and abs(by["nvfp4x8-s0"]["change"] - (-0.3 - 0.075)) < 1e-9
    assert by["nvfp4x8-s0"]["k3"] == 1.0 and by["nvfp4x8-s0"]["seq_gap"] == 100.0
    assert (out / "budget_curve.png").read_bytes()[:4] == b"\x89PNG"
