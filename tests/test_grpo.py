"""GRPO advantages and clipped loss (quads.rl.grpo) against values computed by hand."""

import math

import pytest
import torch

from quads.rl.grpo import GRPOLossConfig, group_advantages, group_stats, grpo_loss


def test_advantages_std_norm_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    a = group_advantages(r, 4, std_norm=True, eps=0.0)
    # group 0: mean 0.5, unbiased std sqrt(((0.5^2) * 4) / 3) = sqrt(1/3)
    s = math.sqrt(1.0 / 3.0)
    expected = torch.tensor([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(a[:4], expected[:4], atol=1e-6, rtol=0)
    # group 1: all equal -> 0 advantage (0 / (0 + eps)), with the default eps no NaN
    a_eps = group_advantages(r, 4)
    assert torch.equal(a_eps[4:], torch.zeros(4))


def test_advantages_without_std_dr_grpo():
    r = torch.tensor([3.0, 1.0, 2.0, 2.0, 5.0, 1.0])
    a = group_advantages(r, 3, std_norm=False)
    torch.testing.assert_close(a, torch.tensor([1.0, -1.0, 0.0, -0.6666667, 2.3333333, -1.6666667]))


def test_advantages_bad_inputs():
    with pytest.raises(ValueError, match="multiple of group_size"):
        group_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        group_advantages(torch.zeros(4), 1)


def test_group_stats():
    s = group_stats(torch.tensor([1.0, 1.0, 0.0, 1.0]), 2)
    assert s["reward/mean"] == pytest.approx(0.75)
    assert s["reward/zero_std_frac"] == pytest.approx(0.5)


def _tiny():
    # B=2, L=3; the second row has one padding token
    logp_old = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.4, 0.4, 0.9]]))
    ratio = torch.tensor([[1.5, 0.7, 1.0], [0.9, 1.3, 7.0]])
    logp = (logp_old + torch.log(ratio)).requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([1.0, -2.0])
    return logp, logp_old, adv, mask, ratio


def test_clipped_loss_by_hand_token_mean():
    logp, logp_old, adv, mask, _ = _tiny()
    cfg = GRPOLossConfig(clip_low=0.2, clip_high=0.28)
    loss, m = grpo_loss(logp, logp_old, adv, mask, cfg)
    # row 0, A=+1: ratios 1.5 (clipped to 1.28), 0.7 (max(-0.7, -0.8) = -0.7, unclipped), 1.0
    #   per-token losses: -1.28, -0.7, -1.0
    # row 1, A=-2: ratios 0.9 -> max(1.8, 1.8) = 1.8; 1.3 -> max(2.6, 2.56) = 2.6 (unclipped); pad
    expected = (-1.28 - 0.7 - 1.0 + 1.8 + 2.6) / 5
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert m["loss/policy"] == pytest.approx(expected, abs=1e-6)
    assert m["loss/clip_frac"] == pytest.approx(1 / 5)  # only the 1.5 token
    assert m["loss/clip_frac_high"] == pytest.approx(1 / 5)
    assert m["loss/clip_frac_low"] == pytest.approx(0.0)
    loss.backward()
    g = logp.grad
    # gradient of -A*ratio wrt logp is -A*ratio/denom where unclipped, 0 where clipped or padded
    exp_g = torch.tensor([[0.0, -0.7, -1.0], [2 * 0.9, 2 * 1.3, 0.0]]) / 5
    torch.testing.assert_close(g, exp_g, atol=1e-6, rtol=0)


