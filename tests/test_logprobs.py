"""Trainer-side log-probs: one full forward over padded prompt + response, per-token log-probs, entropy,
gradients, routing replay."""

import pytest
import torch

from quads.model import ModelConfig, MoEForCausalLM
from quads.rl.logprobs import SequenceBatch, forward_logprobs, sequence_logprobs, to_sequence_batch

SMALL = dict(vocab_size=128, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, n_experts=4,
             top_k=2, moe_intermediate_size=32, max_seq_len=64, dtype="float64")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return MoEForCausalLM(ModelConfig(**SMALL))


def pack(prompts, responses, pad=0):
    """The engine layout: left-padded prompt block, right-padded response block."""
    P, R = max(map(len, prompts)), max(map(len, responses))
    ids = torch.full((len(prompts), P + R), pad, dtype=torch.long)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, P - len(p):P], mask[i, P - len(p):P] = torch.tensor(p), True
        ids[i, P:P + len(r)], mask[i, P:P + len(r)] = torch.tensor(r), True
    return SequenceBatch(ids, mask, P, mask[:, P:].clone())


def reference(model, prompt, response, temperature=1.0):
    """Unpadded, one sequence at a time, straight from the logits."""
    ids = torch.tensor([prompt + response])
    logits = model(ids).logits[0, len(prompt) - 1:-1] / temperature
    logp = torch.log_softmax(logits, -1)
    return logp.gather(1, torch.tensor(response)[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)


def test_matches_unpadded_reference(model):
    torch.manual_seed(1)
    prompts = [torch.randint(4, 128, (n,)).tolist() for n in (5, 2, 8)]
    responses = [torch.randint(4, 128, (n,)).tolist() for n in (6, 3, 1)]
    batch = pack(prompts, responses)
    for temperature in (1.0, 0.6):
        logp, ent = sequence_logprobs(model, batch, temperature=temperature, return_entropy=True)
        assert logp.shape == (3, 6) and ent.shape == (3, 6)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            ref_lp, ref_ent = reference(model, p, r, temperature)
            torch.testing.assert_close(logp[i, :len(r)], ref_lp, atol=1e-10, rtol=0)
            torch.testing.assert_close(ent[i, :len(r)], ref_ent, atol=1e-10, rtol=0)
            assert (logp[i, len(r):] == 0).all() and (ent[i, len(r):] == 0).all()


def test_gradients_flow_and_routing_replay(model):
    batch = pack([[5, 6, 7], [9]], [[10, 11], [12, 13, 14]])
    res = forward_logprobs(model, batch, return_routing=True)
    res.logprobs.sum().backward()
    assert model.lm_head.weight.grad is not None and model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)
    forced = (res.routing + 1) % 4
    replay = forward_logprobs(model, batch, routing=forced, return_routing=True)
    assert torch.equal(replay.routing, forced)
    assert (replay.logprobs - res.logprobs).abs().max() > 1e-6
    same = forward_logprobs(model, batch, routing=res.routing)
    torch.testing.assert_close(same.logprobs, res.logprobs.detach(), atol=0, rtol=0)


def test_sequence_batch_validation_and_conversion(model):
    with pytest.raises(ValueError, match="prompt_len"):
        SequenceBatch(torch.zeros(2, 5, dtype=torch.long), torch.ones(2, 5, dtype=torch.bool), 5,
                      torch.ones(2, 0, dtype=torch.bool))
    batch = pack([[5, 6], [7]], [[8], [9, 10]])
    seq = to_sequence_batch(batch)
    assert seq is batch
    with pytest.raises(ValueError, match="temperature"):
        sequence_logprobs(model, batch, temperature=0)
