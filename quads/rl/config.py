"""``TrainConfig``: every knob of ``quads train``, as typed nested dataclasses.

Resolved as defaults <- YAML (``--config``) <- flags (``--section.field``), by ``quads.config``; unknown
fields and wrong types raise ``ValueError`` naming the field. The resolved config is saved with the run
(``config.yaml``) and inside every checkpoint, so a run can be resumed and reproduced.

The defaults are the built-in job of ``make run``: the tiny MoE warm-started on arithmetic, then GRPO
with the ``quads`` recipe (W4A16 QAT trainer, W4A4 + RAC rollout), sized to finish in minutes on CPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from quads.model.outliers import OutlierConfig
from quads.rl.correction import CorrectionConfig
from quads.rl.grpo import GRPOLossConfig

TRAIN_DTYPES = ("float32", "bfloat16", "float64")  # names from quads.model.config.DTYPES a job may use


def _positive(section: str, **values: float) -> None:
    for name, v in values.items():
        if not v > 0:
            raise ValueError(f"{section}.{name} must be > 0; got {v}")


@dataclass
class ModelSection:
    """The policy: a checkpoint folder, or a built-in preset that is warm-started automatically."""

    checkpoint: str | None = None  # checkpoint folder (quads save_checkpoint); None = warm start the preset
    preset: str = "tiny"  # built-in ModelConfig preset used by the warm start (ignored with a checkpoint)
    master_dtype: Literal["float32", "bfloat16"] = "float32"  # trainer master weights (optimizer updates them)

    def __post_init__(self) -> None:
        if self.master_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"model.master_dtype must be float32 or bfloat16; got {self.master_dtype!r}")


@dataclass
class WarmStartSection:
    """Supervised warm start (``quads.pretrain.warm_start``), used when ``model.checkpoint`` is None."""

    steps: int = 600  # SFT steps on the task's demonstrations (cached by config hash)
    lr: float = 3e-3  # SFT learning rate
    batch_size: int = 32  # SFT sequences per step
    train_size: int = 20000  # distinct SFT prompts drawn from the task's train split (all it has when fewer)
    cache_dir: str | None = None  # warm-start cache root; None = $QUADS_CACHE/pretrain or ~/.cache/quads/pretrain
    outliers: OutlierConfig = field(default_factory=OutlierConfig)  # activation outlier channels (quads.model.outliers)
    # SFT forward compute dtype over float32 master weights (PretrainConfig.compute_dtype): auto = bfloat16 on CUDA
    # (the experts' grouped-GEMM path), float32 on the CPU; hashed into the cache key when it is not float32
    compute_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # stop the SFT at the first eval_at step whose held-out greedy pass@1 (eval_size prompts, responses capped
    # at rollout.max_new_tokens) reaches target_pass and keep that model (PretrainConfig.target_pass): a warm
    # start in a pass@1 band whatever step the task is learnt at; None = train all steps
    target_pass: float | None = None
    eval_at: list[int] = field(default_factory=list)  # SFT steps at which target_pass is checked
    eval_size: int = 100  # held-out prompts of those checks (used only with target_pass)
    # the model's context (prompt + response: the KV cache length) instead of model.preset's (PretrainConfig.max_seq_len,
    # at least the preset's; hashed into the cache key when set): a preset warm-started on longer sequences
    max_seq_len: int | None = None

    def __post_init__(self) -> None:
        _positive("warm_start", steps=self.steps, lr=self.lr, batch_size=self.batch_size,
                  train_size=self.train_size, eval_size=self.eval_size)
        if self.max_seq_len is not None:
            _positive("warm_start", max_seq_len=self.max_seq_len)
        if self.target_pass is not None and not (0.0 < self.target_pass <= 1.0 and self.eval_at):
            raise ValueError(f"warm_start.target_pass must be in (0, 1] and needs warm_start.eval_at; got "
                             f"{self.target_pass}, eval_at {self.eval_at}")


@dataclass
class TaskSection:
    """Prompts and the verifier."""

    name: str = "arithmetic"  # a registered task (quads.tasks.get_task)
    difficulty: int | None = None  # task difficulty level; None = the task's default
    dataset: str | None = None  # jsonl/parquet file with verl-style fields, replaces the generated train split
    train_size: int = 4000  # distinct training prompts of the task (all it has when fewer), in seeded epochs
    sandbox: Literal["full", "no-cgroup", "process"] = "full"  # code isolation, weaker = opt-in (docs/TASKS.md)
    # generated tasks only (a dataset's held-out records are its split by the run seed); 0 = the held-out
    # prompts that quads eval and the warm start's pass@1 score
    eval_seed: int | None = None  # seed of the held-out prompts: an int fixes them for every run seed; None = the run's seed

    def __post_init__(self) -> None:
        _positive("task", train_size=self.train_size)
        if self.eval_seed is not None and (self.name == "dataset" or self.dataset is not None):
            raise ValueError("task.eval_seed applies to generated tasks only: a dataset's held-out records are "
                             "its split by the run's seed; leave task.eval_seed unset with task.name=dataset")


@dataclass
class RecipeSection:
    """Precision recipe (DESIGN.md section 4) and its overrides; None keeps the preset's value."""

    name: str = "quads"  # bf16 | fp8 | nvfp4 | w4a16-qat | w4a4-qat | quads | w4a16
    rac_ratio: float | None = None  # rollout RAC ratio in [0, 1] (quads: 0.5)
    rac_selection: Literal["dynamic", "static"] | None = None  # RAC channel selection
    act_scale: Literal["tensor", "token"] | None = None  # NVFP4 activation global scale, on each side that has them
    weight_tile: Literal["1x16", "16x16"] | None = None  # NVFP4 weight block shape, on each side that has them
    targets: list[str] | None = None  # module-name patterns to quantize (default: routed experts)
    expert_path: Literal["auto", "grouped", "loop"] | None = None  # experts (trainer and rollout): batched GEMMs or the loop (auto: grouped on CUDA)
    # mismatch amplifier alpha (diagnostic): every quantized rollout GEMM uses x + alpha * (Q(x) - x) for its
    # weight and activation operands (quads.quant.amplify); 1 = the recipe as is; != 1 runs the experts loop
    rollout_error_scale: float = 1.0

    def overrides(self) -> dict:
        """Keyword overrides for ``quads.quant.get_recipe``."""
        out: dict = {"rollout_error_scale": self.rollout_error_scale} if self.rollout_error_scale != 1.0 else {}
        for k in ("rac_ratio", "rac_selection", "act_scale", "targets", "expert_path"):
            v = getattr(self, k)
            if v is not None:
                out[k] = tuple(v) if k == "targets" else v
        if self.weight_tile is not None:
            out["weight_tile"] = tuple(int(x) for x in self.weight_tile.split("x"))
        return out

    def __post_init__(self) -> None:
        if self.rac_ratio is not None and not 0.0 <= self.rac_ratio <= 1.0:
            raise ValueError(f"recipe.rac_ratio must be in [0, 1]; got {self.rac_ratio}")
        if not 0.0 <= self.rollout_error_scale < float("inf"):
            raise ValueError(f"recipe.rollout_error_scale (the mismatch amplifier alpha) must be a finite number "
                             f">= 0; got {self.rollout_error_scale} (1 = the recipe's own rollout error)")


