"""quads compare: one run per (recipe, seed) with the same config, in parallel processes; a crashed run is
reported, not fatal; the report has every column filled."""

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from quads.cli import main
from quads.experiments.compare import (
    CompareConfig,
    _parse_set,
    base_train_config,
    collapse_step,
    launch,
    plan_runs,
)
from quads.experiments.compare import write_report as write_compare
from quads.metrics.report import load_metrics


@pytest.fixture(scope="module")
def checkpoint(small_checkpoint) -> Path:
    return small_checkpoint


def _set(checkpoint: Path) -> str:
    return (f"model.checkpoint={checkpoint},steps=2,eval_every=1,eval_n=4,rollout.prompts_per_step=2,"
            "rollout.n_samples=2,rollout.max_new_tokens=8,log.tensorboard=false,log.progress=false,"
            "log.probe_tokens=8,optim.lr=1e-3")


def test_plan_same_config_but_recipe_seed_out_dir(checkpoint, tmp_path):
    cfg = CompareConfig(recipes="bf16,quads", seeds="0,1", set=_set(checkpoint), out_dir=str(tmp_path))
    base = base_train_config(cfg)
    runs = plan_runs(cfg, base)
    assert [n for n, _ in runs] == ["bf16-s0", "bf16-s1", "quads-s0", "quads-s1"]
    strip = [dataclasses.replace(tc, recipe=base.recipe, seed=0, out_dir=None) for _, tc in runs]
    assert all(s == strip[0] for s in strip)  # identical data, hyperparameters and starting checkpoint
    assert len({tc.out_dir for _, tc in runs}) == 4
    assert base.steps == 2 and base.optim.lr == 1e-3 and base.model.checkpoint == str(checkpoint)
    assert isinstance(base.task.difficulty, int)  # the default level is pinned once for every run


def test_variants_sweep_one_setting_per_run_group(checkpoint, tmp_path):
    cfg = CompareConfig(recipes="bf16,nvfp4", seeds="0,1", set=_set(checkpoint), out_dir=str(tmp_path),
                        variants="optim.lr=5e-6; optim.lr=2e-5,optim.warmup_steps=4")
    base = base_train_config(cfg)
    runs = dict(plan_runs(cfg, base))
    assert list(runs) == [f"{r}-{t}-s{s}" for r in ("bf16", "nvfp4") for t in ("lr5e-6", "lr2e-5-warmup_steps4")
                          for s in (0, 1)]
    assert runs["nvfp4-lr5e-6-s1"].optim.lr == 5e-6 and runs["nvfp4-lr5e-6-s1"].optim.warmup_steps == 0
    assert runs["bf16-lr2e-5-warmup_steps4-s0"].optim.lr == 2e-5
    assert runs["bf16-lr2e-5-warmup_steps4-s0"].optim.warmup_steps == 4
    assert runs["nvfp4-lr5e-6-s1"].recipe.name == "nvfp4" and runs["nvfp4-lr5e-6-s1"].seed == 1
    # the variant's setting is the only difference from the shared config
    strip = [dataclasses.replace(tc, recipe=base.recipe, seed=0, out_dir=None, optim=base.optim)
             for tc in runs.values()]
    assert all(s == strip[0] for s in strip) and strip[0].steps == 2
    # one held-out set for every seed: task.eval_seed pinned to the base seed
    assert {tc.task.eval_seed for tc in runs.values()} == {0}
    with pytest.raises(ValueError, match="variants: lr-1: optim.lr must be > 0"):  # every variant checked before any warm start
        base_train_config(dataclasses.replace(cfg, variants="optim.lr=-1"))


def test_a_group_quads_train_would_refuse_fails_before_the_warm_start(tmp_path):
    """Micro-batches with a batch-statistic trainer (w4a4-qat) are refused for that group before anything runs
    (no model.checkpoint: the warm start would be the next thing base_train_config does)."""
    s = "optim.micro_batch_size=2,rollout.prompts_per_step=2,rollout.n_samples=4"
    with pytest.raises(ValueError, match="run group w4a4-qat: optim.micro_batch_size=2: recipe 'w4a4-qat'"):
        base_train_config(CompareConfig(recipes="bf16,w4a4-qat", set=s, out_dir=str(tmp_path)))
    cfg = CompareConfig(recipes="bf16,w4a4-qat", set=s, out_dir=str(tmp_path),
                        variants="bf16:base;w4a4-qat:optim.micro_batch_size=null")
    assert [g for g, _, _ in cfg.groups()] == ["bf16", "w4a4-qat-micro_batch_sizenull"]
    from quads.experiments import compare as compare_mod

    compare_mod._check_groups(cfg, compare_mod._parse_set(s))  # the group without micro-batches passes
    assert not list(tmp_path.iterdir())


