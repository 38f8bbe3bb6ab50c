"""Importance-sampling corrections (quads.rl.correction) on hand-made log-probs."""

import math

import pytest
import torch

from quads.rl.correction import CorrectionConfig, is_correction


def _inputs():
    rho = torch.tensor([[1.0, 3.0, 0.4, 1.1], [0.25, 1.0, 1.0, 9.0]])
    logp_rollout = torch.log(torch.tensor([[0.5, 0.2, 0.5, 0.5], [0.8, 0.3, 0.3, 0.1]]))
    logp_old = logp_rollout + torch.log(rho)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]])  # last token is padding
    return logp_old, logp_rollout, mask, rho


def test_none():
    lo, lr, m, _ = _inputs()
    c = is_correction(lo, lr, m, CorrectionConfig(kind="none"))
    assert torch.equal(c.weights, m) and torch.equal(c.mask, m)
    assert c.metrics["correction/token_drop_frac"] == 0.0


def test_tis_caps_weights():
    lo, lr, m, rho = _inputs()
    c = is_correction(lo, lr, m, CorrectionConfig(kind="tis", cap=2.0))
    expected = torch.tensor([[1.0, 2.0, 0.4, 1.1], [0.25, 1.0, 1.0, 0.0]])
    torch.testing.assert_close(c.weights, expected, atol=1e-6, rtol=0)
    assert torch.equal(c.mask, m)
    assert c.metrics["correction/capped_frac"] == pytest.approx(1 / 7)
    assert c.metrics["correction/weight_mean"] == pytest.approx((1 + 2 + 0.4 + 1.1 + 0.25 + 1 + 1) / 7, abs=1e-6)
    assert not c.weights.requires_grad


def test_icepop_masks_tokens_outside_band():
    lo, lr, m, _ = _inputs()
    c = is_correction(lo, lr, m, CorrectionConfig(kind="icepop", low=0.5, high=2.0))
    keep = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 0.0]])
    assert torch.equal(c.mask, keep)
    assert torch.equal(c.weights, keep)
    assert c.metrics["correction/token_drop_frac"] == pytest.approx(3 / 7)
    assert c.metrics["correction/seq_drop_frac"] == 0.0


def test_seq_mask_geometric_mean():
    lo, lr, m, _ = _inputs()
    # row 0: geo mean = (1 * 3 * 0.4 * 1.1)^(1/4) = 1.32^(1/4) ~ 1.072 -> kept
    # row 1: geo mean = (0.25 * 1 * 1)^(1/3) ~ 0.63 -> kept with low=0.5, dropped with low=0.7
    c = is_correction(lo, lr, m, CorrectionConfig(kind="seq_mask", low=0.5, high=2.0))
    assert torch.equal(c.mask, m)
    c2 = is_correction(lo, lr, m, CorrectionConfig(kind="seq_mask", low=0.7, high=2.0))
    assert torch.equal(c2.mask, torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]))
    assert c2.metrics["correction/seq_drop_frac"] == pytest.approx(0.5)
    assert c2.metrics["correction/token_drop_frac"] == pytest.approx(3 / 7)
    assert 0.25 ** (1 / 3) == pytest.approx(0.63, abs=0.01) and 1.32 ** 0.25 < 2.0
    assert not math.isnan(c2.metrics["correction/weight_mean"])


def test_config_errors():
    with pytest.raises(ValueError, match="correction.kind"):
        CorrectionConfig(kind="clip")
    with pytest.raises(ValueError, match="low < 1 < high"):
        CorrectionConfig(kind="icepop", low=0.5, high=0.9)