@dataclass
class RolloutSection:
    """Sampling on the rollout engine."""

    prompts_per_step: int = 64  # prompts per RL step (P); large, as the tiny model needs low-noise gradients
    n_samples: int = 8  # samples per prompt (the GRPO group size n); batch B = P * n
    temperature: float = 1.0  # sampling temperature; trainer log-probs use the same one
    max_new_tokens: int = 48  # response length cap (arithmetic level 6 answers take up to 46 characters + eos)
    cuda_graphs: bool = True  # quads backend on CUDA: replay the static decode step and prefill from CUDA graphs (false: debugging)
    compile: bool = True  # quads backend on CUDA: torch.compile the static decode step (fused kernels, own rounding; false: debugging)
    compile_prefill: bool = True  # quads backend on CUDA: torch.compile the static path's prefill too, one graph for every prompt width (own rounding, replayed by rescoring; 1b prefill 2.1x faster, docs/PERF.md run 56) on a GPU
    fuse_qkv: bool = True  # quads backend, static decode: one GEMM by the stacked q/k/v weights instead of three (a copy of those weights; own rounding, replayed by rescoring; 1b step 2.50 -> 2.31 ms in BF16 on an H100, docs/PERF.md run 64)
    share_prefill: bool = True  # quads backend, static decode: prefill each prompt once for its n samples and copy its KV cache rows (1/n of the prefill's tokens; own rounding under activation quantization, replayed by rescoring)
    decode_attention: Literal["auto", "sdpa", "triton"] = "auto"  # quads backend: the static decode step's attention; sdpa = over the whole KV cache, unwritten columns masked; triton = quads.kernels.decode_attention, reading only the columns written so far (CUDA); auto = triton on CUDA, else sdpa

    def __post_init__(self) -> None:
        _positive("rollout", prompts_per_step=self.prompts_per_step, temperature=self.temperature,
                  max_new_tokens=self.max_new_tokens)
        if self.decode_attention not in ("auto", "sdpa", "triton"):
            raise ValueError(f"rollout.decode_attention must be auto, sdpa or triton; got {self.decode_attention!r}")
        if self.n_samples < 2:
            raise ValueError(f"rollout.n_samples must be >= 2 (GRPO compares samples); got {self.n_samples}")


