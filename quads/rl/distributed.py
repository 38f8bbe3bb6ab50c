"""Scale-out under ``torchrun``: one process per device, FSDP2 trainer, data-parallel rollouts.

PyTorch's own stack only: ``torch.distributed`` (gloo on CPU, NCCL on CUDA), FSDP2
(``torch.distributed.fsdp.fully_shard``) and DTensor. With ``WORLD_SIZE`` unset or 1 every helper
here is a no-op, so the single-process trainer runs the same code.

What each rank holds and does in one RL step (``W`` ranks, ``P`` prompts, ``n`` samples each):

- the *trainer* model sharded with FSDP2 (one ``fully_shard`` per decoder layer, then the root);
  the *rollout* model full (every rank is a rollout replica);
- the prompt sampler draws the same global order on every rank (same seed); rank ``r`` keeps the
  contiguous slice of whole prompt groups ``[r P/W, (r+1) P/W)`` (``split_groups``), so advantages,
  which normalise over a group, need no communication;
- the loss divides by the *global* response-token count (``loss_denom``): each rank's loss is
  ``W * sum_local / N_global``; FSDP2 averages gradients over ranks, so the gradient is exactly the
  one of ``sum_all / N_global``, the single-process token-mean;
- metrics are computed from the rows of all ranks (``gather_rows``: response blocks padded to the
  longest rank, then ``all_gather``), so ``mismatch/logp_gap_max`` is the global max and every mean
  has the global denominator; the loss metrics of a mini-batch are reduced with their token counts
  (``reduce_loss_metrics``); ``time/*`` take the slowest rank, ``perf/*`` the sum over ranks;
- weight sync (``ShardedWeights``, the source of ``quads.quant.sync.WeightSync``) gathers one full tensor at a time (``DTensor.full_tensor``),
  copies it into the local rollout replica and fingerprints the trainer's QDQ of it; then every rank
  re-quantizes, checks bit-exactness against the trainer, and the ranks compare their fingerprints
  with each other (all replicas identical);
- checkpoints hold the *full* state (``get_model_state_dict`` / ``get_optimizer_state_dict`` with
  ``full_state_dict``), written once by rank 0; a run resumes at any world size from the model side
  (the optimizer state is keyed by parameter name, see ``load_full_state``).

Failure: collectives time out after ``timeout_s``; a failed collective is re-raised as
``PeerFailureError`` naming this rank, the step and the last checkpoint (``collective_guard``).

End of a rank (``end_process``): a gloo process group keeps its worker threads until its C++ object is
destroyed, and in quads' runs it outlives ``destroy_process_group`` (its threads were still running after
destroy and ``gc.collect()``, with the trainer freed and no Python container holding the group). After ``wait()`` returns, the
worker thread still drops its reference to the collective's tensors; when the last reference to a
tensor with Python state (a DTensor, an ``nn.Parameter``, a tensor with an attribute) goes there, PyTorch
takes the GIL on that thread, and if the main thread is already finalizing the interpreter, CPython ends
the thread with a forced unwind that hits a ``noexcept`` frame: ``terminate called without an active
exception``, SIGABRT (pytorch/pytorch#190489, #117762). It hit 2 of 30 two-rank runs of
``tests/test_distributed.py`` on a loaded 2-core machine; ``scripts/gloo_exit_abort.py`` shows it without
quads. So a
finished rank runs its exit handlers (``shutdown`` included) and flushes its output while the interpreter
is alive, then leaves with ``os._exit``, skipping the finalization the abort needs.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist
from torch import nn

T = TypeVar("T")
DEFAULT_TIMEOUT_S = 600.0  # collective timeout; a dead peer turns into an error after this long


class PeerFailureError(RuntimeError):
    """A collective failed or timed out: another rank most likely died."""


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits. ``world == 1``: not distributed (every helper is a no-op)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: str = "cpu"  # this rank's device ("cuda:<local_rank>" under NCCL)
    backend: str | None = None  # "gloo" | "nccl" | None

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init(device: str = "cpu", timeout_s: float | None = None) -> DistInfo:
    """Join the process group that ``torchrun`` describes (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR``/``MASTER_PORT``); gloo for CPU, NCCL for CUDA with the device from ``LOCAL_RANK``.

    Returns ``DistInfo(device=device)`` when ``WORLD_SIZE`` is unset or 1. Idempotent.
    ``timeout_s`` (``TrainConfig.dist_timeout_s``; default ``DEFAULT_TIMEOUT_S``) bounds every collective.
    """
    world = env_world_size()
    if world <= 1:
        return DistInfo(device=device)
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available() or local >= torch.cuda.device_count():
            raise ValueError(f"rank {rank}: device={device!r} with LOCAL_RANK={local}, but this node has "
                             f"{torch.cuda.device_count()} CUDA devices; pass --nproc-per-node <= that")
        if dev.index is not None and dev.index != local:
            raise ValueError(f"device={device!r} names one GPU, but under torchrun each rank uses the GPU of its "
                             f"LOCAL_RANK ({local}); pass --device cuda")
        torch.cuda.set_device(local)
        backend, device = "nccl", f"cuda:{local}"
    elif dev.type == "cpu":
        backend = "gloo"
    else:
        raise ValueError(f"distributed training supports cpu (gloo) and cuda (NCCL); got device={device!r}")
    if not dist.is_initialized():
        t = timeout_s if timeout_s is not None else DEFAULT_TIMEOUT_S
        kwargs: dict[str, Any] = {"timeout": datetime.timedelta(seconds=t)}
        if backend == "nccl":
            kwargs["device_id"] = torch.device(device)
        dist.init_process_group(backend, **kwargs)
        atexit.register(shutdown)
    return DistInfo(rank, world, local, device, backend)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def end_process(code: int) -> NoReturn:
    """End this rank with exit status ``code``: the exit handlers (``shutdown`` included), then the
    output flushed, then ``os._exit``, without interpreter finalization (module docstring: a gloo worker
    thread that takes the GIL during finalization aborts the process). Call it last, with every file
    closed, in a process that joined a process group."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


