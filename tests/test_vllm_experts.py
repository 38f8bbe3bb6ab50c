"""vLLM's quads experts (``quads.rollout.vllm.experts``, no vLLM needed) against quads' own rollout experts.

The sorted path over ``RolloutWeight`` stacks is ``QuantizedExperts.forward_static``'s function: the same bits for
the same weights, routes and static RAC orders, on the reference backend and (under Triton's CPU interpreter at
tiny sizes, or on CUDA) with the grouped kernels reading the stored 4-bit codes; it follows a re-quantized unit.
Against the loop it differs only by the GEMMs' accumulation order (the same quantized operands).
"""

import os

import pytest
import torch
from torch import nn

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from quads.kernels import dispatch  # noqa: E402
from quads.kernels._common import HAS_TRITON, interpreter_on  # noqa: E402
from quads.model import moe  # noqa: E402
from quads.quant.layers import QuantizedExperts  # noqa: E402
from quads.quant.recipe import PRESETS, LinearSpec  # noqa: E402
from quads.rollout.vllm.experts import (  # noqa: E402
    VllmExpertOperands,
    experts_forward,
    sorted_experts_forward,
    use_sorted,
)
from quads.rollout.vllm.weights import RolloutWeight, expert_units, kernel_layout  # noqa: E402

DEV = "cuda" if HAS_CUDA else "cpu"
E, H, INTER, T, K = 4, 64, 64, 6, 2


def _rollout_spec(name: str) -> LinearSpec:
    """A recipe's rollout spec; ``quads-static``: quads' with calibrated (static) RAC orders."""
    if name == "quads-static":
        return PRESETS["quads"].rollout.replace(rac_selection="static")
    return PRESETS[name].rollout


class _Layer(nn.Module):
    """vLLM's fused-MoE parameters: ``w13_weight`` [E, 2I, H] = [gate; up], ``w2_weight`` [E, H, I]."""

    def __init__(self, ex: moe.MoEExperts) -> None:
        super().__init__()
        self.w13_weight = nn.Parameter(ex.gate_up_proj.detach().clone(), requires_grad=False)
        self.w2_weight = nn.Parameter(ex.down_proj.detach().clone(), requires_grad=False)


def _weights(layer: _Layer, spec: LinearSpec, storage: str) -> tuple[RolloutWeight, RolloutWeight]:
    out = []
    for pname, qname in (("w13_weight", "gate_up_proj"), ("w2_weight", "down_proj")):
        units = expert_units("experts", qname, tuple(getattr(layer, pname).shape))
        with torch.device(DEV):  # vLLM builds its model under the target device: the codes are allocated there
            rw = RolloutWeight(layer, pname, units, spec, torch.bfloat16, storage)
        rw.quantize_all()
        out.append(rw)
    return tuple(out)


def _setup(recipe: str, storage: str = "packed", seed: int = 0, kernels: str = "reference", inter: int = INTER):
    """quads' rollout experts (built under ``kernels``: "triton" keeps only the packed weight, as on a GPU) and
    vLLM's weights of the same master stacks, an input batch and its routes."""
    torch.manual_seed(seed)
    ex = moe.MoEExperts(E, H, inter).bfloat16().to(DEV)
    with torch.no_grad():
        for p in ex.parameters():
            p.normal_(0, 0.05)
    spec = _rollout_spec(recipe)
    with dispatch.kernels(kernels):
        q = QuantizedExperts(ex, spec, side="rollout", weight_dtype=torch.bfloat16)
    layer = _Layer(ex)
    w13, w2 = _weights(layer, spec, storage)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(T, H, generator=g).bfloat16().to(DEV)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(DEV)
    wts = torch.rand(T, K, generator=g).softmax(-1).bfloat16().to(DEV)
    return spec, q, layer, w13, w2, x, ids, wts


def _selectors_of(q: QuantizedExperts) -> dict:
    """quads' layer's static RAC selectors under vLLM's keys (the same objects: the same orders)."""
    return {key: q.selectors[name] for key, name in (("w13", "gate_up_proj"), ("w2", "down_proj"))
            if name in q.selectors}


