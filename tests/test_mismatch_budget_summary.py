"""scripts/mismatch_budget_summary.py on fabricated sweep folders: the per-(alpha, recipe) table, the
trainer's policy columns only where the runs logged eval/trainer_pass@1, one JSON line per run."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def recipe_row(recipe, seeds, **kw):
    return {"recipe": recipe, "seeds": seeds, "finished": seeds, "reward_final": 0.3, "eval_start": 0.4,
            "eval_end": 0.45, "gap_mean": 0.002, "k3_mean": 1e-4, "k3_slope": 0.0, "seq_gap_mean": 0.1,
            "correction": "none", "mini_batches": "2", "collapsed": [], **kw}


def sweep(tmp_path: Path, trainer: bool) -> Path:
    out = tmp_path / ("with" if trainer else "without")
    for a, recipes in (("1", ["bf16", "nvfp4"]), ("8", ["nvfp4"])):
        folder = out / f"alpha{a}"
        runs = {}
        for r in recipes:
            for s in (0, 1):
                name = f"{r}-s{s}"
                runs[name] = {"steps": 2, "k3_mean": 1e-4}
                run = folder / "runs" / name
                run.mkdir(parents=True)
                recs = [{"step": 0, "eval/pass@1": 0.4}, {"step": 1}, {"step": 2, "eval/pass@1": 0.5}]
                if trainer:
                    recs[0]["eval/trainer_pass@1"] = 0.42
                    recs[2]["eval/trainer_pass@1"] = 0.2 + 0.1 * s if a == "8" else 0.45
                (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        (folder / "compare.json").write_text(json.dumps({"recipes": [recipe_row(r, 2) for r in recipes],
                                                         "runs": runs}))
    return out


def run(out: Path) -> str:
    subprocess.run([sys.executable, str(ROOT / "scripts/mismatch_budget_summary.py"), str(out), "1,8"],
                   check=True, capture_output=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    return (out / "summary.md").read_text()


def test_summary_has_the_trainers_policy_when_logged(tmp_path):
    md = run(sweep(tmp_path, trainer=True))
    assert "| trainer's policy start | trainer's policy end | trainer's policy end per seed |" in md
    row = next(line for line in md.splitlines() if line.startswith("| 8 | nvfp4 |"))
    assert "| 0.420 | 0.250 | 0.20, 0.30 |" in row, row
    lines = [json.loads(x) for x in (tmp_path / "with/summary.jsonl").read_text().splitlines()]
    assert len(lines) == 6 and {x["run"] for x in lines if x["alpha"] == 8.0} == {"nvfp4-s0", "nvfp4-s1"}
    assert next(x for x in lines if x["alpha"] == 8.0 and x["run"] == "nvfp4-s1")["trainer_end"] == 0.2 + 0.1


def test_summary_without_trainer_evals_has_no_such_columns(tmp_path):
    md = run(sweep(tmp_path, trainer=False))
    assert "trainer's policy" not in md.split("|", 1)[1] and "| 1 | bf16 | 2/2 |" in md
