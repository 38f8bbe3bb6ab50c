"""Landing gpu_collapse.sh calls and the collapse rule (quads/experiments/collapse.py,
scripts/collapse_report.py), on fabricated metrics.jsonl fixtures."""

import gzip
import io
import json
import math
import random
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from quads.experiments import collapse
from quads.experiments.collapse import (
    CollapseRule,
    LandingError,
    judge,
    land,
    land_all,
    load_runs,
    write_report,
)

ROOT = Path(__file__).resolve().parent.parent


def records(n_steps: int, eval_at, reward_at, gap_at=lambda s: 0.5 + 0.01 * s, every: int = 10, seed: int = 0):
    """Records as the trainer logs them: step 0 = the start eval; each step reward, gap, loss and timings; an
    eval every ``every`` steps and at the end."""
    rng = random.Random(seed)
    recs = [{"step": 0, "eval/pass@1": eval_at(0), "eval/n": 100}]
    for s in range(1, n_steps + 1):
        r = {"step": s, "reward/mean": reward_at(s), "mismatch/seq_gap_mean": gap_at(s), "loss/pg": 0.01 * s,
             "time/step_s": rng.uniform(1, 2), "perf/rollout_tokens_per_s": rng.uniform(1e3, 2e3)}
        if s % every == 0 or s == n_steps:
            r["eval/pass@1"] = eval_at(s)
        recs.append(r)
    return recs


def stable(n, seed=0):
    return records(n, lambda s: 0.45 + 0.001 * s, lambda s: 0.4 + 0.002 * s, seed=seed)


def make_tarball(path: Path, runs: dict[str, list[dict]], plan: str = "plan", extra: dict[str, bytes] | None = None,
                 optim: dict[str, str] | None = None):
    """A results.tar.gz laid out as gpu_collapse.sh packs it; ``optim``: run name -> its config's optim section."""
    files = {"./plan.txt": plan.encode(), "./summary.txt": b"summary\n", "./pretrain.log": b"pretrain\n",
             "./env.txt": b"torch\n", **(extra or {})}
    for name, recs in runs.items():
        files[f"./runs/{name}/metrics.jsonl"] = "".join(json.dumps(r) + "\n" for r in recs).encode()
        files[f"./runs/{name}/config.yaml"] = (f"recipe:\n  name: {name.split('-')[0]}\n"
                                               + (f"optim: {optim[name]}\n" if optim and name in optim else "")).encode()
        files[f"./logs/{name}.log"] = f"log of {name} up to {recs[-1]['step']}\n".encode()
    with tarfile.open(path, "w:gz") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def retime(recs):
    """The same records with other wall-clock values (what a resumed run logs for the same steps)."""
    return [{k: (v * 1.5 if k.startswith(("time/", "perf/")) else v) for k, v in r.items()} for r in recs]


def test_land_extends_and_keeps_each_call(tmp_path):
    full = {"bf16-s0": stable(30), "nvfp4-s0": stable(30, seed=1)}
    t1 = make_tarball(tmp_path / "a.tar.gz", {k: v[:16] for k, v in full.items()}, plan="call one")
    t2 = make_tarball(tmp_path / "b.tar.gz", {k: retime(v) for k, v in full.items()}, plan="call two")
    dest = tmp_path / "landed"
    assert land_all([t1, t2], dest, say=lambda s: None) == ["01", "02"]
    runs = load_runs(dest)
    assert [r["step"] for r in runs["bf16-s0"]] == list(range(31))
    assert (dest / "calls/01/plan.txt").read_text() == "call one"
    assert (dest / "calls/02/plan.txt").read_text() == "call two"
    assert "sha256: " in (dest / "calls/02/source.txt").read_text()
    assert (dest / "runs/nvfp4-s0/config.yaml").is_file()
    assert (dest / "logs/nvfp4-s0.log").read_text() == "log of nvfp4-s0 up to 30\n"
    assert land(t2, dest, say=lambda s: None) is None  # landed before: skipped, no third call
    assert sorted(p.name for p in (dest / "calls").iterdir()) == ["01", "02"]