def test_seq_mean_and_explicit_denominator():
    logp, logp_old, adv, mask, _ = _tiny()
    cfg = GRPOLossConfig(clip_low=0.2, clip_high=0.28, agg="seq_mean")
    loss, _ = grpo_loss(logp, logp_old, adv, mask, cfg)
    expected = ((-1.28 - 0.7 - 1.0) / 3 + (1.8 + 2.6) / 2) / 2
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    # token_mean with the denominator of a larger batch: sum over two halves == the whole
    cfg_t = GRPOLossConfig(clip_low=0.2, clip_high=0.28)
    full, _ = grpo_loss(logp, logp_old, adv, mask, cfg_t)
    parts = sum(grpo_loss(logp[i:i + 1], logp_old[i:i + 1], adv[i:i + 1], mask[i:i + 1], cfg_t,
                          denom=mask.sum().item())[0] for i in range(2))
    assert parts.item() == pytest.approx(full.item(), abs=1e-6)


def test_is_weights_kl_entropy():
    logp, logp_old, adv, mask, _ = _tiny()
    w = torch.tensor([[2.0, 1.0, 0.5], [1.0, 0.0, 1.0]])
    logp_ref = logp_old.clone()
    ent = torch.full_like(logp_old, 0.3)
    cfg = GRPOLossConfig(clip_low=0.2, clip_high=0.28, kl_coef=0.1, entropy_coef=0.01)
    loss, m = grpo_loss(logp, logp_old, adv, mask, cfg, is_weights=w, logp_ref=logp_ref, entropy=ent)
    pg = (-1.28 * 2 - 0.7 - 1.0 * 0.5 + 1.8 + 0.0) / 5
    ratio = torch.tensor([1.5, 0.7, 1.0, 0.9, 1.3])
    r = -torch.log(ratio)  # logp_ref - logp
    kl = (torch.exp(r) - r - 1).mean().item()
    expected = pg + 0.1 * kl - 0.01 * 0.3
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert m["loss/kl"] == pytest.approx(kl, abs=1e-6)
    assert m["loss/entropy"] == pytest.approx(0.3, abs=1e-6)
    assert m["loss/policy"] == pytest.approx(pg, abs=1e-6)


def test_config_validation():
    with pytest.raises(ValueError, match="clip_low"):
        GRPOLossConfig(clip_low=1.5)
    with pytest.raises(ValueError, match="agg"):
        GRPOLossConfig(agg="sum")
    with pytest.raises(ValueError, match="same"):
        grpo_loss(torch.zeros(2, 3), torch.zeros(2, 2), torch.zeros(2), torch.ones(2, 3), GRPOLossConfig())


def test_correction_none_is_the_on_policy_grpo_formula():
    """The paper's naive baseline: no IS correction. On a hand-made batch whose rollout log-probs differ from
    the trainer's, loss and gradient are on-policy GRPO's, -sum_t A_b / n_tokens, with d/dlogp_bt = -A_b / n;
    the mismatch to the rollout is ignored (TIS, on the same batch, is not)."""
    from quads.rl.correction import CorrectionConfig, is_correction

    logp_old = torch.tensor([[-1.0, -0.5, -2.0, -0.1], [-0.3, -1.2, -0.7, -4.0]], dtype=torch.float64)
    logp_rollout = logp_old + torch.tensor([[0.9, -0.6, 1.5, 0.0], [-2.0, 0.3, 0.1, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    adv = torch.tensor([0.75, -1.5], dtype=torch.float64)
    cfg = GRPOLossConfig()

    def run(kind):
        corr = is_correction(logp_old, logp_rollout, mask, CorrectionConfig(kind=kind))
        logp = logp_old.clone().requires_grad_(True)  # first optimizer step: logp = logp_old, ratio 1
        loss, _ = grpo_loss(logp, logp_old, adv, corr.mask, cfg, is_weights=corr.weights)
        loss.backward()
        return loss.item(), logp.grad

    loss, grad = run("none")
    n = 7.0  # response tokens
    assert loss == -(3 * 0.75 - 4 * 1.5) / n
    assert torch.equal(grad, -adv[:, None] * mask / n)
    tis_loss, tis_grad = run("tis")
    assert tis_loss != loss and not torch.equal(tis_grad, grad)  # the test sees a correction when there is one
