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


def _unfused(logits, target, temperature):
    """The plain formula: full fp32 (fp64) log_softmax, gather, entropy."""
    logp_all = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, -1)
    return logp_all.gather(-1, target[..., None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


@pytest.mark.parametrize("chunk", [1 << 24, 37 * 5, 37], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_token_logprobs_match_log_softmax(dtype, chunk):
    """Values and gradients (of a loss using both outputs) against the unfused formula, any chunking
    (one chunk, several, one row each); fp64 to 1e-12, fp32 / bf16 logits (fp32 arithmetic) to 1e-5."""
    from quads.rl.logprobs import token_logprobs

    torch.manual_seed(0)
    logits = (3 * torch.randn(3, 7, 37, dtype=torch.float64)).to(dtype)
    target = torch.randint(0, 37, (3, 7))
    g_lp, g_ent = torch.randn(3, 7, dtype=torch.float64), torch.randn(3, 7, dtype=torch.float64)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for temp in (1.0, 0.7):
        got, want = [], []
        for fused, out in ((True, got), (False, want)):
            x = logits.clone().requires_grad_()
            lp, ent = token_logprobs(x, target, temp, True, chunk) if fused else _unfused(x, target, temp)
            ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
            out += [lp.detach(), ent.detach(), x.grad.float()]
        for name, a, b in zip(("logp", "entropy", "grad"), got, want):
            torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=lambda m, n=name, t=temp: f"{n} T={t}: {m}")
    lp_only, none = token_logprobs(logits, target, 1.0, False, chunk)
    assert none is None and torch.equal(lp_only, token_logprobs(logits, target, 1.0, True, chunk)[0])


def test_token_logprobs_gradcheck_fp64():
    from quads.rl.logprobs import token_logprobs

    torch.manual_seed(1)
    logits = torch.randn(5, 11, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 11, (5,))
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, target, 0.8, True, 22), (logits,))
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, target, 1.3, False, 11)[0], (logits,))
    with pytest.raises(ValueError, match="target of shape"):
        token_logprobs(logits, target[:4])
