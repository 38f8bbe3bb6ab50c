"""Residual Activation Compensation (RAC): channel count, channel selection, residual operands.

For an activation ``X`` ``[T, K]`` (DESIGN.md section 4):

- ``Xq = QDQ(X)`` with NVFP4 (global scale per tensor, or per token with ``act_scale="token"``);
  the residual is ``R = X - Xq`` (computed in fp32 against that same quantization).
- ``|S| = rac_channels(K, ratio)``: ``ratio * K`` rounded to the *nearest* multiple of 16 (halves
  round up), at least 16 when ``ratio > 0``, at most K. Nearest keeps the realized ratio closest to
  the requested one; the floor of 16 makes any positive ratio do something; multiples of 16 keep
  the residual in whole NVFP4 blocks.
- ``S``: ``dynamic``: the |S| channels with the largest residual L2 norm over the T tokens of this
  GEMM, ties to the lower channel index (stable sort); ``static``: the first |S| of a calibrated
  per-layer order (``StaticChannelSelector``), independent of the batch.
- ``S`` is kept in selection order (largest residual first), not sorted by channel index, so each
  16-block of the gathered ``R[:, S]`` groups channels of similar residual size, which gives tighter
  block scales than grouping by index.
- ``R[:, S]`` ``[T, |S|]`` is quantized as its own NVFP4 tensor: its own E4M3 block scales *and its
  own FP32 global scale* from ``amax(R[:, S])`` (per tensor, or per token with ``act_scale="token"``).
  Re-using X's global scale would push the residual's block scales (about 1/12 of X's) into E4M3's
  subnormal range and lose most of their precision; a fused kernel has R[:, S] at hand anyway.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from quads.formats.constants import NVFP4_BLOCK
from quads.quant import ops


def rac_channels(k: int, ratio: float) -> int:
    """Number of residual channels ``|S|`` for ``K = k`` input channels (see the module docstring)."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"rac_ratio must be in [0, 1], got {ratio}")
    if ratio == 0.0:
        return 0
    n = NVFP4_BLOCK * int(ratio * k / NVFP4_BLOCK + 0.5)
    return min(k, max(NVFP4_BLOCK, n))


def residual_norms(r: torch.Tensor) -> torch.Tensor:
    """Squared L2 norm of each channel over tokens, fp64: ``r`` ``[T, K]`` -> ``[K]`` (the selection
    score); a stack ``[G, C, K]`` of groups (experts) -> ``[G, K]``, one score row per group.

    fp64 so that the ranking does not depend on the summation order (the squares of fp32 residuals
    are exact in fp64): the fused Triton kernel (``quads.prototype.kernels.rac``) sums in another order and
    selects the same channels, which an fp32 sum would not guarantee.
    """
    return r.double().square().sum(dim=-2)


def select_dynamic(r: torch.Tensor, n: int) -> torch.Tensor:
    """The ``n`` channels of ``r`` ``[T, K]`` with the largest residual norm, largest first."""
    return torch.argsort(residual_norms(r), descending=True, stable=True)[:n]