@contextlib.contextmanager
def rank0_first(info: DistInfo) -> Iterator[None]:
    """Rank 0 runs the block first (e.g. a cached warm start it writes), the others after it."""
    if info.enabled and not info.is_main:
        dist.barrier()
    yield
    if info.enabled and info.is_main:
        dist.barrier()


@contextlib.contextmanager
def collective_guard(info: DistInfo, what: str, checkpoint: str | None = None) -> Iterator[None]:
    """Turn a failed or timed-out collective into ``PeerFailureError`` naming rank and step."""
    try:
        yield
    except (dist.DistError, RuntimeError) as e:
        if not info.enabled or isinstance(e, PeerFailureError) or not _looks_distributed(e):
            raise
        resume = (f"resume from the last checkpoint ({checkpoint}) with --resume true" if checkpoint
                  else "no checkpoint was written yet; restart the run")
        raise PeerFailureError(
            f"rank {info.rank}/{info.world}: a collective failed during {what}: {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}. Another rank most likely died or hung (see its log "
            f"and torchrun's summary above); {resume}") from e


def _looks_distributed(e: BaseException) -> bool:
    if isinstance(e, dist.DistError):
        return True
    text = str(e).lower()
    return any(s in text for s in ("gloo", "nccl", "connection", "timed out", "timeout", "peer", "socket"))


# --------------------------------------------------------------------------- sharding


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one: the ``layers`` ModuleList of the model."""
    for name, m in model.named_modules():
        if name.endswith("layers") and isinstance(m, nn.ModuleList) and len(m):
            return list(m)
    raise ValueError(f"{type(model).__name__} has no 'layers' ModuleList to shard per decoder layer; "
                     "FSDP2 wrapping expects the Hugging Face layout model.layers.{i}")


def shard_model(model: nn.Module, info: DistInfo) -> nn.Module:
    """FSDP2: ``fully_shard`` every decoder layer, then the root (embeddings, final norm, lm_head).

    Parameters become ``DTensor`` shards (dim 0 over ranks); each layer is all-gathered just before
    its forward and freed after it (``reshard_after_forward``), gradients are reduce-scattered and
    averaged over ranks. No mixed-precision policy: the unsharded parameters keep the master dtype
    (the quantized layers' QDQ reads them as the single-process trainer does; ``build.autocast``
    sets the compute dtype). Quantized modules (``quads.quant``) look their parameter up by name at
    each use, so they see the unsharded parameter inside forward.
    """
    if not info.enabled:
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(torch.device(info.device).type, (info.world,))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def invalidate_qat_cache(model: nn.Module) -> int:
    """Drop the trainer's cached ``QDQ(W)`` of every quantized module; returns stores dropped.

    Needed under FSDP2: the cache key is the parameter's version counter and data pointer, but FSDP2
    all-gathers into the *same* unsharded parameter under ``_unsafe_preserve_version_counter``, so an
    optimizer step on the shards changes neither; the cached QDQ would go stale.
    """
    from quads.quant.apply import quantized_modules

    n = 0
    for m in quantized_modules(model).values():
        for store in m.stores.values():
            store.w_q, store.packed, store.key = None, None, None
            n += 1
    return n


def invalidate_qat_cache_on_step(opt: torch.optim.Optimizer, model: nn.Module):
    """Register ``invalidate_qat_cache(model)`` after every ``opt.step()``; returns the hook handle."""
    return opt.register_step_post_hook(lambda *_: invalidate_qat_cache(model))


# --------------------------------------------------------------------------- data split and reductions


def split_groups(items: Sequence[T], info: DistInfo) -> list[T]:
    """This rank's contiguous slice of ``items`` (one per prompt group, the same list on every rank)."""
    n = len(items)
    if n % info.world:
        raise ValueError(f"{n} prompts per step do not split evenly over {info.world} ranks; set "
                         f"rollout.prompts_per_step to a multiple of the number of processes")
    k = n // info.world
    return list(items[info.rank * k:(info.rank + 1) * k])