def test_bad_variants():
    for bad, match in (("seed=3", "cannot vary"), ("warm_start.steps=5", "cannot vary"),
                       ("model.checkpoint=x", "cannot vary"), ("task.dataset=a/b.jsonl", "run-name tag"),
                       ("optim.lr=1e-5;optim.lr=1e-5", "same tag"), ("optim.lr", "key=value")):
        with pytest.raises(ValueError, match=match):
            CompareConfig(recipes="bf16", variants=bad)
    assert CompareConfig(recipes="bf16", variants=" ; ").groups() == [("bf16", "bf16", {})]
    for bad, match in (("nvfp4:optim.lr=1e-5", "not among"), ("bf16+fp8:optim.lr=1e-5", "not among"),
                       ("base;base", "same tag"), ("quads:optim.lr=1e-5", "no variant applies to recipe")):
        with pytest.raises(ValueError, match=match):
            CompareConfig(recipes="bf16,quads" if bad.startswith("quads") else "bf16", variants=bad)


def test_variants_limited_to_recipes_beside_the_shared_config():
    """'base' is the shared config alone; a 'r+r:' prefix runs a variant for those recipes only."""
    cfg = CompareConfig(recipes="bf16,nvfp4,quads", variants=(
        "base; nvfp4+quads: recipe.rollout_error_scale=4; nvfp4:correction.kind=tis,correction.cap=2.0"))
    groups = cfg.groups()
    assert [g for g, _, _ in groups] == ["bf16", "nvfp4", "nvfp4-rollout_error_scale4", "nvfp4-kindtis-cap2.0",
                                         "quads", "quads-rollout_error_scale4"]
    over = {g: o for g, _, o in groups}
    assert over["bf16"] == {} and over["quads-rollout_error_scale4"] == {"recipe": {"rollout_error_scale": 4}}
    assert over["nvfp4-kindtis-cap2.0"] == {"correction": {"kind": "tis", "cap": 2.0}}
    assert {r for g, r, _ in groups if g.startswith("nvfp4")} == {"nvfp4"}


def test_bad_inputs():
    with pytest.raises(ValueError, match="unknown recipe"):
        CompareConfig(recipes="bf16,nvfp5")
    with pytest.raises(ValueError, match="key=value"):
        _parse_set("steps")
    assert _parse_set("a.b=1,c=x") == {"a": {"b": 1}, "c": "x"}


def test_collapse_step():
    recs = [{"step": i, "reward/mean": r} for i, r in enumerate([0.5, 0.8, 0.8, 0.2, 0.1, 0.1], 1)]
    assert collapse_step(recs) == 4  # (smoothed) reward below half its best and 0.1 under it
    assert collapse_step([{"step": 1, "reward/mean": 0.5}, {"step": 2, "reward/mean": 0.6}]) is None
    # an early dip that recovers does not date a later collapse (held-out rule here)
    dip = [{"step": 1, "reward/mean": 0.5, "eval/pass@1": 0.7}, {"step": 2, "reward/mean": 0.1},
           {"step": 3, "reward/mean": 0.5}, {"step": 4, "reward/mean": 0.5, "eval/pass@1": 0.7},
           {"step": 5, "reward/mean": 0.5, "eval/pass@1": 0.5}]
    assert collapse_step(dip) == 5


