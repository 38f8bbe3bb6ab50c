"""Weight sync trainer -> rollout engine, with a bit-exactness check (DESIGN.md section 4).

``sync_weights(trainer_model, rollout_model)``:
1. copies every parameter and buffer of the trainer's state dict into the rollout model's own
   tensors (they are separate instances; values are cast to the rollout tensor's dtype);
2. the rollout side re-quantizes each quantized module with the same function the trainer's QAT
   uses (``ops.quantize_weight``: master weight cast to the recipe's ``weight_dtype``, then QDQ) and
   refreshes its static RAC channel orders from the statistics gathered since the last sync;
3. fingerprints the rollout's dequantized weights and compares them with the trainer's: the trainer's
   cached ``QDQ(W)`` when it quantizes that weight with the same spec, else the rollout spec's
   function applied to the trainer's master weight. Any difference raises ``WeightSyncError``.

Fingerprint: the tensor's bytes viewed as integers (int16 for 2-byte dtypes, int32 for 4-byte ones,
...), widened to int64, then two sums: the plain sum, and a position-weighted sum
``sum(v_i * (i mod 1_000_003 + 1))``. Changing any one element by any bit changes the plain sum (the
difference of two distinct integers is nonzero, and int64 wrap-around cannot cancel it); the weighted
sum also catches permutations. Together with shape and dtype this is cheap (one pass) and exact.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from quads.quant import ops
from quads.quant.apply import quantized_modules
from quads.quant.layers import _QuantizedBase

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_PRIME = 1_000_003


class WeightSyncError(RuntimeError):
    """The rollout engine's quantized weights differ from the trainer's: refuse to roll out."""


@dataclass(frozen=True)
class Fingerprint:
    shape: tuple[int, ...]
    dtype: str
    total: int  # sum of the integer view
    weighted: int  # position-weighted sum of the integer view


def fingerprint(t: torch.Tensor) -> Fingerprint:
    """Exact fingerprint of ``t``'s bytes (see the module docstring)."""
    flat = t.detach().contiguous().reshape(-1)
    v = flat.view(_INT_VIEW[flat.element_size()]).to(torch.int64)
    pos = torch.arange(v.numel(), device=v.device, dtype=torch.int64) % _PRIME + 1
    return Fingerprint(tuple(t.shape), str(t.dtype), int(v.sum()), int((v * pos).sum()))


@dataclass
class SyncReport:
    """What one sync did. ``mismatches`` is empty after a successful sync."""

    n_tensors: int = 0  # state-dict tensors copied
    n_bytes: int = 0  # bytes copied
    n_checked: int = 0  # quantized weights fingerprinted
    n_static_refreshed: int = 0  # quantized modules whose static RAC orders were refreshed
    seconds: float = 0.0
    fingerprints: dict[str, Fingerprint] = field(default_factory=dict)  # rollout weight operands
    mismatches: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches


def trainer_operand(
    master: torch.Tensor, trainer_module: nn.Module | None, rollout_module: _QuantizedBase, pname: str
) -> torch.Tensor:
    """What the rollout operand ``rollout_module.<pname>`` must equal, given the trainer's master weight.

    Unquantized weights: the master cast to the rollout parameter's dtype (what the copy produces).
    Quantized: the trainer module's cached ``QDQ(W)`` when it quantizes with the same weight spec and
    dtype, else the rollout spec's ``ops.quantize_weight`` of the master. (Distributed sync, which
    gathers ``master`` itself, should call this too.)
    """
    spec = rollout_module.spec
    if spec.weight == "none":
        return master.detach().to(getattr(rollout_module, pname).dtype)
    tm = trainer_module
    if (
        isinstance(tm, _QuantizedBase)
        and tm.spec.weight_key() == spec.weight_key()
        and tm.weight_dtype == rollout_module.weight_dtype
        and getattr(tm, pname) is master
    ):
        return tm.stores[pname].get()  # the trainer's cached QDQ(W)
    return ops.quantize_weight(master, spec, rollout_module.weight_dtype)[0]


def _reference_operand(trainer_model: nn.Module, name: str, pname: str, module: _QuantizedBase) -> torch.Tensor:
    """The trainer's version of the rollout operand ``name.pname``."""
    tm = dict(trainer_model.named_modules()).get(name)
    return trainer_operand(trainer_model.get_parameter(f"{name}.{pname}"), tm, module, pname)


def verify_sync(
    trainer_model: nn.Module, rollout_model: nn.Module, *, raise_on_mismatch: bool = True
) -> SyncReport:
    """Compare the rollout's weight operands with the trainer's, bit for bit, via fingerprints."""
    report = SyncReport()
    rq = quantized_modules(rollout_model)
    if not rq:
        raise ValueError(
            "verify_sync: the rollout model has no quantized modules; call quantize_model(..., side='rollout')"
        )
    for name, module in rq.items():
        for pname, (_, operand) in module.weight_operands().items():
            key = f"{name}.{pname}"
            fp = fingerprint(operand)
            report.fingerprints[key] = fp
            report.n_checked += 1
            if fingerprint(_reference_operand(trainer_model, name, pname, module)) != fp:
                report.mismatches.append(key)
    if report.mismatches and raise_on_mismatch:
        raise WeightSyncError(
            f"rollout weights differ from the trainer's QDQ(W) in {len(report.mismatches)} tensors "
            f"(first: {report.mismatches[:3]}); check that both sides use the same recipe and weight_dtype "
            "and that nothing wrote to the rollout weights; the engine must not roll out with these weights"
        )
    return report


@torch.no_grad()
def copy_weights(trainer_model: nn.Module, rollout_model: nn.Module) -> tuple[int, int]:
    """Copy the trainer's state dict into the rollout model's tensors; returns (tensors, bytes)."""
    src = trainer_model.state_dict()
    dst = rollout_model.state_dict(keep_vars=True)
    missing = sorted(set(src) ^ set(dst))
    if missing:
        raise ValueError(
            f"trainer and rollout models differ in state-dict keys {missing[:5]} ({len(missing)} in all); "
            "they must be two instances of the same architecture"
        )
    n_bytes = 0
    for k, v in src.items():
        d = dst[k]
        if d.shape != v.shape:
            raise ValueError(
                f"sync: {k} has shape {tuple(v.shape)} on the trainer but {tuple(d.shape)} on the rollout"
            )
        d.copy_(v)
        n_bytes += v.numel() * v.element_size()
    return len(src), n_bytes


def sync_weights(trainer_model: nn.Module, rollout_model: nn.Module) -> SyncReport:
    """Copy master weights, re-quantize on the rollout side, verify bit-exactness (module docstring)."""
    t0 = time.perf_counter()
    n_tensors, n_bytes = copy_weights(trainer_model, rollout_model)
    rq = quantized_modules(rollout_model)
    for m in rq.values():
        m.refresh()
    report = verify_sync(trainer_model, rollout_model)
    report.n_tensors, report.n_bytes = n_tensors, n_bytes
    report.n_static_refreshed = sum(1 for m in rq.values() if len(m.selectors))
    report.seconds = time.perf_counter() - t0
    return report
