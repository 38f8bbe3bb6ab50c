"""Run reports (quads.metrics.report): summary numbers, collapse detection, files with every column."""

import json
import math

import pytest

from quads.metrics.report import (
    load_metrics,
    run_settings,
    slope,
    summarize,
    write_compare_report,
    write_report,
)


def _write_run(path, rewards, evals=None, gap_scale=1.0, torn=False):
    path.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, r in enumerate(rewards):
        rec = {"step": i + 1, "reward/mean": r, "mismatch/logp_gap_max": 0.5 * gap_scale * (i + 1),
               "mismatch/logp_gap_mean": 0.01 * gap_scale, "mismatch/k3": 1e-4 * gap_scale,
               "mismatch/logp_gap_max_probe": 0.3 * gap_scale, "loss/total": 0.1,
               "mismatch/seq_gap_mean": 0.2 * gap_scale * (i + 1)}
        lines.append(json.dumps(rec))
        if evals and (i + 1) in evals:
            lines.append(json.dumps({"step": i + 1, "eval/pass@1": evals[i + 1]}))
    text = "\n".join(lines) + "\n"
    if torn:
        text += '{"step": 99, "reward/me'
    (path / "metrics.jsonl").write_text(text)
    (path / "config.yaml").write_text("correction: {kind: none}\noptim: {mini_batches: 2, ppo_epochs: 1}\n")
    return path


def test_summary_numbers(tmp_path):
    run = _write_run(tmp_path / "a", [0.1, 0.2, 0.3, 0.4], evals={1: 0.2, 4: 0.6}, torn=True)
    recs = load_metrics(run)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]  # torn last line skipped, eval merged by step
    s = summarize(recs)
    assert s["steps"] == 4
    assert s["reward_final"] == pytest.approx(0.4)  # window max(1, 4 // 10) = 1
    assert s["reward_best"] == pytest.approx(0.4)
    assert s["eval_start"] == pytest.approx(0.2) and s["eval_end"] == pytest.approx(0.6)
    assert s["gap_max"] == pytest.approx(2.0)
    assert s["gap_mean"] == pytest.approx(0.01)
    assert s["k3_mean"] == pytest.approx(1e-4)
    assert s["collapse"] is False


def test_collapse_detection():
    recs = [{"step": i + 1, "reward/mean": r} for i, r in enumerate([0.6] * 10 + [0.05] * 10)]
    s = summarize(recs)
    # window 2: best 0.6, final 0.05 -> collapse
    assert s["collapse"] and "reward fell" in s["collapse_reason"]
    recs = [{"step": 1, "eval/pass@1": 0.5}, {"step": 2, "eval/pass@1": 0.3, "loss/total": float("nan")}]
    s = summarize(recs)
    assert "held-out" in s["collapse_reason"] and "non-finite" in s["collapse_reason"]


def test_report_files_every_column_filled(tmp_path):
    run = _write_run(tmp_path / "run1", [0.1, 0.3, 0.5], evals={1: 0.1, 3: 0.5})
    out = write_report(run)
    md = (out / "report.md").read_text()
    for stem in ("reward", "eval", "gap", "k3"):
        assert (out / f"{stem}.png").stat().st_size > 1000
        assert f"({stem}.png)" in md
    row = [ln for ln in md.splitlines() if ln.startswith("| run1 |")][0]
    cells = [c.strip() for c in row.strip("|").split("|")]
    header = [ln for ln in md.splitlines() if ln.startswith("| run |")][0]
    assert len(cells) == len(header.strip("|").split("|"))
    assert all(c and c != "n/a" for c in cells), cells
    summary = json.loads((out / "summary.json").read_text())["run1"]
    assert all(v is not None for v in summary.values())


def test_compare_report(tmp_path):
    a = _write_run(tmp_path / "bf16", [0.1, 0.2, 0.4], evals={1: 0.1, 3: 0.4})
    b = _write_run(tmp_path / "nvfp4", [0.1, 0.1, 0.1], evals={1: 0.1, 3: 0.1}, gap_scale=5.0)
    out = write_compare_report({"bf16": a, "nvfp4": b}, tmp_path / "cmp")
    md = (out / "report.md").read_text()
    assert "| bf16 |" in md and "| nvfp4 |" in md
    assert (out / "gap.png").is_file() and (out / "k3.png").is_file()
    summ = json.loads((out / "summary.json").read_text())
    assert math.isclose(summ["nvfp4"]["gap_mean"], 5 * summ["bf16"]["gap_mean"])


def test_missing_metrics_file(tmp_path):
    with pytest.raises(ValueError, match="metrics.jsonl"):
        write_report(tmp_path / "nothing")


def test_trend_slopes_and_run_settings(tmp_path):
    """Least-squares slope against numpy's fit; the settings each report row states come from config.yaml."""
    import numpy as np

    xs, ys = [1, 2, 4, 7, 8], [0.5, 0.1, 0.9, 1.3, float("nan")]
    assert slope(xs, ys) == pytest.approx(np.polyfit(xs[:4], ys[:4], 1)[0], rel=1e-12)  # NaN pairs left out
    assert math.isnan(slope([3], [1.0])) and math.isnan(slope([2, 2], [1.0, 3.0]))
    run = _write_run(tmp_path / "r", [0.1, 0.2, 0.3, 0.4])
    s = summarize(load_metrics(run))
    assert s["seq_gap_slope"] == pytest.approx(0.2) and s["k3_slope"] == pytest.approx(0.0)
    assert s["seq_gap_mean"] == pytest.approx(0.5)
    st = run_settings(run)
    assert (st["correction"], st["mini_batches"], st["mini_batches_text"]) == ("none", 2, "2")
    (run / "config.yaml").write_text("correction: {kind: tis, cap: 3}\noptim: {mini_batches: 1, ppo_epochs: 2,"
                                     " lr: 2.0e-5, warmup_steps: 20}\nrecipe: {rollout_error_scale: 4.0}\n")
    st = run_settings(run / "metrics.jsonl")
    assert (st["correction"], st["mini_batches_text"], st["error_scale"]) == ("tis (cap 3)", "1 x 2 epochs", 4.0)
    assert st["lr_text"] == "2e-05 (warmup 20)"
    md = (write_report(run) / "report.md").read_text()
    assert "| IS correction | mini-batches |" in md and "| tis (cap 3) | 1 x 2 epochs |" in md
    assert run_settings(tmp_path) == {}