@pytest.mark.slow
def test_compare_runs_in_parallel_and_reports_a_crash(checkpoint, tmp_path):
    out = tmp_path / "cmp"
    cfg = CompareConfig(recipes="bf16,nvfp4", seeds="0", set=_set(checkpoint), out_dir=str(out), parallel=3)
    base = base_train_config(cfg)
    runs = plan_runs(cfg, base)
    bad = dataclasses.replace(base, task=dataclasses.replace(base.task, name="dataset", eval_seed=None,
                                                             dataset=str(tmp_path / "missing.jsonl")))
    runs.append(("quads-s0", dataclasses.replace(bad, recipe=dataclasses.replace(base.recipe, name="quads"),
                                                 out_dir=str(out / "runs" / "quads-s0"))))
    cfg = dataclasses.replace(cfg, recipes="bf16,nvfp4,quads")
    outcomes = launch(cfg, runs, say=lambda s: None)
    assert [o.ok for o in outcomes] == [True, True, False]
    assert "missing.jsonl" in outcomes[2].log_tail
    write_compare(cfg, base, outcomes)
    md = (out / "compare.md").read_text()
    rows = [ln for ln in md.splitlines() if ln.startswith("| bf16") or ln.startswith("| nvfp4")]
    assert len(rows) == 2 and not any("n/a" in ln for ln in rows), md
    assert "| quads | 0/1 |" in md and "Failed runs" in md and "quads-s0: exit" in md
    for f in ("compare.png", "compare.json", "report/report.md", "report/reward.png", "report/k3.png"):
        assert (out / f).stat().st_size > 0, f
    data = json.loads((out / "compare.json").read_text())
    assert data["recipes"][0]["gap_mean"] > 0 and data["recipes"][1]["gap_mean"] > data["recipes"][0]["gap_mean"]
    # a second call reuses finished runs instead of training again
    again = launch(cfg, runs[:1], say=lambda s: None)
    assert again[0].reused and again[0].ok


@pytest.mark.slow
def test_compare_called_again_continues_time_limited_runs_exactly(checkpoint, tmp_path):
    """A compare whose runs stop at train.time_limit_s (here after every step), called again until done,
    ends with the metrics and weights of an uninterrupted compare: each call resumes from the checkpoint."""
    from quads.experiments.compare import compare
    from quads.metrics.report import NONDETERMINISTIC
    from quads.model.checkpoint import load_checkpoint

    s = _set(checkpoint).replace("steps=2", "steps=3") + ",log.save_every=0"
    straight = CompareConfig(recipes="quads", seeds="0", set=s, out_dir=str(tmp_path / "a"))
    assert compare(straight, say=lambda m: None)[1][0].ok
    limited = dataclasses.replace(straight, set=s + ",time_limit_s=1e-9", out_dir=str(tmp_path / "b"))
    said = []
    starts = [compare(limited, say=said.append)[1][0]]
    shutil.copytree(tmp_path / "b" / "runs", tmp_path / "c" / "runs")  # an unfinished run, for resume=false below
    starts += [compare(limited, say=said.append)[1][0] for _ in range(3)]
    assert [o.ok for o in starts] == [True] * 4
    assert [o.resumed_from for o in starts[:3]] == [None, 1, 2] and starts[3].reused
    assert any("continuing the unfinished run" in m and "step-2 checkpoint" in m for m in said)

    def records(out):
        return {r["step"]: {k: v for k, v in r.items() if not k.startswith(NONDETERMINISTIC)}
                for r in load_metrics(out / "runs" / "quads-s0")}

    a, b = records(tmp_path / "a"), records(tmp_path / "b")
    assert sorted(a) == sorted(b) == [0, 1, 2, 3] and a == b
    pa, _ = load_checkpoint(tmp_path / "a" / "runs" / "quads-s0" / "policy")
    pb, _ = load_checkpoint(tmp_path / "b" / "runs" / "quads-s0" / "policy")
    for (n, x), (_, y) in zip(pa.named_parameters(), pb.named_parameters()):
        assert torch.equal(x, y), n
    # resume=false starts an unfinished run (stopped after step 1, copied above) again from step 0
    again = dataclasses.replace(limited, out_dir=str(tmp_path / "c"), resume=False)
    o = compare(again, say=lambda m: None)[1][0]
    assert o.resumed_from is None and [r["step"] for r in load_metrics(tmp_path / "c" / "runs" / "quads-s0")] == [0, 1]


@pytest.mark.slow
def test_cli(checkpoint, tmp_path, capsys):
    out = tmp_path / "cli"
    rc = main(["compare", "--recipes", "w4a16-qat", "--seeds", "3", "--set", _set(checkpoint),
               "--out-dir", str(out)])
    assert rc == 0
    assert "| w4a16-qat | 1/1 |" in capsys.readouterr().out
    assert (out / "runs" / "w4a16-qat-s3" / "metrics.jsonl").is_file()
    # --report-only rebuilds the report from the runs on disk (policies and checkpoints may be gone)
    shutil.rmtree(out / "runs" / "w4a16-qat-s3" / "policy")
    (out / "compare.md").unlink()
    rc = main(["compare", "--recipes", "w4a16-qat,bf16", "--seeds", "3", "--out-dir", str(out), "--report-only", "true"])
    assert rc == 0
    md = (out / "compare.md").read_text()
    assert "| w4a16-qat | 1/1 | 2 |" in md and "| bf16 | 0/1 |" in md
    with pytest.raises(ValueError, match="report_only"):
        from quads.experiments.compare import existing_runs

        existing_runs(CompareConfig(out_dir=str(tmp_path / "empty"), report_only=True))