def rac_operands(
    x2: torch.Tensor,
    *,
    n: int,
    selection: str = "dynamic",
    act_scale: str = "tensor",
    mode: str = "te",
    static_order: torch.Tensor | None = None,
    observe: Callable[[torch.Tensor], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(Xq, QDQ(R[:, S]), S)`` for ``x2`` ``[T, K]``, all fp32 (``S`` long ``[n]``; None when n == 0).

    ``observe(R)`` (optional) sees the full residual ``[T, K]``, for static-order calibration.
    """
    per_token = act_scale == "token"
    xf = x2.float()
    xq = ops.nvfp4_qdq(xf, mode=mode, per_token=per_token)  # [T, K] fp32
    if n == 0 and observe is None:
        return xq, None, None
    r = xf - xq  # [T, K]
    if observe is not None:
        observe(r)
    if n == 0:
        return xq, None, None
    if selection == "dynamic":
        s = select_dynamic(r, n)
    elif selection == "static":
        if static_order is None or static_order.numel() < n:
            got = None if static_order is None else static_order.numel()
            raise ValueError(
                f"static RAC selection needs a channel order of at least {n} channels, got {got}; "
                "pass static_channels (e.g. StaticChannelSelector.channels) or use selection='dynamic'"
            )
        s = static_order[:n].to(device=x2.device, dtype=torch.long)
    else:
        raise ValueError(f"unknown RAC selection {selection!r}; valid: dynamic, static")
    rq = ops.nvfp4_qdq(r[:, s], mode=mode, per_token=per_token)  # [T, n] fp32, own global scale
    return xq, rq, s


class StaticChannelSelector(nn.Module):
    """Per-layer RAC channel order, calibrated from recent residual norms and frozen between syncs.

    ``groups`` orders of ``k`` channels (one per expert of an experts module, 1 for a linear).
    While ``observing``, every RAC forward adds ``sum_t R[t, c]^2`` into ``sq_sum``; ``refresh()`` (called
    at each weight sync) sorts the accumulated norms into ``order`` (largest first, stable) and resets
    the statistics. Groups that saw no tokens take ``prior`` (a score per channel, e.g. weight column
    norms) when given, else keep their order. Between refreshes the order is fixed, so the rollout's
    output for a token does not depend on its batch-mates (with ``act_scale="token"``).
    The buffers are not persistent: the order is rollout state, not part of the model's weights.
    """

    def __init__(self, groups: int, k: int) -> None:
        super().__init__()
        self.groups, self.k = groups, k
        self.observing = True
        self.register_buffer("sq_sum", torch.zeros(groups, k), persistent=False)
        self.register_buffer("count", torch.zeros(groups, dtype=torch.long), persistent=False)
        self.register_buffer("order", torch.arange(k).repeat(groups, 1), persistent=False)

    def channels(self, group: int, n: int) -> torch.Tensor:
        """The first ``n`` channels of group ``group``'s order, ``[n]`` long."""
        return self.order[group, :n]

    @torch.no_grad()
    def observe(self, group: int, r: torch.Tensor) -> None:
        """Accumulate the residual ``r`` ``[T, K]`` of one GEMM of group ``group``."""
        if self.observing:
            self.sq_sum[group] += residual_norms(r).to(self.sq_sum.device)
            self.count[group] += r.shape[0]

    @torch.no_grad()
    def observe_all(self, r: torch.Tensor, counts: torch.Tensor) -> None:
        """Accumulate the residuals ``r`` ``[groups, C, K]`` of every group at once (zero-padded rows;
        ``counts`` ``[groups]`` real rows per group), as ``observe`` per group would."""
        if self.observing:
            self.sq_sum += residual_norms(r).to(self.sq_sum.device)
            self.count += counts.to(self.count.device)

    @torch.no_grad()
    def observe_norms(self, norms: torch.Tensor, counts: torch.Tensor) -> None:
        """Accumulate per-group residual norms ``norms`` ``[groups, K]`` (``sum_t R^2``, as
        ``residual_norms`` gives) of ``counts`` ``[groups]`` rows, as ``observe_all`` does from R."""
        if self.observing:
            self.sq_sum += norms.to(self.sq_sum.device)
            self.count += counts.to(self.count.device)

    @torch.no_grad()
    def refresh(self, prior: torch.Tensor | None = None) -> int:
        """Recompute the orders from the statistics, reset them; returns the number of groups updated."""
        seen = self.count > 0
        scores = self.sq_sum.clone()
        if prior is not None:
            scores[~seen] = prior.float().to(scores.device).reshape(self.groups, self.k)[~seen]
            seen = torch.ones_like(seen)
        new = torch.argsort(scores, dim=-1, descending=True, stable=True)
        self.order[seen] = new[seen]
        self.sq_sum.zero_()
        self.count.zero_()
        return int(seen.sum())
