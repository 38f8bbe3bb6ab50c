"""``quads.experiments.vllm_compare.replay_layer_inputs`` (no vLLM needed): quads' forward computes on recorded layer
inputs, and refuses inputs that differ by more than float rounding, another routing, or unconsumed rows."""

from __future__ import annotations

import pytest
import torch

from quads.experiments.vllm_compare import quads_prompt_logprobs, replay_layer_inputs

EXPERTS = [f"model.layers.{i}.mlp.experts" for i in range(2)]


@pytest.fixture(scope="module")
def setup():
    from quads.model.config import ModelConfig
    from quads.model.transformer import MoEForCausalLM
    from quads.quant import get_recipe, quantize_model

    torch.manual_seed(0)
    model = MoEForCausalLM(ModelConfig.preset("tiny", n_layers=2, dtype="float32", vocab_size=128, init_std=0.08))
    quantize_model(model, get_recipe("fp8"), side="rollout", verbose=False)
    g = torch.Generator().manual_seed(1)
    seqs = [[1] + torch.randint(4, 128, (n,), generator=g).tolist() for n in (9, 14)]
    rec: dict[str, list] = {n: [] for n in EXPERTS}
    hooks = [model.get_submodule(n).register_forward_pre_hook(
        lambda m, a, n=n: rec[n].append(tuple(t.detach().clone() for t in a[:3]))) for n in EXPERTS]
    want = quads_prompt_logprobs(model, seqs)
    for h in hooks:
        h.remove()
    return model, seqs, rec, want


def _edit(rec, layer, i, fn):
    out = {n: list(calls) for n, calls in rec.items()}
    out[layer][0] = tuple(fn(t) if j == i else t for j, t in enumerate(out[layer][0]))
    return out


def test_replay_of_the_same_inputs_is_exact(setup):
    model, seqs, rec, want = setup
    with replay_layer_inputs(model, rec) as used:
        got = quads_prompt_logprobs(model, seqs)
    assert used == {n: sum(len(s) for s in seqs) for n in EXPERTS}
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_replay_refuses_what_rounding_cannot_explain(setup):
    model, seqs, rec, _ = setup
    bad = _edit(rec, EXPERTS[1], 0, lambda x: x * (1 + 1e-3))  # a wrong norm / attention upstream, not rounding
    with pytest.raises(AssertionError, match="differs from quads'"), replay_layer_inputs(model, bad):
        quads_prompt_logprobs(model, seqs)
    near = _edit(rec, EXPERTS[1], 0, lambda x: x * (1 + 1e-6))  # rounding-sized: accepted, and replayed
    with replay_layer_inputs(model, near):
        quads_prompt_logprobs(model, seqs)
    other = _edit(rec, EXPERTS[0], 1, lambda ids: (ids + 1) % 8)  # another routing
    with pytest.raises(AssertionError, match="other experts"), replay_layer_inputs(model, other):
        quads_prompt_logprobs(model, seqs)
    more = {n: calls + calls[:1] for n, calls in rec.items()}  # vLLM computed rows quads' forward never did
    with pytest.raises(AssertionError, match="never computed"), replay_layer_inputs(model, more):
        quads_prompt_logprobs(model, seqs)
