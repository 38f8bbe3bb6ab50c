"""The GRPO loop: quantized rollouts, trainer log-probs, IS-corrected clipped loss, weight sync.

One RL step (``GRPOTrainer.step``):
1. take ``P`` prompts from the seeded sampler; the rollout engine samples ``n`` responses each
   (rollout model, ``recipe.rollout``) with log-probs and expert ids; the task's verifier scores them;
2. group-normalised advantages (``quads.rl.grpo``);
3. the trainer's full forward (``recipe.trainer``, no grad) gives the old log-probs; the mismatch
   metrics compare them with the rollout's; the IS correction (``quads.rl.correction``) turns them
   into per-token weights and a loss mask;
4. ``optim.ppo_epochs`` passes over ``optim.mini_batches`` mini-batches: forward with grad, clipped
   loss (+ router aux loss), backward, grad clip, AdamW; with ``optim.micro_batch_size`` each
   mini-batch's forward + backward runs micro-batch by micro-batch, gradients accumulated before its
   one optimizer step, and step 3's forward on the same micro-batches (``quads.rl.microbatch``);
5. weight sync into the rollout backend (``load_weights``: copy or push + re-quantize + fingerprint
   check) once the step's last optimizer step is done (at most one sync per rollout: syncing between
   mini-batches would only cost time and reset static RAC statistics that no rollout has refreshed);
6. metrics to ``metrics.jsonl`` (+ TensorBoard), held-out pass@1 every ``eval_every`` steps (greedy,
   rollout engine), the mismatch guard, checkpoints.

Determinism: the engine is seeded per step with ``seed * 1_000_003 + step``; the sampler, Python and
torch RNG states go into every checkpoint, so a resumed run reproduces the metrics of an uninterrupted
one (timings aside).
"""

from __future__ import annotations

import functools
import json
import math
import random
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from quads.config import from_dict, save_config, to_dict
from quads.evaluation import evaluate_backend
from quads.io import atomic_write_text, check_output_dir
from quads.kernels import dispatch
from quads.metrics.mismatch import mismatch_metrics
from quads.metrics.report import write_report
from quads.model.checkpoint import save_checkpoint
from quads.model.transformer import MoEForCausalLM
from quads.rl import build, compiled, distributed, microbatch
from quads.rl.checkpoint import (
    latest_checkpoint,
    load_train_state,
    rng_state,
    save_train_state,
    set_rng_state,
)
from quads.rl.config import TrainConfig
from quads.rl.correction import is_correction
from quads.rl.grpo import group_advantages, group_stats, grpo_loss, merge_loss_metrics
from quads.rl.interrupt import StopClock, StopRequest
from quads.rl.logprobs import SequenceBatch, forward_logprobs, to_sequence_batch
from quads.rl.sampler import PromptSampler
from quads.rollout import RolloutBatch, SamplingParams, make_backend, policy_engine
from quads.tasks import examples_up_to

# config fields that may differ when resuming (they do not change what the next steps compute)
RESUMABLE_CHANGES = ("resume", "steps", "log", "guard", "device", "threads", "out_dir", "eval_every", "eval_n",
                     "time_limit_s", "kernels", "dist_timeout_s")


class GuardError(RuntimeError):
    """A guard stopped the run (``quads train`` exits with code 3)."""


class MismatchGuardError(GuardError):
    """The rollout/trainer mismatch crossed a threshold with ``guard.action=abort``."""


class NonFiniteError(GuardError):
    """A non-finite loss or gradient norm with ``guard.nonfinite=abort``."""


@dataclass
class StepData:
    """What the rollout half of a step hands the update half. Shapes: B samples, R response tokens."""

    rollout: RolloutBatch
    seq: SequenceBatch
    advantages: torch.Tensor  # [B]
    logp_old: torch.Tensor  # [B, R] trainer, no grad
    logp_ref: torch.Tensor | None  # [B, R] initial policy (only with grpo.kl_coef > 0)
    loss_mask: torch.Tensor  # [B, R] float, response tokens kept by the IS correction
    is_weights: torch.Tensor  # [B, R] detached IS weights
    routing: torch.Tensor | None  # [n_layers, B, P + R, k] replayed expert ids, or None