def all_reduce(x: float | torch.Tensor, info: DistInfo, op: str = "sum") -> float:
    """Sum / max / min of a scalar over ranks (a float64 tensor on this rank's device)."""
    v = float(x)
    if not info.enabled:
        return v
    t = torch.tensor([v], dtype=torch.float64, device=info.device)
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
    return float(t.item())


def gather_rows(t: torch.Tensor, info: DistInfo, *, batch_dim: int = 0, pad_dim: int | None = 1,
                pad_value: float = 0) -> torch.Tensor:
    """Concatenate every rank's rows (rank order = global sample order) along ``batch_dim``.

    ``pad_dim`` (e.g. the response block R, whose width is each rank's longest response) is
    right-padded with ``pad_value`` to the longest over ranks first; pad where the mask is 0 so the
    padding changes no masked metric. Local row counts must be equal (``split_groups`` ensures it).
    Bool tensors travel as uint8.
    """
    if not info.enabled:
        return t
    was_bool = t.dtype == torch.bool
    x = t.to(torch.uint8) if was_bool else t
    x = x.to(info.device).contiguous()
    if pad_dim is not None:
        width = int(all_reduce(x.shape[pad_dim], info, "max"))
        if width > x.shape[pad_dim]:
            pad_shape = list(x.shape)
            pad_shape[pad_dim] = width - x.shape[pad_dim]
            x = torch.cat([x, x.new_full(pad_shape, pad_value)], dim=pad_dim)
    parts = [torch.empty_like(x) for _ in range(info.world)]
    dist.all_gather(parts, x)
    out = torch.cat(parts, dim=batch_dim).to(t.device)
    return out.bool() if was_bool else out


def loss_denom(loss_mask: torch.Tensor, agg: str, info: DistInfo) -> float | None:
    """``denom`` for ``grpo_loss`` so FSDP2's gradient average equals the single-process gradient.

    token_mean: ``N_global / W`` (the local loss is ``W * sum_local / N_global``; the average over
    ranks is then ``sum_all / N_global``). seq_mean: None (local sequences = global / W already).
    """
    if not info.enabled or agg != "token_mean":
        return None
    return all_reduce(loss_mask.sum(), info) / info.world


# keys of grpo_loss's metrics that are plain means over ranks (``loss_denom`` makes them exact);
# the other ``loss/*`` means are token means, weighted by ``loss/tokens``
_RANK_MEAN = ("loss/total", "loss/policy", "loss/aux", "optim/")


def reduce_loss_metrics(m: dict[str, float], info: DistInfo) -> dict[str, float]:
    """Global values of one mini-batch's loss metrics: token-weighted means, summed ``loss/tokens``."""
    if not info.enabled:
        return m
    keys = sorted(m)
    n = float(m.get("loss/tokens", 0.0))
    vals = [m[k] if k.startswith(_RANK_MEAN) or k == "loss/tokens" else m[k] * n for k in keys]
    t = torch.tensor(vals + [n], dtype=torch.float64, device=info.device)
    dist.all_reduce(t)
    total_n = max(float(t[-1]), 1.0)
    out = {}
    for i, k in enumerate(keys):
        v = float(t[i])
        out[k] = v if k == "loss/tokens" else v / info.world if k.startswith(_RANK_MEAN) else v / total_n
    return out