def test_land_refuses_a_rewrite_and_writes_nothing_of_it(tmp_path):
    dest = tmp_path / "landed"
    land(make_tarball(tmp_path / "a.tar.gz", {"nvfp4-s0": stable(15)}), dest, say=lambda s: None)
    changed = stable(30)
    changed[7]["reward/mean"] += 1e-6
    with pytest.raises(LandingError, match=r"nvfp4-s0: step 7 differs .*reward/mean"):
        land(make_tarball(tmp_path / "b.tar.gz", {"nvfp4-s0": changed}), dest, say=lambda s: None)
    with pytest.raises(LandingError, match="lacks landed steps .*started over"):
        land(make_tarball(tmp_path / "c.tar.gz", {"nvfp4-s0": stable(10)}), dest, say=lambda s: None)
    assert [p.name for p in (dest / "calls").iterdir()] == ["01"]
    assert load_runs(dest)["nvfp4-s0"][-1]["step"] == 15


def test_land_gzips_large_files_and_extends_the_gzipped_copy(tmp_path, monkeypatch):
    monkeypatch.setattr(collapse, "GZIP_OVER", 2000)
    dest = tmp_path / "landed"
    land(make_tarball(tmp_path / "a.tar.gz", {"quads-s1": stable(20)}), dest, say=lambda s: None)
    run = dest / "runs/quads-s1"
    assert (run / "metrics.jsonl.gz").is_file() and not (run / "metrics.jsonl").exists()
    assert json.loads(gzip.decompress((run / "metrics.jsonl.gz").read_bytes()).splitlines()[0])["step"] == 0
    assert (run / "config.yaml").is_file()  # small: stored as is
    bad = stable(40)
    bad[20]["mismatch/seq_gap_mean"] = 9.0
    with pytest.raises(LandingError, match="step 20 differs"):
        land(make_tarball(tmp_path / "b.tar.gz", {"quads-s1": bad}), dest, say=lambda s: None)
    land(make_tarball(tmp_path / "c.tar.gz", {"quads-s1": stable(40)}), dest, say=lambda s: None)
    assert load_runs(dest)["quads-s1"][-1]["step"] == 40


def test_land_rejects_what_is_not_a_call(tmp_path):
    with pytest.raises(LandingError, match="no tarball"):
        land(tmp_path / "missing.tar.gz", tmp_path / "d")
    (tmp_path / "junk.tar.gz").write_bytes(b"not a tarball")
    with pytest.raises(LandingError, match="not a readable"):
        land(tmp_path / "junk.tar.gz", tmp_path / "d")


# ---------------------------------------------------------------------- the rule


def test_a_collapsing_run_is_flagged_at_its_onset_with_the_gap_rising_before():
    # pass@1 0.5 until step 50, then 0.1: the evals at 60, 70, 80 are all below 0.25
    recs = records(80, lambda s: 0.5 if s <= 50 else 0.1, lambda s: 0.45, gap_at=lambda s: 1.0 + 0.05 * s)
    v = judge(recs)
    assert v.collapsed and v.criteria == "eval" and v.onset == 60
    assert (v.eval_start, v.eval_best, v.eval_last) == (0.5, 0.5, 0.1)
    assert v.gap_slope_before == pytest.approx(0.05)


def test_a_reward_collapse_alone_is_flagged():
    recs = records(100, lambda s: 0.5, lambda s: 0.6 if s <= 60 else 0.05)
    v = judge(recs)
    assert v.collapsed and v.criteria == "reward"
    assert 61 <= v.onset <= 70  # the trailing mean crosses 0.3 within a window of the fall


