"""The trainer's compiled policy forward (``quads.rl.compiled``): no graph break in the forward of the
BF16 and W4A16-QAT trainers (grouped experts, BF16 autocast over fp32 masters), the compiled loss and
gradients equal to the plain ones, the QAT cache refreshed after an optimizer step, a bounded number of
graphs over changing sequence widths, and the ``trainer_compile`` config field.

On the CPU the region is traced by Dynamo and run by the ``eager`` backend (the captured graph's ATen
ops, autograd as usual) or ``aot_eager`` (AOTAutograd's joint forward/backward graphs, run op by op):
both compute the same ops in the same order as the plain forward, so the tests ask for equality bit
for bit. The GPU section (skipped without CUDA) runs Inductor, whose fused kernels round differently.
"""

import copy
import typing

import pytest
import torch
from conftest import save_tiny_checkpoint
from test_trainer import DigitsTask, tiny_config

from quads import tasks
from quads.config import coerce, from_dict, to_dict
from quads.model import ModelConfig, MoEForCausalLM, gemm
from quads.quant import Recipe, quantize_model
from quads.quant.recipe import LinearSpec
from quads.rl import compiled
from quads.rl.compiled import CompiledForward, resolve
from quads.rl.config import TrainConfig
from quads.rl.logprobs import SequenceBatch, forward_logprobs, policy_forward

SPECS = {"bf16": LinearSpec(), "w4a16-qat": LinearSpec.of(weight="nvfp4")}
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (Inductor on the GPU)")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test starts with no compiled graph (the graphs of ``policy_forward`` are shared by all models)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model(recipe: str, device: str = "cpu", seed: int = 0, **fields) -> MoEForCausalLM:
    torch.manual_seed(seed)
    cfg = ModelConfig.preset("tiny", **{"n_layers": 1, "vocab_size": 100, "dtype": "float32", **fields})
    model = MoEForCausalLM(cfg).to(device)
    quantize_model(model, Recipe("t", trainer=SPECS[recipe], expert_path="grouped"), side="trainer", verbose=False)
    return model


def _batch(S: int = 12, P: int = 4, pad: bool = True, device: str = "cpu", B: int = 3) -> SequenceBatch:
    """Left-padded prompts (row 0: two pads) and right-padded responses (row 1: three pads), as rollouts."""
    ids = torch.randint(4, 100, (B, S), generator=torch.Generator().manual_seed(S))
    mask = torch.ones(B, S, dtype=torch.bool)
    if pad:
        mask[0, :2] = False
        mask[1, S - 3:] = False
    return SequenceBatch(ids.to(device), mask.to(device), P, mask[:, P:].clone().to(device))


def _step(model, batch, forward, routing=None) -> dict[str, torch.Tensor]:
    """A GRPO-shaped loss (log-probs, entropy bonus, router aux loss) under BF16 autocast, and its gradients."""
    dev = batch.input_ids.device.type
    with torch.autocast(dev, dtype=torch.bfloat16):
        res = forward_logprobs(model, batch, routing, 0.9, return_entropy=True, forward=forward)
    adv = torch.linspace(-1, 1, batch.input_ids.shape[0], device=batch.input_ids.device)[:, None]
    loss = -(res.logprobs * adv).sum() / batch.response_mask.sum() - 1e-2 * res.entropy.mean() + res.aux_loss
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {"loss": loss.detach(), "logprobs": res.logprobs.detach(),
            **{n: p.grad for n, p in model.named_parameters()}}