def reduce_timings(m: dict[str, float], info: DistInfo) -> dict[str, float]:
    """``time/*``: the slowest rank (it sets the step time); ``perf/max_*`` (peak memory): the largest rank's;
    the other ``perf/*``: summed (aggregate throughput)."""
    if not info.enabled:
        return m
    keys = sorted(k for k in m if k.startswith(("time/", "perf/")))
    out = dict(m)
    for k in keys:
        out[k] = all_reduce(m[k], info, "max" if k.startswith(("time/", "perf/max_")) else "sum")
    return out


def full_tensor(x: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (e.g. ``clip_grad_norm_`` under FSDP2); any other tensor as it is."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x


# --------------------------------------------------------------------------- weight sync


class ShardedWeights:
    """The weight-sync source (``quads.quant.sync.WeightSource``) of an FSDP2 trainer, one full rollout
    replica per rank.

    ``tensors`` all-gathers one state-dict tensor at a time (``DTensor.full_tensor``; the same order on
    every rank); a gathered tensor is the unsharded parameter bit for bit, so its reference operand is
    the QDQ function the trainer's QAT applies to it. ``reduce_statistics`` sums the replicas' static
    RAC statistics, so every replica sorts the same order; ``agree`` compares every rank's rollout
    fingerprints with rank 0's and counts mismatches over all ranks, so all ranks raise together.
    """

    def __init__(self, model: nn.Module, info: DistInfo) -> None:
        from quads.quant.apply import quantized_modules

        self.model, self.info = model, info
        self._quantized = quantized_modules(model)

    def tensors(self):
        for k, v in self.model.state_dict().items():
            yield k, (v.full_tensor() if hasattr(v, "full_tensor") else v)

    def module(self, name: str) -> nn.Module | None:
        return self._quantized.get(name)

    @torch.no_grad()
    def reduce_statistics(self, rollout_model: nn.Module) -> None:
        from quads.quant.rac import StaticChannelSelector

        for m in rollout_model.modules():
            if isinstance(m, StaticChannelSelector):
                for buf in (m.sq_sum, m.count):
                    dist.all_reduce(buf)

    def agree(self, fingerprints: dict) -> list[str]:
        info = self.info
        mine = torch.tensor([[f.total, f.weighted] for f in fingerprints.values()], dtype=torch.int64,
                            device=info.device).reshape(-1, 2)
        ref = mine.clone()
        dist.broadcast(ref, src=0)
        bad = [f"{k} (rank {info.rank} vs rank 0)" for k, b in zip(fingerprints, (mine != ref).any(dim=1).tolist())
               if b]
        n_bad = all_reduce(len(bad), info)
        if n_bad and not bad:
            bad.append(f"{int(n_bad)} mismatches on other ranks")
        return bad


def trainer_weights(model: nn.Module, info: DistInfo):
    """The weight-sync source of the trainer: ``ShardedWeights`` under torchrun, else ``LocalWeights``."""
    from quads.quant.sync import LocalWeights

    return ShardedWeights(model, info) if info.enabled else LocalWeights(model)


# --------------------------------------------------------------------------- checkpoints


def full_model_state(model: nn.Module, info: DistInfo) -> dict[str, torch.Tensor]:
    """The unsharded model state dict on CPU, on rank 0 (empty elsewhere). Collective."""
    if not info.enabled:
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def full_optimizer_state(model: nn.Module, opt: torch.optim.Optimizer, info: DistInfo) -> dict[str, Any]:
    """The unsharded optimizer state (keyed by parameter name) on rank 0. Collective."""
    if not info.enabled:
        return opt.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _names_to_fqn_keys(osd: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """A plain ``opt.state_dict()`` (ids 0..n-1 over the trainable parameters) keyed by name instead."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    if not osd.get("state") or not all(isinstance(k, int) for k in osd["state"]):
        return osd
    return {"state": {names[i]: v for i, v in osd["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in osd["param_groups"]]}


def load_full_state(model: nn.Module, opt: torch.optim.Optimizer, model_state: dict[str, torch.Tensor],
                    optim_state: dict[str, Any], info: DistInfo) -> None:
    """Load a full (unsharded) checkpoint into the sharded model and optimizer; every rank passes the
    same dicts (each reads the checkpoint file). Single-process checkpoints load too."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_state, options=opts)
    set_optimizer_state_dict(model, opt, _names_to_fqn_keys(optim_state, model), options=opts)
    invalidate_qat_cache(model)


# --------------------------------------------------------------------------- split-independent rollouts


def concat_rollouts(parts: list, pad_id: int):
    """Join ``RolloutBatch``es of different prompt widths: left-pad each prompt block to the widest,
    right-pad each response block to the longest (pad_id / mask False / log-prob 0 / routing -1)."""
    from quads.rollout import RolloutBatch, RolloutStats

    P = max(p.prompt_len for p in parts)
    R = max(p.response_mask.shape[1] for p in parts)

    def pad(x: torch.Tensor, p: int, r: int, value: float, dim: int) -> torch.Tensor:
        shape_l, shape_r = list(x.shape), list(x.shape)
        shape_l[dim], shape_r[dim] = P - p, R - r
        return torch.cat([x.new_full(shape_l, value), x, x.new_full(shape_r, value)], dim=dim)

    ids, mask, logp, routing = [], [], [], []
    for b in parts:
        p, r = b.prompt_len, b.response_mask.shape[1]
        ids.append(pad(b.input_ids, p, r, pad_id, 1))
        mask.append(pad(b.attention_mask, p, r, False, 1))
        logp.append(torch.cat([b.logprobs, b.logprobs.new_zeros(b.logprobs.shape[0], R - r)], dim=1))
        if b.routing is not None:
            routing.append(pad(b.routing, p, r, -1, 2))
    attn = torch.cat(mask)
    offsets = torch.tensor([0] + [int(b.group_index.max()) + 1 for b in parts[:-1]]).cumsum(0)
    stats = RolloutStats.combine([b.stats for b in parts])
    return RolloutBatch(
        input_ids=torch.cat(ids), attention_mask=attn, prompt_len=P, response_mask=attn[:, P:],
        logprobs=torch.cat(logp), routing=torch.cat(routing, dim=1) if routing else None,
        finish_reasons=[f for b in parts for f in b.finish_reasons],
        group_index=torch.cat([b.group_index + o for b, o in zip(parts, offsets.tolist())]),
        prompt_ids=[x for b in parts for x in b.prompt_ids], response_ids=[x for b in parts for x in b.response_ids],
        texts=[x for b in parts for x in b.texts], stats=stats, recipe=parts[0].recipe)


class GroupSeededEngine:
    """Wraps a ``RolloutEngine`` so a step's samples do not depend on how prompts are split over ranks.

    The plain engine draws every sample of a batch from one generator, and W4A4 activation scales
    can span the batch, so rank ``r``'s half of a batch is not the rows ``r`` of the single-process
    batch. Here each prompt group is generated by its own call, seeded by ``params.seed`` and the
    prompt's *global* index (``rank * prompts_per_rank + i``), so a W-process run samples exactly
    the single-process batch. One engine call per prompt: for reproducibility checks (the
    equivalence test), not for speed.
    """

    def __init__(self, engine, info: DistInfo, pad_id: int) -> None:
        self.engine, self.info, self.pad_id = engine, info, pad_id

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def generate(self, prompts, params):
        import dataclasses

        first = self.info.rank * len(prompts)
        parts = [self.engine.generate([p], dataclasses.replace(
            params, seed=None if params.seed is None else params.seed + 7919 * (first + i + 1)))
            for i, p in enumerate(prompts)]
        return concat_rollouts(parts, self.pad_id)


def broadcast_object(obj: T, info: DistInfo) -> T:
    """Rank 0's ``obj`` on every rank (pickled; for small things such as a run folder name)."""
    if not info.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def check_config(cfg, info: DistInfo) -> None:
    """Refuse configs that cannot split over ``info.world`` ranks, with the fix in the message."""
    if not info.enabled:
        return
    r, o = cfg.rollout, cfg.optim
    if r.prompts_per_step % info.world:
        raise ValueError(f"rollout.prompts_per_step={r.prompts_per_step} must be a multiple of the {info.world} "
                         "processes (each rank rolls out whole prompt groups)")
    local = r.prompts_per_step // info.world * r.n_samples
    if local % o.mini_batches:
        raise ValueError(f"optim.mini_batches={o.mini_batches} must divide each rank's batch "
                         f"(prompts_per_step / {info.world} * n_samples = {local})")
    from quads.rollout.backend import check_backend

    check_backend(getattr(cfg, "rollout_backend", "quads"), info.world)