@dataclass
class TrainResult:
    run_dir: Path
    report_dir: Path
    policy_dir: Path
    steps: int
    eval_start: float
    eval_end: float
    last: dict[str, float]


def default_run_dir(cfg: TrainConfig) -> Path:
    return Path("runs") / f"train-{cfg.task.name}-{cfg.recipe.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def check_run_dir(cfg: TrainConfig, run_dir: Path) -> dict[str, Any] | None:
    """The checkpoint state to resume from; None for a fresh run, or for a resumed run that stopped before its
    first checkpoint (it starts again from step 0). Refuses to clobber another run."""
    check_output_dir(run_dir, "out_dir")
    if not cfg.resume:
        if (run_dir / "metrics.jsonl").exists() or (run_dir / "checkpoints").exists():
            raise ValueError(f"out_dir {str(run_dir)!r} already holds a run; pass --resume true to continue it "
                             "(from its latest checkpoint, or from step 0 when it stopped before the first one), "
                             "or choose another --out-dir")
        return None
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        if (run_dir / "config.yaml").is_file():
            return None  # the run stopped before its first checkpoint: start it again
        raise ValueError(f"resume: {str(run_dir)!r} holds no run (no config.yaml, no checkpoint); start the run "
                         "without --resume (or check --out-dir)")
    return load_train_state(ckpt)


def check_resume(cfg: TrainConfig, state: dict[str, Any], model_config: dict[str, Any], run_dir: Path) -> None:
    """The model must be the run's architecture and the config the run's (fields that change no result aside)."""
    have = state["model_config"]
    diff = [f"{k}: run {have.get(k)!r}, checkpoint {v!r}" for k, v in model_config.items()
            if k != "dtype" and have.get(k) != v]
    if diff:
        raise ValueError(f"resume: model.checkpoint {cfg.model.checkpoint or '(warm start)'!r} is another "
                         f"architecture than the run's ({'; '.join(diff)}); resume with the run's original "
                         "model.checkpoint or start a new run in another --out-dir")
    old, new = state["config"], to_dict(cfg)
    try:  # fields added to TrainConfig after the run started take their defaults
        old = to_dict(from_dict(TrainConfig, old))
    except ValueError:
        pass
    diff = [f"{k}: run {old.get(k)!r}, now {new[k]!r}" for k in new
            if k not in RESUMABLE_CHANGES and old.get(k) != new[k]]
    if diff:
        raise ValueError(f"resume: the config differs from the run's in {'; '.join(diff)}; resume with the run's "
                         f"config ({run_dir / 'config.yaml'}) or start a new run in another --out-dir")


def check_guard(metrics: dict[str, float], cfg: TrainConfig) -> list[str]:
    g, out = cfg.guard, []
    for key, limit in (("mismatch/logp_gap_mean", g.gap_mean), ("mismatch/logp_gap_max", g.gap_max),
                       ("mismatch/k3", g.k3), ("mismatch/seq_gap_mean", g.seq_gap)):
        v = metrics.get(key)
        if limit is not None and v is not None and not v <= limit:  # NaN trips too
            out.append(f"{key}={v:.4g} > {limit:g}")
    return out