@pytest.mark.parametrize("route", ["probe", "fp32-route"])
@pytest.mark.parametrize("pad", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("recipe", sorted(SPECS))
def test_trainer_forward_has_no_graph_break(recipe, pad, route, monkeypatch):
    """``torch._dynamo.explain`` of the region: one graph, no break, with or without padding, for this
    CPU's GEMM route (``gemm.native_bf16_gemm``'s probe, read while tracing) and for ``gemm``'s fp32
    route of a CPU without a native BF16 GEMM (forced)."""
    if route == "fp32-route":
        monkeypatch.setattr(gemm, "native_bf16_gemm", lambda: False)
    model, batch = _model(recipe), _batch(pad=pad)
    compiled.refresh_stale(model)  # what CompiledForward does before the region
    gemm.mark_compile_constants()  # and before compiling it
    mask = batch.attention_mask if pad else None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ex = torch._dynamo.explain(policy_forward)(model, batch.input_ids, mask, None, None, batch.response_mask,
                                                   False)
    reasons = [f"{b.reason}".split("\n")[0] + f" at {b.user_stack[-1] if b.user_stack else '?'}"
               for b in ex.break_reasons]
    assert (ex.graph_count, ex.graph_break_count) == (1, 0), f"{recipe}: graph breaks: {reasons}"


@pytest.mark.parametrize(("recipe", "backend", "route"), [("bf16", "eager", "probe"), ("w4a16-qat", "eager", "probe"),
                                                    ("w4a16-qat", "aot_eager", "native"),
                                                    ("w4a16-qat", "aot_eager", "fp32-route")])
def test_compiled_loss_and_gradients_equal_plain(recipe, backend, route, monkeypatch):
    """Loss, log-probs and every parameter's gradient, compiled (fullgraph) against plain, bit for bit;
    routes replayed in the no-grad pass as the trainer does (old log-probs record them, the update
    replays them). ``aot_eager`` traces the backward too, on both GEMM routes whatever this CPU has:
    torch's BF16 GEMM (``native``) and ``gemm``'s FP32 route, whose backward GEMMs stay FP32 (traced
    under the call's autocast they became BF16 GEMMs, and the gradients differed on AVX2-only CPUs)."""
    if route != "probe":
        monkeypatch.setattr(gemm, "native_bf16_gemm", lambda: route == "native")
    batch = _batch()
    res = {}
    for name, forward in (("plain", None), ("compiled", CompiledForward(backend, fullgraph=True))):
        model = _model(recipe)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            routing = forward_logprobs(model, batch, None, 0.9, return_routing=True, forward=forward).routing
        res[name] = {"routing": routing, **_step(model, batch, forward, routing)}
    assert res["plain"]["model.layers.0.mlp.experts.gate_up_proj"].abs().sum() > 0
    for key, want in res["plain"].items():
        got = res["compiled"][key]
        assert torch.equal(got, want), (f"{recipe}, {backend}: {key} differs, max |d| = "
                                        f"{(got.double() - want.double()).abs().max().item():.3g}")


def test_compiled_qat_sees_the_optimizer_step():
    """After an optimizer step the compiled W4A16-QAT forward uses QDQ of the *new* weights (the cache is
    refreshed eagerly before the region, ``refresh_stale``): equal to a plain forward of the same weights."""
    batch, fwd = _batch(), CompiledForward("eager", fullgraph=True)
    model = _model("w4a16-qat")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    first = _step(model, batch, fwd)
    opt.step()
    plain = copy.deepcopy(model)
    after = _step(model, batch, fwd)
    want = _step(plain, batch, None)
    assert not torch.equal(after["logprobs"], first["logprobs"])
    for key in ("loss", "logprobs", "model.layers.0.mlp.experts.down_proj"):
        assert torch.equal(after[key], want[key]), f"{key}: the compiled forward used stale QAT weights"


def test_compiled_qat_with_the_grouped_refresh_equals_plain():
    """The Triton refresh (``ops.qat_weights``, under Triton's interpreter on a CPU) makes the QAT operands
    of every layer views of one buffer per weight shape; after an optimizer step the compiled forward
    (``aot_eager``) with those operands gives the plain forward's loss, log-probs and gradients bit for
    bit, and both the reference backend's."""
    pytest.importorskip("triton")
    from quads.kernels import dispatch
    from quads.kernels._common import interpreter_on

    if torch.cuda.is_available() or not interpreter_on():
        pytest.skip("a CPU test under Triton's interpreter (TRITON_INTERPRET=1 before the kernels are imported); "
                    "CUDA's scatter-add backward is not bit-reproducible")
    small = dict(n_layers=2, hidden_size=32, n_heads=2, n_kv_heads=1, head_dim=16, n_experts=2, moe_intermediate_size=16)
    batch = _batch()
    res = {}
    for name, backend, forward in (("plain", "triton", None),
                                   ("compiled", "triton", CompiledForward("aot_eager", fullgraph=True)),
                                   ("reference", "reference", None)):
        model = _model("w4a16-qat", **small)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        with dispatch.kernels(backend):
            _step(model, batch, forward)
            opt.step()
            res[name] = _step(model, batch, forward)
        if backend == "triton":  # both layers' gate_up operands: views of one [2, E, 2I, H] buffer
            a, b = (layer.mlp.experts.stores["gate_up_proj"].w_q for layer in model.model.layers)
            assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    for other in ("compiled", "reference"):
        for key, want in res["plain"].items():
            assert torch.equal(res[other][key], want), f"{other}: {key} differs from the plain Triton-refreshed step"


def test_graphs_are_bounded_over_sequence_widths():
    """The sequence dimension is dynamic: new widths (prompt and response) reuse the graphs; a graph per
    kind of call (train with grad, old log-probs recording routes, replaying them) and padding."""
    import torch._dynamo.testing

    counter = torch._dynamo.testing.CompileCounter()
    fwd = CompiledForward(counter, fullgraph=True)
    model = _model("w4a16-qat")
    for S, P, pad in [(12, 4, True), (17, 6, True), (11, 4, False), (14, 6, False)]:
        batch = _batch(S, P, pad)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            routing = forward_logprobs(model, batch, None, 1.0, return_routing=True, forward=fwd).routing
            forward_logprobs(model, batch, routing, 1.0, forward=fwd)
        _step(model, batch, fwd, routing)
    assert counter.frame_count == 6, f"{counter.frame_count} graphs for 3 kinds of call x padded/unpadded"


def test_config_field_resolves_and_round_trips():
    for value, want in (("auto", "auto"), ("true", True), ("False", False), (True, True)):
        assert coerce(value, typing.get_type_hints(TrainConfig)["trainer_compile"], "trainer_compile") == want
    with pytest.raises(ValueError, match="trainer_compile"):
        from_dict(TrainConfig, {"trainer_compile": "yes please"})
    cfg = from_dict(TrainConfig, {"trainer_compile": "false"})
    assert cfg.trainer_compile is False and from_dict(TrainConfig, to_dict(cfg)).trainer_compile is False
    assert resolve("auto", "cpu", False) is False and resolve("auto", "cuda", False) is True
    assert resolve("auto", "cuda:1", True) is False and resolve(True, "cpu", False) is True
    with pytest.raises(ValueError, match="torchrun"):
        resolve(True, "cuda", True)


@pytest.mark.parametrize("setting", [True, "auto"])
def test_trainer_honours_the_field(tmp_path, monkeypatch, setting):
    """A one-step run: with trainer_compile=true every trainer log-prob goes through the compiled
    forward (torch.compile with the eager backend here), with auto on the CPU none does; config.yaml
    records the field."""
    monkeypatch.setitem(tasks.TASKS, "digits", DigitsTask)
    made = []

    real_compile = torch.compile

    def eager_compile(fn, **kw):
        made.append((fn, kw))
        return real_compile(fn, **{**kw, "backend": "eager"})

    monkeypatch.setattr(torch, "compile", eager_compile)
    calls = []
    real = CompiledForward.__call__
    monkeypatch.setattr(CompiledForward, "__call__", lambda self, *a: calls.append(1) or real(self, *a))
    from quads.rl.trainer import GRPOTrainer

    cfg = tiny_config(tmp_path, save_tiny_checkpoint(tmp_path / "ckpt"), steps=1, eval_every=0,
                      trainer_compile=setting)
    GRPOTrainer(cfg, quiet=True).run()
    assert ("trainer_compile: " + ("true" if setting is True else "auto")) in (tmp_path / "run/config.yaml").read_text()
    if setting is True:
        assert [(fn, kw["backend"]) for fn, kw in made] == [(policy_forward, "inductor")]
        assert len(calls) == 2  # the old log-probs and the one mini-batch
    else:
        assert not made and not calls


@pytest.mark.slow  # ~15 s: Dynamo traces four graphs with dynamic shapes
def test_micro_batches_compiled_equal_plain(tmp_path, monkeypatch):
    """``optim.micro_batch_size`` 3 on mini-batches of 8 rows (micro-batches of 2 and 3: the batch dimension is
    marked dynamic): a one-step run with ``trainer_compile=true`` (Dynamo, the eager backend) ends with the
    plain run's parameters bit for bit, every forward through one graph per kind of call (old log-probs,
    update) and padding, whatever its rows."""
    import torch._dynamo.testing

    from quads.rl.config import OptimSection, RecipeSection
    from quads.rl.trainer import GRPOTrainer

    monkeypatch.setitem(tasks.TASKS, "digits", DigitsTask)
    counter = torch._dynamo.testing.CompileCounter()
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, **{**kw, "backend": counter}))
    ckpt = save_tiny_checkpoint(tmp_path / "ckpt")
    params = {}
    for setting in (False, True):
        cfg = tiny_config(tmp_path / str(setting), ckpt, steps=1, eval_every=0, trainer_compile=setting, dtype="bfloat16",
                          recipe=RecipeSection(name="bf16", expert_path="grouped"),  # the loop breaks the graph
                          optim=OptimSection(lr=2e-2, mini_batches=2, micro_batch_size=3))
        trainer = GRPOTrainer(cfg, quiet=True)
        trainer.run()
        params[setting] = [p.detach().clone() for p in trainer.params]
    assert trainer.policy_forward.dynamic_batch
    assert 2 <= counter.frame_count <= 4, f"{counter.frame_count} graphs for 2 kinds of call x padded/unpadded"
    for got, want in zip(params[True], params[False]):
        assert torch.equal(got, want)