def test_stable_and_noisy_runs_are_not_collapsed():
    assert not judge(stable(150)).collapsed
    rng = random.Random(3)
    # noisy: pass@1 dips below half its start at one eval and recovers; the reward jitters +-0.15
    noisy = records(150, lambda s: 0.2 if s == 70 else 0.5 + rng.uniform(-0.08, 0.08),
                    lambda s: 0.4 + rng.uniform(-0.15, 0.15))
    v = judge(noisy)
    assert not v.collapsed and v.onset is None and v.criteria == "none"
    # the last eval alone below: not sustained over two
    late = records(150, lambda s: 0.1 if s == 150 else 0.5, lambda s: 0.4)
    assert not judge(late).collapsed
    assert judge(late, CollapseRule(evals=1)).collapsed


def test_a_small_drop_or_a_short_run_is_not_collapsed():
    # from 0.15 to 0.07: under half, but less than min_drop (0.1) under the start
    assert not judge(records(60, lambda s: 0.15 if s == 0 else 0.07, lambda s: 0.4)).collapsed
    # one eval after the start: criterion (1) cannot be met
    assert not judge(records(10, lambda s: 0.5 if s == 0 else 0.0, lambda s: 0.4)).collapsed


def test_the_trainers_own_policy_collapsing_is_a_collapse():
    """eval_trainer: an amplified sampler scores near 0 throughout while the trained policy falls from 0.4
    to 0.1 from step 40: criterion (1) on the trainer's policy; the sampler's flat score alone is not one."""
    recs = records(80, lambda s: 0.02, lambda s: 0.03)
    for r in recs:
        if "eval/pass@1" in r:
            r["eval/trainer_pass@1"] = 0.4 if r["step"] < 40 else 0.1
    v = judge(recs)
    assert v.collapsed and v.criteria == "trainer" and v.onset == 40
    for r in recs:
        if "eval/trainer_pass@1" in r:
            r["eval/trainer_pass@1"] = 0.4 if r["step"] < 70 else 0.25  # under 0.4 - 0.1, not under half
    assert not judge(recs).collapsed


def test_a_nonfinite_loss_is_a_collapse_from_its_step():
    recs = stable(40)
    recs[25]["loss/pg"] = math.nan
    v = judge(recs)
    assert v.collapsed and v.criteria == "nonfinite" and v.onset == 25


def test_rule_validates():
    with pytest.raises(ValueError, match="0 < frac < 1"):
        CollapseRule(frac=1.5)


# ---------------------------------------------------------------------- the report


