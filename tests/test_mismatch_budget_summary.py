"""scripts/mismatch_budget_summary.py on fabricated sweep folders: the per-(alpha, recipe) table, the
trainer's policy columns only where the runs logged eval/trainer_pass@1, one JSON line per run."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_stats(**kw):
    return {"steps": 2, "reward_final": 0.3, "eval_start": 0.4, "eval_end": 0.45, "gap_mean": 0.002, "k3_mean": 1e-4,
            "k3_slope": 0.0, "seq_gap_mean": 0.1, "correction": "none", "mini_batches_text": "2", "collapse": False,
            **kw}


def sweep(tmp_path: Path, trainer: bool, seeds=(0, 1), name=None) -> Path:
    out = tmp_path / (name or ("with" if trainer else "without"))
    for a, recipes in (("1", ["bf16", "nvfp4"]), ("8", ["nvfp4"])):
        folder = out / f"alpha{a}"
        runs, outcomes = {}, []
        for r in recipes:
            for s in seeds:
                name_ = f"{r}-s{s}"
                runs[name_] = run_stats(k3_mean=1e-4 * (1 + s))
                outcomes.append({"name": name_, "group": r, "seed": s, "returncode": 0})
                run = folder / "runs" / name_
                run.mkdir(parents=True)
                recs = [{"step": 0, "eval/pass@1": 0.4}, {"step": 1}, {"step": 2, "eval/pass@1": 0.5}]
                if trainer:
                    recs[0]["eval/trainer_pass@1"] = 0.42
                    recs[2]["eval/trainer_pass@1"] = 0.2 + 0.1 * s if a == "8" else 0.45
                (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        (folder / "compare.json").write_text(json.dumps({"runs": runs, "outcomes": outcomes}))
    return out


def run(out: Path, *more: Path) -> str:
    extra = [arg for m in more for arg in ("--more", str(m))]
    subprocess.run([sys.executable, str(ROOT / "scripts/mismatch_budget_summary.py"), str(out), "1,8", *extra],
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


def test_more_sweeps_join_the_rows(tmp_path):
    """A third seed run later into its own folder joins the first sweep's rows (means over all three)."""
    first, later = sweep(tmp_path, True, (0, 1), "first"), sweep(tmp_path, True, (2,), "later")
    md = run(first, later)
    row = next(line for line in md.splitlines() if line.startswith("| 8 | nvfp4 |"))
    assert row.startswith("| 8 | nvfp4 | 3/3 | 2.00e-04 |") and "| 0.20, 0.30, 0.40 |" in row, row
    assert f"and `{later}`" in md