class GRPOTrainer:
    def __init__(self, cfg: TrainConfig, *, on_step_end: Callable[[int, dict[str, float]], None] | None = None,
                 quiet: bool = False) -> None:
        self.cfg = cfg
        self.on_step_end = on_step_end
        self.quiet = quiet
        self.dist = distributed.init(cfg.device, cfg.dist_timeout_s)  # under torchrun: join the process group
        dispatch.set_backend(cfg.kernels)  # the kernel backend of the quantize ops, from the run's config
        distributed.check_config(cfg, self.dist)
        cfg.device = self.dist.device  # cuda -> cuda:<LOCAL_RANK> under torchrun
        self.compile = compiled.resolve(cfg.trainer_compile, cfg.device, self.dist.enabled)
        self.run_dir = distributed.broadcast_object(Path(cfg.out_dir) if cfg.out_dir else default_run_dir(cfg),
                                                    self.dist)
        self.resume_state = check_run_dir(cfg, self.run_dir)
        distributed.barrier(self.dist)  # every rank checked the run folder before rank 0 writes to it
        with distributed.rank0_first(self.dist):  # rank 0 warm-starts into the cache, the others reuse it
            self.res = build.resolve(cfg)  # every input checked before the run folder is written
        microbatch.check(cfg, self.res.recipe, self.res.model_config, self.dist.world)
        if self.resume_state is not None:
            check_resume(cfg, self.resume_state, self.res.model_config.to_dict(), self.run_dir)

    # ------------------------------------------------------------------ setup

    def setup(self) -> None:
        cfg = self.cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        self.task = self.res.task
        self.trainer, self.rollout_model, self.tokenizer = build.build_models(self.res, cfg)
        distributed.shard_model(self.trainer, self.dist)  # FSDP2 under torchrun; the rollout model stays full
        # the policy forward of every trainer log-prob (old, reference, training): compiled, or None = plain;
        # micro-batches of two sizes (optim.micro_batch_size not dividing a mini-batch) share a graph
        rows = {c.stop - c.start for mb in microbatch.config_chunks(cfg, self.dist.world) for c in mb}
        self.policy_forward = compiled.CompiledForward(dynamic_batch=len(rows) > 1) if self.compile else None
        self.ref = None
        if cfg.grpo.kl_coef > 0:
            self.ref, _, _ = build.build_models(self.res, cfg)
            self.ref.requires_grad_(False)
            distributed.shard_model(self.ref, self.dist)
        # the rollout backend (quads.rollout.make_backend): quads' engine on the full (never sharded) rollout
        # replica, or vLLM, which takes the replica's architecture; weights come with the first sync
        self.engine = make_backend(cfg, self.rollout_model, self.tokenizer, self.res.recipe, self.run_dir)
        self.trainer_engine = None
        if cfg.eval_trainer:
            if self.dist.enabled:
                raise ValueError("eval_trainer generates from the trainer's model, which torchrun shards; "
                                 "run it in one process (or leave eval_trainer false)")
            self.trainer_engine = policy_engine(self.trainer, self.tokenizer, cfg.device)
        self.weight_source = distributed.trainer_weights(self.trainer, self.dist)  # full tensors, gathered under FSDP2
        self.params = [p for p in self.trainer.parameters() if p.requires_grad]
        o = cfg.optim
        self.opt = torch.optim.AdamW(self.params, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                     weight_decay=o.weight_decay)
        if self.dist.enabled:  # FSDP2 re-gathers into the same tensor: QAT's cache key cannot see the update
            distributed.invalidate_qat_cache_on_step(self.opt, self.trainer)
        self.opt_steps = 0
        train = examples_up_to(self.task, "train", cfg.task.train_size)
        self.sampler = PromptSampler(train, seed=cfg.seed)
        self.eval_set = build.heldout_examples(cfg, self.task)  # the first eval_n drawn with task.eval_seed
        if len(train) < cfg.task.train_size or len(self.eval_set) < cfg.eval_n:
            self._say(f"task {cfg.task.name}: {len(train)} distinct training prompts and {len(self.eval_set)} "
                      f"held-out ones (task.train_size {cfg.task.train_size}, eval_n {cfg.eval_n}: the task "
                      "offers no more)")
        self.start_step = 0
        self.last_metrics: dict[str, float] = {}
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.dist.is_main:
            remove_stale_temps(self.run_dir)
        if self.resume_state is not None:
            self._restore(self.resume_state)
        else:
            if cfg.resume:  # the run stopped before its first checkpoint
                self._say(f"resume: {self.run_dir} has no checkpoint yet (the run stopped before its first one, "
                          f"log.save_every {cfg.log.save_every}); starting it again from step 0")
                if self.dist.is_main:
                    (self.run_dir / "metrics.jsonl").unlink(missing_ok=True)
                    shutil.rmtree(self.run_dir / "tb", ignore_errors=True)
            self._sync_weights()
        if self.dist.is_main:
            save_config(cfg, self.run_dir / "config.yaml")
        self.writer = None
        if cfg.log.tensorboard and self.dist.is_main:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.run_dir / "tb"), purge_step=self.start_step + 1)

    def _sync_weights(self):
        """Trainer -> rollout backend weight sync (copy or push, re-quantize, fingerprint check)."""
        return self.engine.load_weights(self.weight_source)

    def _restore(self, state: dict[str, Any]) -> None:
        if self.dist.enabled:
            distributed.load_full_state(self.trainer, self.opt, state["model"], state["optimizer"], self.dist)
        else:
            self.trainer.load_state_dict(state["model"])
            self.opt.load_state_dict(state["optimizer"])
        self.opt_steps = int(state["opt_steps"])
        self.sampler.load_state_dict(state["sampler"])
        self._sync_weights()
        bufs = dict(self.rollout_model.named_buffers())
        for name, value in state["rollout_buffers"].items():
            bufs[name].copy_(value)  # static RAC orders and statistics: rollout state, not weights
        set_rng_state(state["rng"])
        self.start_step = int(state["step"])
        self.eval_history = list(state.get("eval_history", []))
        path = self.run_dir / "metrics.jsonl"
        if path.exists() and self.dist.is_main:  # drop records of steps after the checkpoint (they will be recomputed)
            keep = []
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                    if int(rec["step"]) <= self.start_step:
                        keep.append(line)
                        if int(rec["step"]) == self.start_step:
                            self.last_metrics.update({k: v for k, v in rec.items() if k != "step"})
                except (json.JSONDecodeError, KeyError, ValueError, TypeError):
                    continue  # torn line from the crash
            atomic_write_text(path, "".join(x + "\n" for x in keep))

    def _step_state(self) -> dict[str, Any]:
        """The state a step changes besides the weights and the optimizer: what ``save`` writes with them."""
        return {"opt_steps": self.opt_steps, "sampler": self.sampler.state_dict(), "rng": rng_state(),
                "rollout_buffers": {k: v.detach().clone() for k, v in self.rollout_model.named_buffers()}}

    def save(self, step: int, step_state: dict[str, Any] | None = None) -> Path | None:
        """Checkpoint (full, unsharded state, written by rank 0 only); None on the other ranks.

        ``step_state``: a ``_step_state()`` taken earlier, at the end of ``step``, while the weights and the
        optimizer state are still those of ``step`` (a step aborted before its first optimizer step)."""
        state = {
            "model": distributed.full_model_state(self.trainer, self.dist),
            "optimizer": distributed.full_optimizer_state(self.trainer, self.opt, self.dist),
            **(step_state or self._step_state()),
            "model_config": self.res.model_config.to_dict(),
            "base_checkpoint": str(self.res.checkpoint),
            "eval_history": self.eval_history,
        }
        path = save_train_state(self.run_dir, step, state, to_dict(self.cfg)) if self.dist.is_main else None
        distributed.barrier(self.dist)  # the checkpoint is complete before any rank moves on
        return path

    # ------------------------------------------------------------------ one step

    def _rollout(self, step: int) -> tuple[StepData, dict[str, float]]:
        cfg, r = self.cfg, self.cfg.rollout
        t0 = time.perf_counter()
        exs = distributed.split_groups(self.sampler.take(r.prompts_per_step), self.dist)  # this rank's groups
        params = SamplingParams(n=r.n_samples, temperature=r.temperature, max_new_tokens=r.max_new_tokens,
                                seed=cfg.seed * 1_000_003 + step, record_routing=True)
        batch = self.engine.generate([e.prompt for e in exs], params)
        t_roll = time.perf_counter() - t0
        scores = [self.task.score(e, text) for e, text in zip([e for e in exs for _ in range(r.n_samples)],
                                                              batch.texts)]
        rewards = torch.tensor([s.reward for s in scores], dtype=torch.float32)
        adv = group_advantages(rewards, r.n_samples, std_norm=cfg.grpo.std_norm, eps=cfg.grpo.adv_eps)
        seq = to_sequence_batch(batch, device=cfg.device)
        routing = batch.routing if cfg.routing_replay else None
        t1 = time.perf_counter()
        # with optim.micro_batch_size, on the update's micro-batches (no trainer forward takes more rows)
        chunks = (None if cfg.optim.micro_batch_size is None else
                  [c for mb in self._chunks(seq.input_ids.shape[0]) for c in mb])
        with torch.no_grad(), build.autocast(cfg):
            old = microbatch.forward_chunks(self.trainer, seq, routing, r.temperature, chunks, return_routing=True,
                                            forward=self.policy_forward)
            ref = None
            if self.ref is not None:
                ref = microbatch.forward_chunks(self.ref, seq, routing, r.temperature, chunks,
                                                forward=self.policy_forward).logprobs
        mask = seq.response_mask
        P = seq.prompt_len
        fed = mask & (batch.routing[0, :, P:, 0] >= 0) if batch.routing is not None else None
        corr = is_correction(old.logprobs, batch.logprobs.to(old.logprobs.device), mask.float(), cfg.correction)
        # metrics over the rows of every rank (gather_rows is the identity in one process)
        g = functools.partial(distributed.gather_rows, info=self.dist)
        lp_t, lp_r, gmask = g(old.logprobs), g(batch.logprobs.to(old.logprobs.device)), g(mask)
        has_r = batch.routing is not None
        m = mismatch_metrics(
            lp_t, lp_r, gmask,
            routing_train=g(old.routing[:, :, P:], batch_dim=1, pad_dim=2) if has_r else None,
            routing_rollout=g(batch.routing[:, :, P:], batch_dim=1, pad_dim=2, pad_value=-1) if has_r else None,
            routing_mask=g(fed) if has_r else None, probe_tokens=cfg.log.probe_tokens)
        m.update(is_correction(lp_t, lp_r, gmask.float(), cfg.correction).metrics if self.dist.enabled
                 else corr.metrics)
        per_sample = g(torch.tensor([[float(s.correct), float(f == "length"), float(n)] for s, f, n in
                                     zip(scores, batch.finish_reasons, batch.response_lengths().tolist())],
                                    dtype=torch.float64), pad_dim=None)  # [B_global, 3]
        lengths = per_sample[:, 2]
        m.update(group_stats(g(rewards, pad_dim=None), r.n_samples))
        m.update({
            "reward/correct_frac": per_sample[:, 0].mean().item(),
            "response/len_mean": lengths.mean().item(),
            "response/len_max": lengths.max().item(),
            "response/truncated_frac": per_sample[:, 1].mean().item(),
            "time/rollout_s": t_roll,
            "time/old_logprobs_s": time.perf_counter() - t1,
            "perf/rollout_tokens_per_s": batch.stats.n_response_tokens / max(t_roll, 1e-9),
        })
        data = StepData(batch, seq, adv.to(cfg.device), old.logprobs, ref, corr.mask.float(), corr.weights,
                        routing)
        return data, m

    def _lr(self) -> float:
        o = self.cfg.optim
        return o.lr * min(1.0, (self.opt_steps + 1) / o.warmup_steps) if o.warmup_steps else o.lr

    def _chunks(self, rows: int) -> list[list[slice]]:
        """The row slices of each mini-batch's micro-batches (one per mini-batch without micro_batch_size)."""
        o = self.cfg.optim
        return microbatch.step_chunks(rows, o.mini_batches, o.micro_batch_size)

    def _backward(self, d: StepData, micro: list[slice]) -> tuple[torch.Tensor, dict[str, float]]:
        """Forward + backward of one mini-batch, micro-batch by micro-batch (``quads.rl.microbatch``): the
        gradients add up in ``.grad``. Returns [loss + aux loss, aux loss, real tokens] of the mini-batch
        (fp64, on the device: no host read) and its loss metrics."""
        cfg = self.cfg
        whole = slice(micro[0].start, micro[-1].stop)
        denom = microbatch.loss_denom(d.loss_mask[whole], cfg.grpo.agg, self.dist, len(micro))
        sums, parts = [], []
        for rows in micro:
            sub = d.seq.select(rows)
            with build.autocast(cfg):
                res = forward_logprobs(self.trainer, sub, None if d.routing is None else d.routing[:, rows],
                                       cfg.rollout.temperature, return_entropy=True, forward=self.policy_forward)
            loss, m = grpo_loss(res.logprobs, d.logp_old[rows], d.advantages[rows], d.loss_mask[rows],
                                cfg.grpo, is_weights=d.is_weights[rows],
                                logp_ref=None if d.logp_ref is None else d.logp_ref[rows], entropy=res.entropy,
                                denom=denom)
            # the aux loss is a mean over the forward's tokens: weighted by rows (exact for one micro-batch; a split
            # with a load-balance loss is refused by microbatch.check)
            share = (rows.stop - rows.start) / (whole.stop - whole.start)
            aux = res.aux_loss if len(micro) == 1 else res.aux_loss * share
            total = loss + aux
            total.backward()
            sums.append(torch.stack([t.detach().double() for t in (total, aux, sub.attention_mask.sum())]))
            parts.append(m)
        return torch.stack(sums).sum(0), merge_loss_metrics(parts)

    def _update(self, d: StepData) -> dict[str, float]:
        cfg, o = self.cfg, self.cfg.optim
        chunks = self._chunks(d.seq.input_ids.shape[0])
        sums: dict[str, float] = {}
        count = 0
        t0 = time.perf_counter()
        tokens = skipped = 0
        for _ in range(o.ppo_epochs):
            for i, micro in enumerate(chunks):
                self.opt.zero_grad(set_to_none=True)
                totals, m = self._backward(d, micro)
                clip = o.grad_clip if o.grad_clip > 0 else float("inf")
                gn = distributed.full_tensor(torch.nn.utils.clip_grad_norm_(self.params, clip))  # DTensor under FSDP2
                # one host read for the step's scalars (fp64 holds each exactly)
                loss_value, aux, n_tok, gn = torch.cat([totals, gn.detach().double()[None]]).tolist()
                # every rank takes (or skips) the same optimizer steps
                if distributed.all_reduce(float(not (math.isfinite(loss_value) and math.isfinite(gn))),
                                          self.dist, "max") > 0:
                    self.opt.zero_grad(set_to_none=True)
                    skipped += 1
                    if cfg.guard.nonfinite == "abort":
                        raise NonFiniteError(f"non-finite loss {loss_value:.4g} / grad norm {gn:.4g} in mini-batch "
                                             f"{i + 1} of {o.mini_batches}")
                else:
                    lr = self._lr()
                    for g in self.opt.param_groups:
                        g["lr"] = lr
                    self.opt.step()
                    self.opt_steps += 1
                m["optim/grad_norm"] = gn
                m["loss/aux"] = aux
                m = distributed.reduce_loss_metrics(m, self.dist)  # global token means (identity in one process)
                for k, v in m.items():
                    sums[k] = sums.get(k, 0.0) + v
                count += 1
                tokens += int(n_tok)
        t_train = time.perf_counter() - t0
        rep = self._sync_weights()
        out = {k: v / count for k, v in sums.items()}
        out.update({"optim/lr": self._lr(), "optim/steps": float(self.opt_steps), "optim/skipped": float(skipped),
                    "time/train_s": t_train,
                    "time/sync_s": rep.seconds, "perf/train_tokens_per_s": tokens / max(t_train, 1e-9)})
        return out

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out pass@1: greedy decoding with the rollout backend on the fixed test subset, one
        generation per rank (``quads.evaluation.evaluate_backend``); with ``eval_trainer`` the same prompts
        also through the trainer's own policy (``eval/trainer_pass@1``)."""
        t0 = time.perf_counter()
        mine = self.eval_set[self.dist.rank::self.dist.world]  # under torchrun each rank scores a share
        res = evaluate_backend(self.engine, self.task, mine, max_new_tokens=self.cfg.rollout.max_new_tokens,
                               batch_size=None, seed=None)
        n = distributed.all_reduce(len(res.correct), self.dist)
        out = {"eval/pass@1": distributed.all_reduce(sum(res.correct), self.dist) / n, "eval/n": n,
               "eval/len_mean": distributed.all_reduce(res.response_tokens, self.dist) / n}
        if self.trainer_engine is not None:  # the trained policy itself, in the trainer's precision
            with build.autocast(self.cfg):  # the whole method runs under no_grad
                own = evaluate_backend(self.trainer_engine, self.task, mine,
                                       max_new_tokens=self.cfg.rollout.max_new_tokens, batch_size=None, seed=None)
            out["eval/trainer_pass@1"] = own.pass_at[1]
        out["time/eval_s"] = distributed.all_reduce(time.perf_counter() - t0, self.dist, "max")
        return out

    def step(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        cuda = torch.device(self.cfg.device).type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.cfg.device)
        data, metrics = self._rollout(step)
        metrics.update(self._update(data))
        metrics["time/step_s"] = time.perf_counter() - t0
        if cuda:  # the step's peaks (rollout, old log-probs, update, sync; not the held-out eval)
            metrics["perf/max_mem_gib"] = torch.cuda.max_memory_allocated(self.cfg.device) / 2**30
            metrics["perf/max_reserved_gib"] = torch.cuda.max_memory_reserved(self.cfg.device) / 2**30
        return distributed.reduce_timings(metrics, self.dist)  # slowest rank's times, summed throughput

    # ------------------------------------------------------------------ the run

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.dist.is_main:
            return
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.writer is not None:
            for k, v in metrics.items():
                if isinstance(v, int | float) and math.isfinite(v):
                    self.writer.add_scalar(k, v, step)
            self.writer.flush()

    def _say(self, msg: str) -> None:
        if not self.quiet and self.dist.is_main:
            from tqdm import tqdm

            tqdm.write(msg, file=sys.stderr)

    def _eval_due(self, step: int) -> bool:
        e = self.cfg.eval_every
        return step == self.cfg.steps or (e > 0 and step % e == 0)

    def run(self) -> TrainResult:
        from tqdm import tqdm

        cfg = self.cfg
        t_start = time.monotonic()  # time_limit_s counts from here: setup and the start-of-RL eval included
        clock = StopClock()
        self.eval_history: list[float] = []
        self.setup()
        if self.resume_state is None:
            with clock.timing("eval"):
                ev = self.evaluate()
            self.eval_history.append(ev["eval/pass@1"])
            self._log(0, ev)
            self._say(f"step 0: held-out pass@1 {ev['eval/pass@1']:.3f} (start of RL)")
        bar = tqdm(range(self.start_step + 1, cfg.steps + 1), initial=self.start_step, total=cfg.steps,
                   disable=self.quiet or not cfg.log.progress or not self.dist.is_main, desc="quads train",
                   dynamic_ncols=True)
        metrics: dict[str, float] = dict(self.last_metrics)
        last = self.start_step
        if self.start_step >= cfg.steps:
            self._say(f"the run already has {self.start_step} steps (steps={cfg.steps}); pass --steps N with "
                      f"N > {self.start_step} to continue it")
        stop = StopRequest.install(enabled=not self.dist.enabled)  # Ctrl-C: finish the step, save, stop
        try:
            for step in bar:
                before = self._step_state()  # the end of the previous step, for a non-finite abort
                with distributed.collective_guard(self.dist, f"step {step}", latest_checkpoint(self.run_dir)):
                    try:
                        with clock.timing("step"):
                            metrics = self.step(step)
                    except NonFiniteError as e:
                        self._abort_nonfinite(step, before, e)
                last = step
                out_of_time = cfg.time_limit_s > 0 and step < cfg.steps and distributed.all_reduce(
                    float(clock.past_deadline(time.monotonic() - t_start, cfg.time_limit_s)), self.dist, "max") > 0
                if self._eval_due(step) or out_of_time:
                    with clock.timing("eval"):
                        metrics.update(self.evaluate())
                    self.eval_history.append(metrics["eval/pass@1"])
                tripped = check_guard(metrics, cfg)
                metrics["guard/tripped"] = float(bool(tripped))
                self._log(step, metrics)
                bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}",
                                gap=f"{metrics['mismatch/logp_gap_mean']:.4f}",
                                acc=f"{self.eval_history[-1]:.3f}" if self.eval_history else "n/a")
                if tripped:
                    self._say(f"step {step}: mismatch guard: {', '.join(tripped)} (action: {cfg.guard.action})")
                    if cfg.guard.action == "abort":
                        self.save(step)
                        self._finish(step)
                        raise MismatchGuardError(f"mismatch guard tripped at step {step}: {', '.join(tripped)}; "
                                                 f"checkpoint and report in {self.run_dir}")
                if ((cfg.log.save_every and step % cfg.log.save_every == 0) or step == cfg.steps or out_of_time
                        or stop.requested):
                    with clock.timing("save"):
                        self.save(step)
                if self.on_step_end is not None:
                    self.on_step_end(step, metrics)
                if stop.requested and step < cfg.steps:
                    raise KeyboardInterrupt(f"stopped after step {step} with a checkpoint; continue with quads train "
                                            f"--out-dir {self.run_dir} --resume true")
                if out_of_time:
                    self._say(f"step {step}: time limit of {cfg.time_limit_s:g}s: {time.monotonic() - t_start:.0f}s "
                              f"used, another step + the closing eval and checkpoint would not fit; stopping early "
                              f"(resume=true continues from step {step}, with time_limit_s counted afresh)")
                    break
        finally:
            stop.restore()
            bar.close()
            if self.writer is not None:
                self.writer.close()
        return self._finish(last, metrics)

    def _abort_nonfinite(self, step: int, before: dict[str, Any], err: NonFiniteError) -> None:
        """Stop on a non-finite loss or gradient: checkpoint the end of the previous step, then raise."""
        if self.opt_steps == before["opt_steps"]:  # no optimizer step of this step was taken
            self.save(step - 1, before)
            self._finish(step - 1)
            where = f"checkpoint of step {step - 1} and report in {self.run_dir}"
        else:  # an earlier mini-batch of this step already updated the weights
            ckpt = latest_checkpoint(self.run_dir)
            where = f"latest checkpoint: {ckpt}" if ckpt else "no checkpoint was written yet"
        raise NonFiniteError(f"step {step}: {err}; the optimizer step was not taken and the run stopped "
                             f"(guard.nonfinite=abort); {where}. Resume with --resume true --guard.nonfinite skip "
                             "to skip such steps, or fix the cause (optim.lr, grpo.adv_eps, the data)") from None

    def _finish(self, step: int, last: dict[str, float] | None = None) -> TrainResult:
        policy_dir = self.run_dir / "policy"
        full = distributed.full_model_state(self.trainer, self.dist)  # collective under torchrun
        report = None
        if self.dist.is_main:
            export = MoEForCausalLM(self.res.model_config)
            names = set(export.state_dict())
            export.load_state_dict({k: v for k, v in full.items() if k in names})
            save_checkpoint(export, policy_dir, extra={"recipe": self.res.recipe.name, "step": step,
                                                       **build.policy_task(self.cfg, self.res.task)},
                            tokenizer=self.tokenizer)
            report = write_report(self.run_dir)
        report = distributed.broadcast_object(report, self.dist)
        ev = self.eval_history or [math.nan]
        return TrainResult(self.run_dir, report, policy_dir, step, ev[0], ev[-1], last or {})


def remove_stale_temps(run_dir: Path) -> None:
    """Remove what a killed atomic write left in the run folder (``.policy.*.tmp``, ``.config.yaml.*.tmp`` ...).

    Only this run writes there; a checkpoint's own temp folders are removed by ``save_train_state``."""
    for folder in (run_dir, run_dir / "report"):
        for stale in folder.glob(".*.tmp"):
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)