def test_report_from_landed_runs(tmp_path):
    runs = {f"bf16-s{s}": stable(60, seed=s) for s in range(3)}
    runs |= {f"nvfp4-s{s}": records(60 - 5 * s, lambda t: 0.5 if t <= 30 else 0.05, lambda t: 0.4, seed=s)
             for s in range(3)}
    runs["nvfp4-s2"] = stable(50, seed=9)
    dest = tmp_path / "landed"
    land(make_tarball(tmp_path / "a.tar.gz", runs), dest, say=lambda s: None)
    out = write_report(dest, command="python scripts/collapse_report.py report landed")
    png = (out / "collapse.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    md = (out / "collapse.md").read_text()
    assert "held-out pass@1 < 0.5 x its start value" in md and "Made by `python scripts/collapse_report.py" in md
    assert "| nvfp4 | n/a | 0,1,2 | 50-60 | s0@40, s1@40 |" in md and md.count("| 2/2 |") == 1  # gap rising: both
    assert "| bf16 | n/a | 0,1,2 | 60 | none |" in md
    data = json.loads((out / "collapse.json").read_text())
    assert data["runs"]["nvfp4-s0"]["onset"] == 40 and data["runs"]["bf16-s1"]["collapsed"] is False
    assert "trainer's policy pass@1 start" not in md.split("Columns:")[0]  # no run logged eval_trainer
    assert data["runs"]["bf16-s0"]["trainer_last"] is None


def test_report_shows_the_trainers_own_policy_when_logged(tmp_path):
    """With eval_trainer the runs log eval/trainer_pass@1: the run table gains its start and last values."""
    recs = records(30, lambda t: 0.5 - 0.015 * t, lambda t: 0.4)
    for r in recs:
        if "eval/pass@1" in r:
            r["eval/trainer_pass@1"] = 0.6 + 0.005 * r["step"]  # the sampler degrades, the policy does not
    dest = tmp_path / "landed"
    land(make_tarball(tmp_path / "a.tar.gz", {"nvfp4-s0": recs, "bf16-s0": stable(30)}), dest, say=lambda s: None)
    md = (write_report(dest) / "collapse.md").read_text()
    assert "| trainer's policy pass@1 start | trainer's policy pass@1 last |" in md
    row = next(line for line in md.splitlines() if line.startswith("| nvfp4-s0 |"))
    assert row.endswith("| 0.600 | 0.750 |"), row
    assert judge(recs).trainer_last == pytest.approx(0.75) and math.isnan(judge(stable(30)).trainer_start)
    plain = tmp_path / "plain"
    land(make_tarball(tmp_path / "b.tar.gz", {"bf16-s0": stable(30)}), plain, say=lambda s: None)
    width = lambda png: int.from_bytes(png[16:20], "big")  # noqa: E731 (the PNG header's IHDR width)
    four, three = (width((d / "report/collapse.png").read_bytes()) for d in (dest, write_report(plain).parent))
    assert four == pytest.approx(three * 4 / 3, rel=0.05)  # a fourth panel: the trainer's policy


def test_report_of_a_learning_rate_sweep_has_one_row_per_lr(tmp_path):
    """Runs named <recipe>-<variant>-s<seed> (quads compare --variants) are grouped per variant, with the lr
    of their config.yaml and the held-out gain (mean of the last 3 evaluations minus the start)."""
    gain = {"lr2e-6": 0.0, "lr2e-5-warmup_steps20": 0.12}
    runs = {f"bf16-{tag}-s{s}": records(40, lambda t, g=g: 0.4 + g * (t >= 20), lambda t: 0.3, seed=s)
            for tag, g in gain.items() for s in (0, 1)}
    optim = {n: "{lr: 2.0e-6}" if "lr2e-6" in n else "{lr: 2.0e-5, warmup_steps: 20}" for n in runs}
    dest = tmp_path / "landed"
    land(make_tarball(tmp_path / "a.tar.gz", runs, optim=optim), dest, say=lambda s: None)
    assert sorted(load_runs(dest)) == sorted(runs)
    md = (write_report(dest) / "collapse.md").read_text()
    assert "| bf16-lr2e-6 | 2e-06 | 0,1 | 40 | none | 0.400 | 0.400 | 0.400 | +0.000 |" in md, md
    assert "| bf16-lr2e-5-warmup_steps20 | 2e-05 (warmup 20) | 0,1 | 40 | none | 0.400 | 0.520 | 0.520 | +0.120 |" in md
    with pytest.raises(ValueError, match="<group>-s<seed>"):
        collapse.split_name("-s0")


def test_script_lands_reports_and_refuses(tmp_path):
    dest = tmp_path / "landed"
    t1 = make_tarball(tmp_path / "a.tar.gz", {"quads-s0": stable(20)})
    bad = stable(30)
    bad[3]["reward/mean"] = 0.0
    t2 = make_tarball(tmp_path / "b.tar.gz", {"quads-s0": bad})
    script = [sys.executable, str(ROOT / "scripts/collapse_report.py")]
    ok = subprocess.run([*script, "land", str(dest), str(t1)], capture_output=True, text=True)
    assert ok.returncode == 0 and "landed as calls/01" in ok.stdout
    refused = subprocess.run([*script, "land", str(dest), str(t2)], capture_output=True, text=True)
    assert refused.returncode == 1 and "step 3 differs" in refused.stderr
    rep = subprocess.run([*script, "report", str(dest), "--evals", "3"], capture_output=True, text=True)
    assert rep.returncode == 0, rep.stderr
    assert "at each of the last 3 evaluations" in rep.stdout and (dest / "report/collapse.png").is_file()