def test_cuda_runs_spread_over_gpus(checkpoint, tmp_path, monkeypatch):
    """Each CUDA run sees one device, the least busy one; explicit cuda:N and CPU runs are left alone."""
    from quads.experiments import compare as cmp

    cfg = CompareConfig(recipes="bf16,fp8,nvfp4", seeds="0", set=_set(checkpoint) + ",device=cuda",
                        out_dir=str(tmp_path), parallel=3, gpus="0,1")
    runs = plan_runs(cfg, base_train_config(cfg))
    seen = {}

    class FakeProc:
        pid = 1

        def __init__(self, cmd, env, **kw):
            seen[Path(cmd[-1]).stem] = env.get("CUDA_VISIBLE_DEVICES")

        def poll(self):
            return 0

    monkeypatch.setattr(cmp.subprocess, "Popen", FakeProc)
    outcomes = launch(cfg, runs, say=lambda *_: None)
    assert all(o.ok for o in outcomes)
    assert seen == {"bf16-s0": "0", "fp8-s0": "1", "nvfp4-s0": "0"}
    assert cmp.gpu_list(dataclasses.replace(cfg, gpus="none"), runs) == []
    cpu_runs = [(n, dataclasses.replace(tc, device="cpu")) for n, tc in runs]
    assert cmp.gpu_list(cfg, cpu_runs) == []
    with pytest.raises(ValueError, match="device ids"):
        cmp.gpu_list(dataclasses.replace(cfg, gpus="a,b"), runs)


def test_committed_report_is_what_the_report_module_writes(tmp_path, capsys):
    """``--report-only`` on a committed compare (results/cpu/compare-lr2e-4) rewrites its compare.md as committed."""
    src = Path(__file__).resolve().parents[1] / "results" / "cpu" / "compare-lr2e-4"
    shutil.copytree(src, tmp_path / "c")
    rc = main(["compare", "--recipes", "bf16,fp8,nvfp4,w4a16-qat,w4a4-qat,quads", "--seeds", "0,1", "--out-dir",
               str(tmp_path / "c"), "--report-only", "true"])
    assert rc == 0
    assert (tmp_path / "c" / "compare.md").read_text() == (src / "compare.md").read_text()


def test_report_only_groups_the_runs_of_each_variant(tmp_path):
    """``--report-only`` with ``variants`` finds the runs ``<recipe>-<tag>-s<seed>`` and reports one row per group."""
    from quads.config import save_config
    from quads.experiments.compare import compare
    from quads.rl.config import TrainConfig

    out = tmp_path / "cmp"
    for tag, lr, rewards in (("lr5e-6", 5e-6, [0.1, 0.2]), ("lr2e-5", 2e-5, [0.3, 0.5])):
        for seed in (0, 1):
            run = out / "runs" / f"bf16-{tag}-s{seed}"
            run.mkdir(parents=True)
            cfg = TrainConfig(steps=2, seed=seed)
            save_config(dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=lr)), run / "config.yaml")
            recs = [{"step": 0, "eval/pass@1": 0.4}] + [{"step": i + 1, "reward/mean": r} for i, r in enumerate(rewards)]
            (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    cfg = CompareConfig(recipes="bf16", seeds="0,1", variants="optim.lr=5e-6;optim.lr=2e-5", out_dir=str(out),
                        report_only=True)
    _, outcomes = compare(cfg, say=lambda s: None)
    assert [o.label for o in outcomes] == ["bf16-lr5e-6"] * 2 + ["bf16-lr2e-5"] * 2 and all(o.ok for o in outcomes)
    md = (out / "compare.md").read_text()
    assert "| bf16-lr5e-6 | 2/2 | 2 |" in md and "| bf16-lr2e-5 | 2/2 | 2 |" in md, md
    assert "Variants (one row per recipe x variant" in md
