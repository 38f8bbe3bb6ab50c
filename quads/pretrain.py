"""Supervised warm start of the built-in MoE on a task's demonstrations (``quads pretrain``'s library;
the command is ``quads.pretrain_cli``; ``quads train``, ``compare`` and ``diagnose`` reach it through
``quads.rl.build.warm_start_policy``).

Each training sequence is ``<bos> prompt response <eos>`` in character ids; teacher forcing with
cross-entropy on the response and ``<eos>`` only (prompt and padding positions are masked), mean
over those tokens. AdamW, linear warmup then cosine decay to 10% of ``lr``, gradient clipping at 1.
Batches are drawn with replacement from ``train_size`` distinct training examples (all the task's train
split when it offers fewer, as code and the small arithmetic and countdown levels do) by a seeded
generator, so a run is a function of its config. The checkpoint is cached under
``<cache_dir>/<sha256(config)[:16]>/`` (``cache_dir``: ``$QUADS_CACHE/pretrain``, else
``~/.cache/quads/pretrain``): a second call with the same config returns the folder at once. An SFT
with ``eval_at`` checks also saves its state at each of them (``<key>.partial/state.pt``: weights, AdamW
moments, the batch sampler's generator, history); a call that finds one continues from it and ends with
the weights of an uninterrupted run (a device call that runs out mid-SFT loses only the steps since the
last check). At the end the held-out greedy pass@1 is measured with the rollout engine and stored in the checkpoint's
``extra["pretrain_result"]``.

Mixed precision (``compute_dtype``): the parameters and AdamW state stay in ``dtype`` (the master
weights, what the checkpoint holds); the forward runs under ``torch.autocast`` to ``compute_dtype``
(``quads.rl.build.mixed_precision``, as the RL trainer does), so on CUDA the experts take the sorted
grouped-GEMM path (``quads.model.moe.use_sorted``: BF16 ``torch._grouped_mm``) instead of the per-expert
loop. ``auto`` is BF16 on CUDA over FP32 weights and ``dtype`` itself elsewhere (the CPU runs are what
they were). The held-out evaluations run a copy of the model in the compute dtype (the dtype the RL
rollout runs in). A compute dtype equal to ``dtype`` hashes as it did before the field existed.

Intermediate evaluation (``eval_at``): after each listed optimizer step the same held-out greedy
evaluation as the final one (``heldout_eval``) runs, and its pass@1 is stored in
``extra["pretrain_result"]["heldout_by_step"]``, so one run shows how accuracy grows with the step count. The
step-``s`` model of a longer run is mid-schedule (its learning rate has not decayed to 10%), so it is not
the model a ``steps: s`` run saves; it locates the range, and the chosen count is then trained as such.

Stopping at a target (``target_pass``): the run stops at the first ``eval_at`` step whose held-out pass@1
reaches ``target_pass`` and saves that step's model (its pass@1 is the checkpoint's; no second evaluation),
so a warm start lands in a pass@1 band whatever step the task is learnt at. On the GPU that step varies
from run to run of one config (BF16 grouped-GEMM backward, non-deterministic accumulation; the 100m
chain SFT gave 0.49 and 0.015 held-out pass@1 after 450 steps on two calls). When no listed step reaches
it, all ``steps`` are trained as without it. ``target_pass``, ``eval_at``, ``eval_size`` and
``max_new_tokens`` then decide the weights and are hashed.

Activation outliers (``outliers``, ``quads.model.outliers``): ``init`` sets the chosen RMSNorm gains to
``outliers.scale`` before training; ``inject`` takes the warm start of the same config without outliers
(trained or cached), scales the gains and divides the matching weight columns (function-preserving),
checks the function on a batch of training sequences and stores the check and the per-channel absmax
growth in ``extra["outliers_result"]``. A config with ``outliers.mode: none`` hashes as it did before the
field existed, so older cache entries stay valid.

Context length (``max_seq_len``): None builds the preset as it is; an int replaces the preset's
``max_seq_len`` (at least the preset's), so a preset learns a task whose prompt + response is longer
(arithmetic level 10 on the 100m preset). It sizes only the rollout KV cache (RoPE angles are computed
from the positions, no table), so no weight and no number changes; the checkpoint's config carries it to
the RL runs. Hashed only when set: a config without it keeps its cache key.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from quads.config import to_dict
from quads.model.outliers import OutlierConfig
from quads.tasks.base import examples_up_to

COMPUTE_DTYPES = ("auto", "float32", "bfloat16")  # PretrainConfig.compute_dtype values
FORMAT_VERSION = 1  # bump when the SFT recipe or data format changes, so old cache entries are not reused


@dataclass
class PretrainConfig:
    task: str = "arithmetic"  # registered task (quads.tasks.get_task) whose demonstrations are learned
    difficulty: int | None = None  # task difficulty level; None = the task's default
    preset: str = "tiny"  # built-in ModelConfig preset (quads.model.PRESETS)
    steps: int = 600  # optimizer steps
    batch_size: int = 32  # sequences per step
    lr: float = 3e-3  # peak AdamW learning rate
    warmup_steps: int = 30  # linear warmup steps
    weight_decay: float = 0.0  # AdamW weight decay
    train_size: int = 20000  # distinct training examples drawn from the task's train split (all it has when fewer)
    seed: int = 0  # init, data order and task generation seed
    eval_size: int = 200  # held-out prompts for the final greedy pass@1 (0 = skip)
    max_new_tokens: int = 64  # response cap of that evaluation
    dtype: str = "float32"  # parameter (master weight) dtype of the model: the optimizer's and the checkpoint's
    compute_dtype: str = "auto"  # forward compute dtype: auto (bfloat16 on CUDA over float32 weights, else dtype), float32, bfloat16
    device: str = "cpu"
    cache_dir: str | None = None  # cache root; None = $QUADS_CACHE/pretrain or ~/.cache/quads/pretrain
    progress: bool = True  # tqdm progress bar
    threads: int | None = None  # torch.set_num_threads for the run; None = leave torch's setting
    outliers: OutlierConfig = field(default_factory=OutlierConfig)  # activation outlier channels (module docstring)
    eval_at: list[int] = field(default_factory=list)  # optimizer steps after which held-out pass@1 is also measured (<= steps)
    target_pass: float | None = None  # stop at the first eval_at step whose held-out pass@1 >= this, saving that model
    max_seq_len: int | None = None  # the model's context (prompt + response, KV cache length); None = the preset's

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "train_size", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"PretrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0 or self.warmup_steps < 0 or self.weight_decay < 0 or self.eval_size < 0:
            raise ValueError("PretrainConfig: lr must be > 0; warmup_steps, weight_decay, eval_size >= 0")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"PretrainConfig.threads must be >= 1 or None, got {self.threads}")
        if self.dtype not in ("float32", "bfloat16", "float64"):
            raise ValueError(f"PretrainConfig.dtype must be float32, bfloat16 or float64, got {self.dtype!r}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"PretrainConfig.compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}, got "
                             f"{self.compute_dtype!r}")
        if self.compute_dtype not in ("auto", self.dtype) and not (self.compute_dtype == "bfloat16"
                                                                   and self.dtype == "float32"):
            raise ValueError(f"PretrainConfig.compute_dtype {self.compute_dtype} over dtype {self.dtype} weights is not "
                             "supported: use auto, the dtype itself, or bfloat16 over float32 weights")
        self.eval_at = sorted({int(s) for s in self.eval_at})
        if self.eval_at and not (1 <= self.eval_at[0] and self.eval_at[-1] <= self.steps):
            raise ValueError(f"PretrainConfig.eval_at must list optimizer steps in 1..steps ({self.steps}), got "
                             f"{self.eval_at}")
        if self.eval_at and self.eval_size == 0:
            raise ValueError("PretrainConfig.eval_at needs eval_size > 0 (the held-out prompts it evaluates)")
        if self.target_pass is not None and not (0.0 < self.target_pass <= 1.0 and self.eval_at):
            raise ValueError(f"PretrainConfig.target_pass must be in (0, 1] and needs eval_at (the steps at which it "
                             f"is checked); got target_pass {self.target_pass}, eval_at {self.eval_at}")
        from quads.model.config import PRESETS

        if self.max_seq_len is not None:
            own = PRESETS.get(self.preset, {}).get("max_seq_len", 1)
            if isinstance(self.max_seq_len, bool) or not isinstance(self.max_seq_len, int) or self.max_seq_len < own:
                raise ValueError(f"PretrainConfig.max_seq_len lengthens the {self.preset} preset's context: a whole "
                                 f"number >= its max_seq_len {own}, or None for the preset's; got {self.max_seq_len!r}")
        if self.outliers.active:
            hidden = PRESETS.get(self.preset, {}).get("hidden_size")
            if hidden is not None and max(self.outliers.channels) >= hidden:
                raise ValueError(f"outliers.channels must be < the {self.preset} preset's hidden_size {hidden}; "
                                 f"got {self.outliers.channels}")

    def cache_key(self) -> str:
        """Hash of every field that changes the weights.

        Not hashed: where the cache is, the device, threads, the progress bar, and the final
        evaluation's settings (``eval_size``, ``max_new_tokens``, ``eval_at``): a cached checkpoint keeps
        the pass@1 measured by the run that trained it. With ``target_pass`` set, these evaluation settings
        decide where training stops and are hashed with it; unset, it hashes as before the field existed.
        The compute dtype is hashed resolved (``auto`` on CUDA is bfloat16), and only when it differs from
        ``dtype``; ``max_seq_len`` only when set.
        """
        skip = ("cache_dir", "progress", "device", "threads", "compute_dtype")
        if self.target_pass is None:
            skip += ("eval_size", "max_new_tokens", "eval_at", "target_pass")
        fields = {k: v for k, v in to_dict(self).items() if k not in skip}
        if not self.outliers.active:
            del fields["outliers"]
        if self.max_seq_len is None:
            del fields["max_seq_len"]
        if self.resolved_compute_dtype() != self.dtype:
            fields["compute_dtype"] = self.resolved_compute_dtype()
        blob = json.dumps({"v": FORMAT_VERSION, **fields}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def resolved_compute_dtype(self) -> str:
        """``compute_dtype`` with ``auto`` resolved: bfloat16 on CUDA over float32 weights, else ``dtype``."""
        if self.compute_dtype != "auto":
            return self.compute_dtype
        return "bfloat16" if torch.device(self.device).type == "cuda" and self.dtype == "float32" else self.dtype

    def cache_root(self) -> Path:
        if self.cache_dir is not None:
            return Path(self.cache_dir)
        env = os.environ.get("QUADS_CACHE")
        return Path(env) / "pretrain" if env else Path.home() / ".cache" / "quads" / "pretrain"

    def folder(self) -> Path:
        return self.cache_root() / self.cache_key()


def _task(cfg: PretrainConfig):
    from quads.tasks import get_task

    kwargs: dict[str, Any] = {"seed": cfg.seed}
    if cfg.difficulty is not None:
        kwargs["difficulty"] = cfg.difficulty
    return get_task(cfg.task, **kwargs)


def encode_sft(tokenizer, prompt: str, response: str) -> tuple[list[int], int]:
    """Ids of ``<bos> prompt response <eos>`` and the index of the first response id."""
    bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    head = bos + tokenizer.encode(prompt)
    return head + tokenizer.encode(response) + [tokenizer.eos_id], len(head)


def collate(seqs: list[tuple[list[int], int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input ids [B, L] and targets [B, L] (next id; -100 on prompt and padding)."""
    L = max(len(s) for s, _ in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    targets = torch.full((len(seqs), L), -100, dtype=torch.long)
    for i, (s, start) in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        targets[i, start - 1:len(s) - 1] = torch.tensor(s[start:])  # position t predicts id t+1
    return ids, targets


def sft_loss(model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor
             ) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean cross-entropy over response tokens (targets != -100), plus the router aux loss."""
    out = model(ids)
    logits = out.logits.float()  # [B, L, V]
    n_tok = (targets != -100).sum()
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100,
                                           reduction="sum") / n_tok.clamp_min(1)
    loss = ce + out.aux_loss
    with torch.no_grad():
        acc = ((logits.argmax(-1) == targets) & (targets != -100)).sum() / n_tok.clamp_min(1)
    return loss, {"sft/ce": ce.item(), "sft/token_acc": acc.item(), "sft/aux": float(out.aux_loss)}


def _lr_at(step: int, cfg: PretrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = (step - cfg.warmup_steps) / max(cfg.steps - cfg.warmup_steps, 1)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def model_config(cfg: PretrainConfig, vocab_size: int):
    """The ``ModelConfig`` an SFT run trains: ``cfg.preset`` in ``cfg.dtype``, ``cfg.max_seq_len`` when set."""
    from quads.model import ModelConfig

    longer = {} if cfg.max_seq_len is None else {"max_seq_len": cfg.max_seq_len}
    return ModelConfig.preset(cfg.preset, vocab_size=vocab_size, dtype=cfg.dtype, **longer)


def check_lengths(data: list[tuple[list[int], int]], max_seq_len: int, cfg: PretrainConfig) -> None:
    """Every SFT sequence fits the model's ``max_seq_len`` (the rollout KV cache's length); else ValueError."""
    longest = max(len(s) for s, _ in data)
    if longest > max_seq_len:
        whose = f"the {cfg.preset} preset's" if cfg.max_seq_len is None else "the config's"
        raise ValueError(f"pretrain: the longest {cfg.task} demonstration sequence (level {cfg.difficulty}) is "
                         f"{longest} tokens, over {whose} max_seq_len {max_seq_len}; "
                         "pass a longer max_seq_len (--max-seq-len), or pick a level with shorter responses")


def train_sft(cfg: PretrainConfig, log_every: int = 50, evals: list[dict[str, Any]] | None = None,
              resume: Path | None = None):
    """Train a fresh model; returns (model, tokenizer, task, history of (step, ce) every log_every).

    ``evals``: when given, one record per ``cfg.eval_at`` step is appended to it (``heldout_eval``'s
    result plus ``step`` and ``eval_seconds``); the evaluations draw no random numbers from the training.
    ``resume``: a file for the SFT's state (weights, AdamW moments, the batch sampler's generator, the
    loss history and evaluations), written atomically at every ``eval_at`` step and, when it exists at
    the start, continued from: an SFT killed between checks loses only the steps since the last one and
    ends with the same weights as an uninterrupted one (``warm_start`` passes ``partial_state(cfg)``)."""
    threads = torch.get_num_threads()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    try:
        return _train(cfg, log_every, evals, resume)
    finally:
        torch.set_num_threads(threads)


def partial_state(cfg: PretrainConfig) -> Path:
    """Where ``warm_start`` keeps an unfinished SFT's state: beside the checkpoint folder it will become."""
    folder = cfg.folder()
    return folder.with_name(folder.name + ".partial") / "state.pt"