def _vllm(spec, q, w13, w2, x, ids, wts, path):
    """vLLM's experts on ``path``, with quads' layer's static RAC selectors (the same orders) where it has them."""
    sels = _selectors_of(q)
    if path == "sorted":
        operands = {"gate_up_proj": VllmExpertOperands(w13), "down_proj": VllmExpertOperands(w2)}
        return sorted_experts_forward(x, ids.int(), wts, n_experts=E, operands=operands, spec=spec,
                                      act_fn=torch.nn.functional.silu, selectors=sels)
    return experts_forward(x, ids, wts, n_experts=E, gate_up=w13.gemm_weights, down=w2.gemm_weights, spec=spec,
                           act_fn=torch.nn.functional.silu, selectors=sels)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def _close_to_loop(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("recipe,storage,inter", [("w4a16", "packed", INTER), ("nvfp4", "packed", INTER),
                                                  ("quads", "packed", INTER), ("quads", "packed", 32),
                                                  ("quads", "master", INTER), ("fp8", "master", INTER)])
def test_sorted_path_is_quads_captured_experts_bit_for_bit(recipe, storage, inter):
    """Reference backend: vLLM's sorted path = ``QuantizedExperts.forward_static`` bit for bit (same operands, same
    routes, same RAC orders), and within accumulation-order distance of vLLM's loop. ``inter`` 32: the down
    projection's K is not a multiple of 64, so its stack keeps the canonical layout."""
    spec, q, _, w13, w2, x, ids, wts = _setup(recipe, storage, inter=inter)
    assert w2.layout == (None if storage == "master" else "w4a16" if inter % 64 == 0 else "nvfp4")
    with dispatch.kernels("reference"), torch.no_grad():
        want = q.forward_static(x, ids, wts)
        got = _vllm(spec, q, w13, w2, x, ids, wts, "sorted")
        loop = _vllm(spec, q, w13, w2, x, ids, wts, "loop")
    assert _same_bits(got, want), f"{recipe}/{storage}: max diff {(got.float() - want.float()).abs().max():.3e}"
    assert _close_to_loop(got, loop) < 1e-2, f"{recipe}: rel {_close_to_loop(got, loop):.2e} from the loop"
    assert not torch.equal(got, torch.zeros_like(got))


@pytest.mark.skipif(HAS_CUDA, reason="the shared operands are the CPU loop's (shares_operands)")
@pytest.mark.parametrize("recipe,storage", [("quads", "master"), ("quads", "packed"), ("nvfp4", "packed")])
def test_loop_shares_its_operands_and_is_quads_per_expert_loop_bit_for_bit(recipe, storage, monkeypatch):
    """Reference backend: vLLM's loop builds its NVFP4 activation operands once per call
    (``shared_operand_experts``, as quads' layer does) and gives quads' per-expert loop's bits."""
    from quads.rollout.vllm import experts as vllm_experts

    calls = []
    shared = vllm_experts.shared_operand_experts
    monkeypatch.setattr(vllm_experts, "shared_operand_experts", lambda *a, **k: calls.append(1) or shared(*a, **k))
    spec, q, _, w13, w2, x, ids, wts = _setup(recipe, storage)
    q.grouped, q.share_operands = False, False
    with dispatch.kernels("reference"), torch.no_grad():
        want = q(x, ids, wts)
        got = _vllm(spec, q, w13, w2, x, ids, wts, "loop")
    assert calls, "vLLM's loop did not share its operands"
    assert _same_bits(got, want), f"{recipe}/{storage}: max diff {(got.float() - want.float()).abs().max():.3e}"


def test_static_rac_orders_reach_the_sorted_path():
    """With static RAC the sorted path reads the selectors' orders: reversing them changes the output (and quads'
    layer, reading the same selectors, changes the same way)."""
    spec, q, _, w13, w2, x, ids, wts = _setup("quads-static")
    assert spec.static_rac and len(q.selectors) == 2
    with dispatch.kernels("reference"), torch.no_grad():
        before = _vllm(spec, q, w13, w2, x, ids, wts, "sorted")
        for sel in q.selectors.values():
            sel.order.copy_(sel.order.flip(-1))
        after = _vllm(spec, q, w13, w2, x, ids, wts, "sorted")
        want = q.forward_static(x, ids, wts)
    assert not torch.equal(before, after)
    assert _same_bits(after, want)


@pytest.mark.skipif(not HAS_TRITON or not (HAS_CUDA or interpreter_on()),
                    reason="needs Triton (CUDA, or its CPU interpreter set before quads.kernels was imported)")
@pytest.mark.parametrize("recipe", ["w4a16", "quads"])
def test_sorted_path_reads_the_stored_codes_with_the_grouped_kernels(recipe, reference_quantizer):
    """Triton backend: the grouped kernels read the stored weight itself (kept in their layout; no BF16 copy of the
    stack), with quads' layer's bits on its own kernel path; after the units are re-quantized from new weights
    the stored layout holds them in place and the output is that of quads' layer over the new weights."""
    spec, q, layer, w13, w2, x, ids, wts = _setup(recipe, kernels="triton")
    assert q.stores["down_proj"].kernel is not None
    operands = {"gate_up_proj": VllmExpertOperands(w13), "down_proj": VllmExpertOperands(w2)}
    sels = _selectors_of(q)

    def run():
        return sorted_experts_forward(x, ids, wts, n_experts=E, operands=operands, spec=spec,
                                      act_fn=torch.nn.functional.silu, selectors=sels)

    with dispatch.kernels("triton"), torch.no_grad():
        assert operands["gate_up_proj"].use_packed(x)
        got = run()
        want = q.forward_static(x, ids, wts)
        assert _same_bits(got, want)
        kernel = operands["down_proj"].get_packed()
        ptr = kernel.codes.data_ptr()
        layer.w2_weight.mul_(-1.5)  # a push of new down_proj weights: vLLM's loader re-quantizes each unit
        for i in range(E):
            w2.quantize_unit(i)
        q.down_proj.mul_(-1.5)
        q.refresh()
        got2 = run()
        want2 = q.forward_static(x, ids, wts)
    assert operands["down_proj"].get_packed().codes.data_ptr() == ptr, "the stored layout is updated in place"
    assert not torch.equal(got2, got)
    assert _same_bits(got2, want2)


def test_which_path():
    x = torch.zeros(3, H)
    w4a16, quads = _rollout_spec("w4a16"), _rollout_spec("quads")
    assert not use_sorted("auto", quads, x)  # the CPU's default: the loop
    assert use_sorted("grouped", quads, x) and use_sorted("grouped", w4a16, x)
    assert not use_sorted("loop", quads, x)
    assert not use_sorted("grouped", quads, x[:0])
    amplified = quads.replace(error_scale=4.0)
    assert not use_sorted("grouped", amplified, x)


def test_expert_stacks_are_stored_in_the_kernel_layout():
    """Packed canonical-NVFP4 expert stacks whose K is a multiple of 64 are kept in the grouped kernels' layout, with
    the canonical bytes' count and codes (``packed()`` decodes them byte for byte); other weights keep the
    canonical tensors."""
    from quads.kernels import w4a16
    from quads.quant import ops

    spec = _rollout_spec("quads")
    assert kernel_layout(spec, (E, 2 * INTER, H)) and not kernel_layout(spec, (E, 2 * INTER, 32))
    assert not kernel_layout(spec, (2 * INTER, H))  # a linear: one global scale per shard
    assert not kernel_layout(spec.replace(weight_tile=(16, 16)), (E, 2 * INTER, H))
    _, _, layer, w13, w2, *_ = _setup("quads")
    for rw, master in ((w13, layer.w13_weight), (w2, layer.w2_weight)):
        assert rw.layout == "w4a16"
        n = master.numel()
        assert sum(t.numel() * t.element_size() for t in rw.store.values()) == n // 2 + n // 16 + 4 * E
        q = ops.quantize_weight(master[1], spec, torch.bfloat16)[1]
        got = rw.packed(1)
        assert torch.equal(got.codes, q.codes) and torch.equal(got.scales.view(torch.uint8), q.scales.view(torch.uint8))
        assert torch.equal(got.global_scale.reshape(()), q.global_scale.reshape(()))
        assert torch.equal(rw.operand(1).view(torch.int16), w4a16.dequantize(rw.kernel(1)).view(torch.int16))


def test_packed_storage_refuses_the_amplifier():
    spec = _rollout_spec("quads").replace(error_scale=4.0)
    layer = _Layer(moe.MoEExperts(E, H, INTER).bfloat16().to(DEV))
    with pytest.raises(ValueError, match="amplifier"):
        _weights(layer, spec, "packed")
    _weights(layer, spec, "master")  # the master storage keeps W: allowed