@dataclass
class OptimSection:
    """AdamW on the trainer's master weights.

    ``micro_batch_size`` (gradient accumulation, ``quads.rl.microbatch``) counts sequences, as verl's
    ``ppo_micro_batch_size_per_gpu`` and TRL's ``per_device_train_batch_size`` do, not tokens (verl's
    ``use_dynamic_bsz``): the trainer pads every row of a step to the step's widest prompt plus longest
    response (no packing), so a forward's activations are rows x that width, at most
    ``micro_batch_size x (prompt + rollout.max_new_tokens)`` tokens, and a row count splits every step the
    same way (the same shapes for ``trainer_compile``, whatever lengths were sampled).
    """

    lr: float = 3e-5  # learning rate (constant after warmup); AdamW moves every weight ~lr per step
    warmup_steps: int = 0  # linear warmup optimizer steps
    betas: tuple[float, float] = (0.9, 0.99)  # AdamW betas
    eps: float = 1e-8  # AdamW eps
    weight_decay: float = 0.0  # decoupled weight decay
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    mini_batches: int = 1  # optimizer steps per PPO epoch (the batch is split in this many mini-batches)
    ppo_epochs: int = 1  # passes over each step's batch
    # gradient accumulation: every trainer forward (+ backward) takes at most this many sequences, a mini-batch's
    # gradients are summed over its micro-batches before its one optimizer step (the same step up to summation order)
    micro_batch_size: int | None = None  # sequences per trainer forward/backward; None = the whole mini-batch

    def __post_init__(self) -> None:
        _positive("optim", lr=self.lr, eps=self.eps, mini_batches=self.mini_batches, ppo_epochs=self.ppo_epochs)
        m = self.micro_batch_size
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(f"optim.micro_batch_size must be a whole number of sequences >= 1, or None for the whole "
                             f"mini-batch in one forward/backward; got {m!r}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"optim.betas must be two numbers in [0, 1); got {self.betas}")
        if self.weight_decay < 0 or self.grad_clip < 0 or self.warmup_steps < 0:
            raise ValueError("optim.weight_decay, optim.grad_clip and optim.warmup_steps must be >= 0")


@dataclass
class GuardSection:
    """Mismatch guard: act when the rollout/trainer gap crosses a threshold (None = not checked)."""

    gap_mean: float | None = 0.5  # threshold on mismatch/logp_gap_mean
    gap_max: float | None = None  # threshold on mismatch/logp_gap_max
    k3: float | None = 0.1  # threshold on mismatch/k3
    # the amplifier's budget is per sequence, about the same at 20-284 tokens (no harm up to 2.5-5, harm from
    # ~7; docs/RESULTS.md section 3), where a per-token k3 threshold cannot hold for every response length
    seq_gap: float | None = 5.0  # threshold on mismatch/seq_gap_mean (mean over responses of sum_t |dlogp|)
    action: Literal["warn", "abort"] = "warn"  # warn: log and continue; abort: checkpoint and stop (exit 3)
    # NaN/Inf loss or grad norm in a mini-batch: no optimizer step; skip: count it in optim/skipped and go on;
    # abort: checkpoint the end of the step before and stop (exit 3)
    nonfinite: Literal["skip", "abort"] = "abort"  # skip: drop that optimizer step; abort: checkpoint and stop

    def __post_init__(self) -> None:
        if self.action not in ("warn", "abort"):
            raise ValueError(f"guard.action must be warn or abort; got {self.action!r}")
        if self.nonfinite not in ("skip", "abort"):
            raise ValueError(f"guard.nonfinite must be skip or abort; got {self.nonfinite!r}")


@dataclass
class LogSection:
    """Logging and checkpoints."""

    tensorboard: bool = True  # also write TensorBoard event files under <out_dir>/tb
    probe_tokens: int = 1024  # size of the fixed probe for mismatch/logp_gap_max_probe
    save_every: int = 5  # checkpoint every N steps, at the end and on abort (0: only at the end and on abort)
    progress: bool = True  # tqdm progress bar with reward and gap

    def __post_init__(self) -> None:
        _positive("log", probe_tokens=self.probe_tokens)
        if self.save_every < 0:
            raise ValueError(f"log.save_every must be >= 0; got {self.save_every}")


@dataclass
class TrainConfig:
    """``quads train``: GRPO with a quantized rollout engine."""

    model: ModelSection = field(default_factory=ModelSection)
    warm_start: WarmStartSection = field(default_factory=WarmStartSection)
    task: TaskSection = field(default_factory=TaskSection)
    recipe: RecipeSection = field(default_factory=RecipeSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    optim: OptimSection = field(default_factory=OptimSection)
    grpo: GRPOLossConfig = field(default_factory=GRPOLossConfig)
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    guard: GuardSection = field(default_factory=GuardSection)
    log: LogSection = field(default_factory=LogSection)
    routing_replay: bool = False  # trainer forward reuses the rollout's expert ids (R3 routing replay)
    steps: int = 20  # RL steps (one rollout batch each)
    time_limit_s: float = 0  # wall-clock deadline of this call of the run, from the start of training (setup and the first eval included): it stops early, held-out eval, checkpoint and policy written, when another step would not fit before it; 0 = none
    eval_every: int = 10  # held-out pass@1 every N steps (and at step 0 and the end); 0 = start and end only
    eval_n: int = 200  # held-out prompts (the first eval_n of the test split drawn with task.eval_seed), greedy
    eval_trainer: bool = False  # at every held-out eval also score the trainer's own policy (its weights and forward: no rollout quantization, no amplifier) as eval/trainer_pass@1; one process only
    seed: int = 0  # seeds python, torch, the prompt sampler and the engine's generator
    device: str = "cpu"  # torch device (cpu, cuda, cuda:1)
    dtype: Literal["float32", "bfloat16", "float64"] = "bfloat16"  # compute dtype of both forwards
    threads: int = 0  # torch CPU threads; 0 = torch default
    out_dir: str | None = None  # run folder; None = runs/train-<task>-<recipe>-<timestamp>
    resume: bool = False  # continue the run in out_dir from its latest checkpoint
    # rollout engine: quads' own, or an in-process vLLM with quads' recipes (pip install 'quads[vllm]', quads.rollout.vllm)
    rollout_backend: Literal["quads", "vllm"] = "quads"
    # quads.kernels.dispatch: auto = Triton on CUDA tensors when it imports, else PyTorch; triton = always
    # Triton (raises without it); reference = PyTorch only. Bit-exact across backends: speed only.
    kernels: Literal["auto", "triton", "reference"] = "auto"  # kernel backend of the NVFP4 quantize ops
    # Inductor: fused kernels, its own rounding (not bit-identical to the plain forward); rollout.compile is the engine's
    trainer_compile: Literal["auto", True, False] = False  # torch.compile the trainer's policy forward + backward (quads.rl.compiled); auto = on CUDA in one process, never on the CPU; ~2.3-2.5x faster trainer steps on an H200 after ~1-2 min of compiles per kind of call, so it pays in long runs (~20-30M trained tokens at 100m); off by default (docs/PERF.md, trainer step)
    dist_timeout_s: float = 600.0  # under torchrun: a collective that waits this long on a dead peer raises

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1; got {self.steps}")
        if self.time_limit_s < 0:
            raise ValueError(f"time_limit_s must be >= 0 (0 = no limit); got {self.time_limit_s}")
        if self.eval_every < 0 or self.eval_n < 1:
            raise ValueError(f"eval_every must be >= 0 and eval_n >= 1; got {self.eval_every}, {self.eval_n}")
        if self.dtype not in TRAIN_DTYPES:
            raise ValueError(f"dtype must be one of {TRAIN_DTYPES}; got {self.dtype!r}")
        if self.resume and self.out_dir is None:
            raise ValueError("resume needs out_dir: pass --out-dir <run folder> --resume true")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0; got {self.threads}")
        if self.rollout_backend not in ("quads", "vllm"):
            raise ValueError(f"rollout_backend must be quads or vllm; got {self.rollout_backend!r}")
        if self.kernels not in ("auto", "triton", "reference"):
            raise ValueError(f"kernels must be auto, triton or reference; got {self.kernels!r}")
        if self.trainer_compile not in ("auto", True, False):
            raise ValueError(f"trainer_compile must be auto, true or false; got {self.trainer_compile!r}")
        if not self.dist_timeout_s > 0:
            raise ValueError(f"dist_timeout_s must be > 0 seconds; got {self.dist_timeout_s}")
        if self.rollout_backend == "vllm" and self.recipe.rollout_error_scale != 1.0:
            raise ValueError(f"recipe.rollout_error_scale={self.recipe.rollout_error_scale:g} (the mismatch amplifier) "
                             "needs rollout_backend=quads (vLLM's kernels do not implement it)")
        if self.rollout_backend == "vllm" and self.dtype == "float64":
            raise ValueError("rollout_backend=vllm needs dtype float32 or bfloat16 (vLLM has no float64)")
        b = self.rollout.prompts_per_step * self.rollout.n_samples
        if b % self.optim.mini_batches:
            raise ValueError(
                f"optim.mini_batches={self.optim.mini_batches} must divide the batch "
                f"(rollout.prompts_per_step * rollout.n_samples = {b})"
            )


def section_names() -> list[str]:
    return [f.name for f in dataclasses.fields(TrainConfig)]