def resumed_progress(path: Path) -> dict[str, Any]:
    """What a partial state at ``path`` already holds: its ``step``, ``train_seconds`` (evaluations
    excluded) and ``n_evals`` (its ``eval_at`` records); zeros when there is none."""
    side = path.with_suffix(".json")
    if path.is_file() and side.is_file():
        return json.loads(side.read_text())
    return {"step": 0, "train_seconds": 0.0, "n_evals": 0}


def _save_state(path: Path, model, opt, gen: torch.Generator, step: int, history, evals, ema,
                train_seconds: float) -> None:
    from quads.io import atomic_write, atomic_write_text

    state = {"step": step, "model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(),
             "history": [list(h) for h in history], "evals": list(evals), "ema": ema}
    atomic_write(path, lambda p: torch.save(state, p))
    atomic_write_text(path.with_suffix(".json"), json.dumps({"step": step, "train_seconds": train_seconds,
                                                             "n_evals": len(evals)}) + "\n")


def _train(cfg: PretrainConfig, log_every: int, evals: list[dict[str, Any]] | None, resume: Path | None = None):
    from tqdm.auto import tqdm

    from quads.model import MoEForCausalLM
    from quads.model.tokenizer import CharTokenizer
    from quads.rl.build import mixed_precision

    torch.manual_seed(cfg.seed)
    tok = CharTokenizer()
    task = _task(cfg)
    examples = examples_up_to(task, "train", cfg.train_size)
    if cfg.progress and len(examples) < cfg.train_size:
        print(f"pretrain {cfg.task}: the task's train split offers {len(examples)} distinct prompts "
              f"(train_size {cfg.train_size}); training on all of them", file=sys.stderr)
    data = [encode_sft(tok, e.prompt, task.demonstration(e)) for e in examples]
    model = MoEForCausalLM(model_config(cfg, tok.vocab_size))
    check_lengths(data, model.config.max_seq_len, cfg)
    if cfg.outliers.mode == "init":
        from quads.model.outliers import init_outliers

        init_outliers(model, cfg.outliers)
    model.to(cfg.device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    history: list[tuple[int, float]] = []
    first, ema, done_evals = 0, None, []
    offset = resumed_progress(resume)["train_seconds"] if resume is not None else 0.0
    if resume is not None and resume.is_file():
        state = torch.load(resume, map_location="cpu", weights_only=True)  # the generator state stays on the CPU
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        gen.set_state(state["gen"])
        first, ema = state["step"], state["ema"]
        history = [(int(s), float(c)) for s, c in state["history"]]
        done_evals = list(state["evals"])
        if evals is not None:
            evals.extend(done_evals)
        if cfg.progress:
            print(f"pretrain {cfg.task}: resuming the SFT at step {first} from {resume}", file=sys.stderr)
    bar = tqdm(range(first, cfg.steps), desc=f"pretrain {cfg.task}", disable=not cfg.progress, file=sys.stderr,
               initial=first, total=cfg.steps)
    t0, eval_total = time.monotonic(), 0.0
    for step in bar:
        idx = torch.randint(len(data), (cfg.batch_size,), generator=gen).tolist()
        ids, targets = collate([data[i] for i in idx], tok.pad_id)
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, cfg)
        with mixed_precision(cfg.resolved_compute_dtype(), cfg.dtype, cfg.device):
            loss, metrics = sft_loss(model, ids.to(cfg.device), targets.to(cfg.device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ce = metrics["sft/ce"]
        ema = ce if ema is None else 0.95 * ema + 0.05 * ce
        if step % log_every == 0 or step == cfg.steps - 1:
            history.append((step, ce))
            bar.set_postfix(ce=f"{ema:.3f}", acc=f"{metrics['sft/token_acc']:.3f}")
        if step + 1 in cfg.eval_at and step + 1 < cfg.steps:  # the last step's is the final evaluation
            start = time.monotonic()
            trained = offset + start - t0 - eval_total  # SFT seconds so far, evaluations excluded
            devices = [torch.device(cfg.device)] if torch.device(cfg.device).type == "cuda" else []
            with torch.random.fork_rng(devices=devices):
                res = heldout_eval(cfg, model, tok, task)
            model.train()
            took = time.monotonic() - start
            eval_total += took
            res.update(step=step + 1, train_seconds=round(trained, 1), eval_seconds=round(took, 1))
            if evals is not None:
                evals.append(res)
            done_evals.append(res)
            if resume is not None:
                _save_state(resume, model, opt, gen, step + 1, history, done_evals, ema, trained)
            if cfg.progress:
                print(f"pretrain {cfg.task}: step {step + 1}: held-out greedy pass@1 {res['heldout_pass@1']}",
                      file=sys.stderr)
            if cfg.target_pass is not None and res["heldout_pass@1"] >= cfg.target_pass:
                res["target_reached"] = True
                if history[-1][0] != step:  # the stopping step's loss ends the history
                    history.append((step, ce))
                break
    return model, tok, task, history


def heldout_eval(cfg: PretrainConfig, model, tokenizer, task) -> dict[str, Any]:
    """Held-out greedy pass@1 of ``model`` on ``cfg.eval_size`` test prompts (``evaluate_model``, responses
    capped at ``max_new_tokens``), run in the compute dtype: a copy of the model in that dtype when it
    differs from ``dtype``. The final evaluation and every ``eval_at`` step use it."""
    from quads.evaluation import evaluate_model
    from quads.model import MoEForCausalLM

    test = examples_up_to(task, "test", cfg.eval_size)
    longest = max(len(task.demonstration(e)) for e in test)
    if cfg.progress and longest > cfg.max_new_tokens:
        print(f"pretrain {cfg.task}: max_new_tokens {cfg.max_new_tokens} is shorter than the longest held-out "
              f"demonstration ({longest} characters): such responses are cut and score 0; pass "
              f"--max-new-tokens {longest + 8}", file=sys.stderr)
    compute = cfg.resolved_compute_dtype()
    if compute != cfg.dtype:
        copy = MoEForCausalLM(replace(model.config, dtype=compute))
        copy.load_state_dict(model.state_dict())
        model = copy.to(next(model.parameters()).device)
    res = evaluate_model(model.eval(), tokenizer, task, test, max_new_tokens=cfg.max_new_tokens)
    return {"heldout_pass@1": res.pass_at[1], "heldout_mean_response_chars": res.mean_response_chars}


def warm_start(cfg: PretrainConfig) -> Path:
    """The checkpoint folder of ``cfg``'s SFT run, training it first unless it is cached."""
    folder = cfg.folder()
    if (folder / "config.json").is_file():
        return folder
    if cfg.outliers.mode == "inject":
        return _inject_warm_start(cfg)
    if cfg.progress:
        print(f"pretrain {cfg.task}: no cached warm start for this config; training the {cfg.preset} model "
              f"for {cfg.steps} steps (then cached in {folder})", file=sys.stderr)
    start, resume = time.monotonic(), partial_state(cfg)
    before, evals = resumed_progress(resume), []
    model, tok, task, history = train_sft(cfg, evals=evals, resume=resume)
    train_seconds = (before["train_seconds"] + time.monotonic() - start
                     - sum(e["eval_seconds"] for e in evals[before["n_evals"]:]))
    out = save_warm_start(cfg, model, tok, task, history, train_seconds=train_seconds, evals=evals)
    if resume.parent.is_dir():  # the SFT is cached now; its partial state is not needed
        shutil.rmtree(resume.parent, ignore_errors=True)
    return out


def _inject_warm_start(cfg: PretrainConfig) -> Path:
    """``outliers.mode: inject``: the warm start without outliers, with outliers injected, saved to ``cfg.folder()``."""
    from quads.model.checkpoint import load_checkpoint
    from quads.model.outliers import inject_checked
    from quads.model.tokenizer import load_tokenizer

    base = warm_start(replace(cfg, outliers=OutlierConfig()))
    model, extra = load_checkpoint(base, device=cfg.device)
    tok, task = load_tokenizer(base), _task(cfg)
    probe = [encode_sft(tok, e.prompt, task.demonstration(e)) for e in examples_up_to(task, "train", 8)]
    ids, _ = collate(probe, tok.pad_id)
    check = inject_checked(model, cfg.outliers, ids.to(cfg.device))
    if cfg.progress:
        print(f"pretrain {cfg.task}: injected outliers {cfg.outliers.channels} x{cfg.outliers.scale:g} into "
              f"{base}; max |logit change| {check['max_abs_logit_change']:.3g}", file=sys.stderr)
    res = extra["pretrain_result"]
    return save_warm_start(cfg, model, tok, task, res["loss_history"], train_seconds=res["train_seconds"],
                           outliers_result={**check, "base_checkpoint": str(base)}, base_result=res)


def save_warm_start(cfg: PretrainConfig, model, tokenizer, task, history: list[tuple[int, float]],
                    train_seconds: float = 0.0, outliers_result: dict[str, Any] | None = None,
                    evals: list[dict[str, Any]] | None = None, base_result: dict[str, Any] | None = None) -> Path:
    """Measure the held-out greedy pass@1 of a trained model (``heldout_eval``) and write it to ``cfg.folder()``,
    with the ``eval_at`` records of the run (``evals``; the last step's is this final evaluation).
    ``base_result``: the ``pretrain_result`` of the SFT this model was made from (outliers ``inject``): its
    stop step and ``eval_at`` records are kept, and this model is evaluated afresh."""
    from quads.model.checkpoint import save_checkpoint

    result: dict[str, Any] = {"train_seconds": round(train_seconds, 1), "loss_history": history,
                              "final_ce": history[-1][1], "compute_dtype_resolved": cfg.resolved_compute_dtype()}
    stop = None
    if base_result is not None:  # the base SFT's stop and records; this model's own evaluation below
        result |= {k: base_result[k] for k in ("stopped_at_step", "heldout_by_step") if k in base_result}
        if "heldout_pass@1" in base_result:
            result["base_heldout_pass@1"] = base_result["heldout_pass@1"]
    elif evals and evals[-1].get("target_reached"):
        stop = evals[-1]
    if stop is not None:  # stopped at target_pass: that step's evaluation is the model's
        result |= {k: stop[k] for k in ("heldout_pass@1", "heldout_mean_response_chars", "eval_seconds")}
        result["stopped_at_step"] = stop["step"]
    elif cfg.eval_size > 0:
        start = time.monotonic()
        result |= heldout_eval(cfg, model, tokenizer, task)
        result["eval_seconds"] = round(time.monotonic() - start, 1)
    if base_result is None and cfg.eval_at and "heldout_pass@1" in result:
        last = ([{"step": cfg.steps, "train_seconds": result["train_seconds"], "heldout_pass@1": result["heldout_pass@1"],
                  "heldout_mean_response_chars": result["heldout_mean_response_chars"]}]
                if cfg.steps in cfg.eval_at and stop is None else [])
        result["heldout_by_step"] = list(evals or []) + last
    extra = {"pretrain": to_dict(cfg), "pretrain_result": result, "task": cfg.task,
             "difficulty": getattr(task, "difficulty", None)}
    if cfg.outliers.active:
        extra["outliers"] = to_dict(cfg.outliers)
    if outliers_result is not None:
        extra["outliers_result"] = outliers_result
    return save_checkpoint(model, cfg.folder(), extra, tokenizer=tokenizer)