# ---------------------------------------------------------------------- GPU (Inductor)


def _fp32_step(model, batch, routing):
    with torch.autocast("cuda", enabled=False):
        res = forward_logprobs(model, batch, routing, 0.9, return_entropy=True)
    adv = torch.linspace(-1, 1, batch.input_ids.shape[0], device="cuda")[:, None]
    loss = -(res.logprobs * adv).sum() / batch.response_mask.sum() - 1e-2 * res.entropy.mean() + res.aux_loss
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {"loss": loss.detach(), "logprobs": res.logprobs.detach(),
            **{n: p.grad for n, p in model.named_parameters()}}


@CUDA
@pytest.mark.parametrize("recipe", sorted(SPECS))
def test_inductor_step_matches_plain_cuda(recipe):
    """The Inductor-compiled BF16 step against the plain BF16 step on CUDA, both measured against the
    plain step in fp32 (no autocast) with the same routes: the compiled step's error in the loss, the
    log-probs and every gradient is at most twice the plain step's plus 2^-8 of the tensor's scale
    (Inductor fuses BF16 pointwise chains in fp32 and rounds once, so it is not bit-exact; it must not be
    less accurate than BF16 rounding allows). Two sequence widths: the second reuses the graph."""
    fwd = CompiledForward()
    for S, P in ((40, 12), (56, 9)):
        batch = _batch(S, P, device="cuda", B=8)
        model = _model(recipe, "cuda")
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            routing = forward_logprobs(model, batch, None, 0.9, return_routing=True).routing
        ref = _fp32_step(copy.deepcopy(model), batch, routing)
        plain = _step(copy.deepcopy(model), batch, None, routing)
        comp = _step(model, batch, fwd, routing)
        for key, want in ref.items():
            scale = want.abs().max().item()
            e_plain = (plain[key].float() - want).abs().max().item()
            e_comp = (comp[key].float() - want).abs().max().item()
            assert torch.isfinite(comp[key]).all(), f"{recipe} S={S}: {key} not finite"
            assert e_comp <= 2 * e_plain + 2**-8 * scale, (
                f"{recipe} S={S}: {key}: |compiled - fp32| = {e_comp:.3g} > 2 x |plain - fp32| = {e_plain:.3g} "
                f"+ 2^-8 x {scale:.3g}")


@CUDA
def test_trainer_compiles_with_auto_on_cuda(tmp_path, monkeypatch):
    """``trainer_compile: auto`` on CUDA: the run's trainer log-probs go through the compiled forward."""
    monkeypatch.setitem(tasks.TASKS, "digits", DigitsTask)
    calls = []
    real = CompiledForward.__call__
    monkeypatch.setattr(CompiledForward, "__call__", lambda self, *a: calls.append(self.backend) or real(self, *a))
    from quads.rl.trainer import GRPOTrainer

    cfg = tiny_config(tmp_path, save_tiny_checkpoint(tmp_path / "ckpt"), steps=1, eval_every=0, device="cuda",
                      dtype="bfloat16", trainer_compile="auto")
    trainer = GRPOTrainer(cfg, quiet=True)
    res = trainer.run()
    assert trainer.compile and calls == ["inductor", "inductor"], calls
    assert res.steps == 1
    assert 0 < res.last["perf/max_mem_gib"] <= res.last["perf/max_reserved_gib"]  # the step's CUDA memory peaks
