"""Weight sync trainer -> rollout backend, with a bit-exactness check (DESIGN.md section 4).

One component, ``WeightSync(source, target).run()``, does every sync of the project:

1. the *source* yields the trainer's state-dict tensors, full, one at a time, in state-dict order
   (``LocalWeights``: a model in this process; ``quads.rl.distributed.ShardedWeights``: an FSDP2 model,
   each tensor all-gathered with ``DTensor.full_tensor``). For every tensor that feeds a rollout weight
   operand, the fingerprint of the operand it must become is taken then (``reference_operand``: the
   trainer's cached ``QDQ(W)`` when it quantizes that weight with the same spec and dtype, else the
   rollout spec's ``ops.quantize_weight`` of the master; an unquantized operand is the master in the
   rollout's dtype);
2. the *target* receives the tensors and, at ``commit``, re-quantizes with the same function the
   trainer's QAT uses (``ReplicaTarget``: a quads rollout model in this process, which also refreshes
   its static RAC channel orders; the vLLM backend's target pushes into vLLM's worker,
   ``quads.rollout.vllm.engine``);
3. the target fingerprints its operands and compares them with step 1's (``verify``); the source then
   compares them across processes (``agree``). Any difference raises ``WeightSyncError``. The
   ``SyncReport`` carries the counts and the seconds the whole sync took.

``sync_weights(trainer_model, rollout_model)`` is that component for two models in one process.

Fingerprint: the tensor's bytes viewed as integers (int16 for 2-byte dtypes, int32 for 4-byte ones,
...), widened to int64, then two sums: the plain sum, and a position-weighted sum
``sum(v_i * (i mod 1_000_003 + 1))``, both modulo 2**64 (int64 wrap-around). Changing any one element by
any bit changes the plain sum (the difference of two distinct integers is nonzero, and wrap-around cannot
cancel it); the weighted sum also catches permutations. Together with shape and dtype this is cheap (one
pass) and exact. How it is computed (``FingerprintBatch``): the elements are read as rows of P =
1_000_003 (the last one short) and summed per column in int64, a few rows at a time (``FINGERPRINT_CHUNK``:
int64 temporaries of at most ~32 MiB, not 8 bytes per element of the tensor), ``S_r = sum_q v_{qP+r}``;
then ``total = sum_r S_r`` and ``weighted = sum_r (r + 1) * S_r``: the same two sums modulo 2**64 (a ring:
the regrouping is exact). The two sums of every tensor stay on its device until ``result()``, which reads
all of them back in one transfer per device: a sync checks all its operands with two host syncs (the
references', then the rollout's), where a read-back per tensor waits for the device queue each time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from quads.quant import ops
from quads.quant.apply import quantized_modules
from quads.quant.layers import _QuantizedBase
from quads.quant.recipe import LinearSpec

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_PRIME = 1_000_003
# elements widened to int64 at a time when fingerprinting (4 rows of _PRIME: ~32 MiB of int64)
FINGERPRINT_CHUNK = 4 * _PRIME
_POSITIONS: dict[torch.device, torch.Tensor] = {}  # device -> int64 [1, ..., _PRIME], the column weights


class WeightSyncError(RuntimeError):
    """The rollout engine's quantized weights differ from the trainer's: refuse to roll out."""


@dataclass(frozen=True)
class Fingerprint:
    shape: tuple[int, ...]
    dtype: str
    total: int  # sum of the integer view
    weighted: int  # position-weighted sum of the integer view


def fingerprint_reference(t: torch.Tensor) -> Fingerprint:
    """The fingerprint of ``t`` by the definition (module docstring): one int64 pass over the whole
    tensor, two host syncs. ``FingerprintBatch`` computes the same numbers (tests compare them)."""
    flat = t.detach().contiguous().reshape(-1)
    v = flat.view(_INT_VIEW[flat.element_size()]).to(torch.int64)
    pos = torch.arange(v.numel(), device=v.device, dtype=torch.int64) % _PRIME + 1
    return Fingerprint(tuple(t.shape), str(t.dtype), int(v.sum()), int((v * pos).sum()))


def _positions(device: torch.device) -> torch.Tensor:
    pos = _POSITIONS.get(device)
    if pos is None:
        pos = _POSITIONS[device] = torch.arange(1, _PRIME + 1, dtype=torch.int64, device=device)
    return pos


def fingerprint_sums(t: torch.Tensor) -> torch.Tensor:
    """int64 ``[2]`` on ``t``'s device: ``(total, weighted)`` of ``t`` (module docstring), no host sync."""
    flat = t.detach().contiguous().reshape(-1)
    v = flat.view(_INT_VIEW[flat.element_size()])
    n, p = v.numel(), _PRIME
    if n == 0:
        return torch.zeros(2, dtype=torch.int64, device=v.device)
    rows = n // p  # full rows of P elements; the rest is the short last row
    if rows == 0:
        cols = v.to(torch.int64)  # [n]: S_r = v_r
    else:
        full = v[: rows * p].view(rows, p)
        step = max(1, FINGERPRINT_CHUNK // p)
        cols = full[:step].sum(dim=0, dtype=torch.int64)  # [P]
        for r in range(step, rows, step):
            cols += full[r : r + step].sum(dim=0, dtype=torch.int64)
        if n > rows * p:
            cols[: n - rows * p] += v[rows * p :]
    pos = _positions(v.device)[: cols.numel()]
    return torch.stack([cols.sum(), (cols * pos).sum()])


class FingerprintBatch:
    """Fingerprints of many tensors, computed on their devices as they are added (``add``: no host sync,
    only two int64 numbers kept per tensor, so the tensor may be freed after), read back by ``result``
    in one transfer per device."""

    def __init__(self) -> None:
        self._meta: dict[str, tuple[tuple[int, ...], str]] = {}
        self._sums: dict[str, torch.Tensor] = {}

    def add(self, name: str, t: torch.Tensor) -> None:
        self._meta[name] = (tuple(t.shape), str(t.dtype))
        self._sums[name] = fingerprint_sums(t)

    def result(self) -> dict[str, Fingerprint]:
        by_device: dict[torch.device, list[str]] = {}
        for name, s in self._sums.items():
            by_device.setdefault(s.device, []).append(name)
        out: dict[str, Fingerprint] = {}
        for names in by_device.values():
            values = torch.stack([self._sums[n] for n in names]).tolist()  # the one host sync of the device
            for name, (total, weighted) in zip(names, values, strict=True):
                out[name] = Fingerprint(*self._meta[name], total, weighted)
        return {name: out[name] for name in self._sums}  # in the order added


def fingerprints(tensors: dict[str, torch.Tensor]) -> dict[str, Fingerprint]:
    """``{name: fingerprint(t)}`` with one host sync per device (``FingerprintBatch``)."""
    batch = FingerprintBatch()
    for name, t in tensors.items():
        batch.add(name, t)
    return batch.result()


def fingerprint(t: torch.Tensor) -> Fingerprint:
    """Exact fingerprint of ``t``'s bytes (see the module docstring)."""
    return fingerprints({"": t})[""]


def mismatching(got: dict[str, Fingerprint], want: dict[str, Fingerprint]) -> list[str]:
    """Names whose fingerprints differ, sorted; a name present on one side only counts as a mismatch."""
    return sorted(n for n in set(got) | set(want) if got.get(n) != want.get(n))


@dataclass
class SyncReport:
    """What one sync did. ``mismatches`` is empty after a successful sync."""

    n_tensors: int = 0  # state-dict tensors sent
    n_bytes: int = 0  # bytes sent
    n_checked: int = 0  # rollout weight operands fingerprinted
    n_static_refreshed: int = 0  # quantized modules whose static RAC orders were refreshed
    seconds: float = 0.0
    fingerprints: dict[str, Fingerprint] = field(default_factory=dict)  # rollout weight operands
    mismatches: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches


@dataclass(frozen=True)
class OperandSpec:
    """How the rollout side derives one weight operand from its master weight."""

    spec: LinearSpec  # the rollout LinearSpec
    weight_dtype: torch.dtype  # what the master is cast to before QDQ
    plain_dtype: torch.dtype  # the operand's dtype when the spec leaves the weight unquantized


def reference_operand(master: torch.Tensor, trainer_module: nn.Module | None, pname: str, op: OperandSpec
                      ) -> torch.Tensor:
    """What the rollout operand of ``master`` (``<module>.<pname>``) must equal, bit for bit.

    Unquantized weights: the master cast to ``op.plain_dtype`` (what the copy produces). Quantized: the
    trainer module's cached ``QDQ(W)`` when ``master`` is that module's parameter and it quantizes with
    the same weight spec and dtype, else the rollout spec's ``ops.quantize_weight(master)[0]``, computed as
    the trainer's QAT computes it (``ops.qat_weights``: the same bits, on a Triton device two launches and
    no codes, by other kernels than the rollout's quantize, pack and decode).
    """
    if op.spec.weight == "none":
        return master.detach().to(op.plain_dtype)
    tm = trainer_module
    if (
        isinstance(tm, _QuantizedBase)
        and tm.spec.weight_key() == op.spec.weight_key()
        and tm.weight_dtype == op.weight_dtype
        and getattr(tm, pname) is master
    ):
        return tm.stores[pname].get()  # the trainer's cached QDQ(W)
    return ops.qat_weights([master], op.spec, op.weight_dtype)[0]


def reference_fingerprints(trainer_model: nn.Module, operands: dict[str, OperandSpec]) -> dict[str, Fingerprint]:
    """Fingerprints of ``reference_operand`` for ``operands``, from a trainer model in this process (the
    check of a target's current weights without a sync)."""
    params, modules = dict(trainer_model.named_parameters()), dict(trainer_model.named_modules())
    batch = FingerprintBatch()
    for key, op in operands.items():
        mod, _, pname = key.rpartition(".")
        batch.add(key, reference_operand(params[key], modules.get(mod), pname, op))
    return batch.result()


# --------------------------------------------------------------------------- sources


class WeightSource(Protocol):
    """The trainer's side of a sync (see the module docstring)."""

    model: nn.Module

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(state-dict key, full tensor)`` in state-dict order, one at a time."""
        ...

    def module(self, name: str) -> nn.Module | None:
        """The trainer's module ``name`` (for its cached ``QDQ(W)``), or None."""
        ...

    def reduce_statistics(self, rollout_model: nn.Module) -> None:
        """Combine the rollout replicas' static RAC statistics before they re-sort (one process: nothing)."""
        ...

    def agree(self, fingerprints: dict[str, Fingerprint]) -> list[str]:
        """Mismatches of this process's rollout fingerprints with the other processes' (one process: none)."""
        ...


class LocalWeights:
    """A trainer model in this process: its parameters and buffers as they are."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._modules = dict(model.named_modules())

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.model.state_dict(keep_vars=True).items()  # the parameters themselves: cached QDQ applies

    def module(self, name: str) -> nn.Module | None:
        return self._modules.get(name)

    def reduce_statistics(self, rollout_model: nn.Module) -> None:
        pass

    def agree(self, fingerprints: dict[str, Fingerprint]) -> list[str]:
        return []


# --------------------------------------------------------------------------- targets


class SyncTarget(Protocol):
    """The rollout side of a sync."""

    def operands(self) -> dict[str, OperandSpec]:
        """``{state-dict key of a master weight: how its rollout operand is derived}``."""
        ...

    def check_keys(self, keys: set[str]) -> None:
        """Refuse a trainer whose state-dict keys this target cannot take (one clear error)."""
        ...

    def receive(self, name: str, tensor: torch.Tensor) -> None:
        """Take one full state-dict tensor (``tensor`` may be freed after the call)."""
        ...

    def commit(self, source: WeightSource) -> int:
        """Make the received weights the rollout weights and re-quantize; returns static RAC refreshes."""
        ...

    def verify(self, want: dict[str, Fingerprint]) -> tuple[dict[str, Fingerprint], list[str]]:
        """Fingerprint the rollout operands, compare with ``want``; ``(fingerprints, mismatching names)``."""
        ...


class ReplicaTarget:
    """A quads rollout model in this process (its quantized modules built with ``side='rollout'``)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.quantized = quantized_modules(model)
        self._dst = model.state_dict(keep_vars=True)

    def operands(self) -> dict[str, OperandSpec]:
        if not self.quantized:
            raise ValueError(
                "weight sync: the rollout model has no quantized modules; call quantize_model(..., side='rollout')"
            )
        return {f"{name}.{pname}": OperandSpec(m.spec, m.weight_dtype, getattr(m, pname).dtype)
                for name, m in self.quantized.items() for pname in m.stores}

    def check_keys(self, keys: set[str]) -> None:
        missing = sorted(keys ^ set(self._dst))
        if missing:
            raise ValueError(
                f"trainer and rollout models differ in state-dict keys {missing[:5]} ({len(missing)} in all); "
                "they must be two instances of the same architecture"
            )

    @torch.no_grad()
    def receive(self, name: str, tensor: torch.Tensor) -> None:
        d = self._dst[name]
        if d.shape != tensor.shape:
            raise ValueError(
                f"sync: {name} has shape {tuple(tensor.shape)} on the trainer but {tuple(d.shape)} on the rollout"
            )
        d.copy_(tensor)

    def commit(self, source: WeightSource) -> int:
        source.reduce_statistics(self.model)
        for m in self.quantized.values():
            m.refresh()
        return sum(1 for m in self.quantized.values() if len(m.selectors))

    def verify(self, want: dict[str, Fingerprint]) -> tuple[dict[str, Fingerprint], list[str]]:
        batch = FingerprintBatch()
        for name, m in self.quantized.items():
            for pname, store in m.stores.items():
                batch.add(f"{name}.{pname}", store.get())  # one operand alive at a time
        got = batch.result()
        return got, mismatching(got, want)


# --------------------------------------------------------------------------- the component


class WeightSync:
    """Sync + verify from one ``WeightSource`` into one ``SyncTarget`` (module docstring)."""

    def __init__(self, source: WeightSource, target: SyncTarget, *, describe: str = "rollout") -> None:
        self.source, self.target, self.describe = source, target, describe

    @torch.no_grad()
    def run(self, *, raise_on_mismatch: bool = True) -> SyncReport:
        t0 = time.perf_counter()
        report = SyncReport()
        wanted = self.target.operands()
        self.target.check_keys(set(self.source.model.state_dict().keys()))
        want = FingerprintBatch()
        for key, full in self.source.tensors():
            self.target.receive(key, full)
            report.n_tensors += 1
            report.n_bytes += full.numel() * full.element_size()
            if key in wanted:
                mod, _, pname = key.rpartition(".")
                want.add(key, reference_operand(full, self.source.module(mod), pname, wanted[key]))
            del full
        report.n_static_refreshed = self.target.commit(self.source)
        report.fingerprints, report.mismatches = self.target.verify(want.result())
        report.n_checked = len(report.fingerprints)
        report.mismatches += self.source.agree(report.fingerprints)
        report.seconds = time.perf_counter() - t0
        if report.mismatches and raise_on_mismatch:
            raise WeightSyncError(
                f"{self.describe} weights differ from the trainer's QDQ(W) in {len(report.mismatches)} tensors "
                f"(first: {report.mismatches[:3]}); check that both sides use the same recipe, weight_dtype and "
                "code and that nothing wrote to the rollout weights; the engine must not roll out with these weights"
            )
        return report


def verify_sync(trainer_model: nn.Module, rollout_model: nn.Module, *, raise_on_mismatch: bool = True
                ) -> SyncReport:
    """Compare the rollout model's weight operands with the trainer's, bit for bit (no copy, no re-quantize)."""
    target = ReplicaTarget(rollout_model)
    report = SyncReport()
    report.fingerprints, report.mismatches = target.verify(reference_fingerprints(trainer_model, target.operands()))
    report.n_checked = len(report.fingerprints)
    if report.mismatches and raise_on_mismatch:
        raise WeightSyncError(
            f"rollout weights differ from the trainer's QDQ(W) in {len(report.mismatches)} tensors "
            f"(first: {report.mismatches[:3]}); check that both sides use the same recipe and weight_dtype "
            "and that nothing wrote to the rollout weights; the engine must not roll out with these weights"
        )
    return report


def sync_weights(trainer_model: nn.Module, rollout_model: nn.Module) -> SyncReport:
    """Copy master weights, re-quantize on the rollout side, verify bit-exactness (module docstring)."""
    return WeightSync(LocalWeights(trainer_model), ReplicaTarget(rollout_model)).run()
