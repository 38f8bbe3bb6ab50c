"""Mismatch metrics (quads.metrics.mismatch) against hand-computed values."""

import math

import pytest
import torch

from quads.metrics.mismatch import mismatch_metrics, routing_diff


def _inputs():
    logp_rollout = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, -9.0]])
    d = torch.tensor([[0.0, math.log(3.0), math.log(0.4)], [math.log(0.1), 0.2, 5.0]])  # log rho
    logp_train = logp_rollout + d
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # last token is padding
    return logp_train, logp_rollout, mask


def test_metrics_by_hand():
    lt, lr, m = _inputs()
    out = mismatch_metrics(lt, lr, m, probe_tokens=3)
    rho = [1.0, 3.0, 0.4, 0.1, math.exp(0.2)]
    logr = [math.log(x) for x in rho]
    n = 5
    assert out["mismatch/tokens"] == 5
    assert out["mismatch/logp_gap_max"] == pytest.approx(math.log(10.0), rel=1e-6)
    assert out["mismatch/logp_gap_mean"] == pytest.approx(sum(abs(x) for x in logr) / n, rel=1e-6)
    assert out["mismatch/k1"] == pytest.approx(-sum(logr) / n, rel=1e-5)
    assert out["mismatch/k3"] == pytest.approx(sum(r - lg - 1 for r, lg in zip(rho, logr)) / n, rel=1e-5)
    assert out["mismatch/chi2"] == pytest.approx(sum(r * r for r in rho) / n - 1, rel=1e-5)
    assert out["mismatch/frac_rho_outside_0.5_2"] == pytest.approx(3 / 5)  # 3.0, 0.4, 0.1
    assert out["mismatch/frac_rho_outside_0.2_5"] == pytest.approx(1 / 5)  # 0.1
    # probe: first 3 response tokens in row-major order: rho 1, 3, 0.4
    assert out["mismatch/logp_gap_max_probe"] == pytest.approx(math.log(3.0), rel=1e-6)
    # ppl per sequence
    ppl_r = [math.exp((1 + 2 + 0.5) / 3), math.exp((0.1 + 3.0) / 2)]
    lt_rows = [[-1.0, -2.0 + logr[1], -0.5 + logr[2]], [-0.1 + logr[3], -3.0 + 0.2]]
    ppl_t = [math.exp(-sum(r) / len(r)) for r in lt_rows]
    assert out["mismatch/ppl_ratio"] == pytest.approx((ppl_r[0] / ppl_t[0] + ppl_r[1] / ppl_t[1]) / 2, rel=1e-5)
    assert out["mismatch/ppl_rollout"] == pytest.approx(sum(ppl_r) / 2, rel=1e-5)
    assert "mismatch/routing_diff" not in out


def test_probe_nan_when_too_few_tokens_and_identical_inputs_zero():
    lt, lr, m = _inputs()
    out = mismatch_metrics(lt, lr, m, probe_tokens=6)
    assert math.isnan(out["mismatch/logp_gap_max_probe"])
    same = mismatch_metrics(lr, lr, m)
    for k in ("logp_gap_max", "logp_gap_mean", "k1", "k3", "chi2"):
        assert same[f"mismatch/{k}"] == pytest.approx(0.0, abs=1e-7)
    assert same["mismatch/ppl_ratio"] == pytest.approx(1.0)


def test_routing_diff_sets_not_order():
    # [n_layers=2, B=1, L=3, k=2]
    a = torch.tensor([[[[0, 1], [2, 3], [4, 5]]], [[[0, 1], [1, 2], [3, 4]]]])
    b = torch.tensor([[[[1, 0], [2, 4], [4, 5]]], [[[0, 1], [1, 2], [7, 4]]]])
    # differing sets: layer0 token1, layer1 token2 -> 2 of 6
    assert routing_diff(a, b) == pytest.approx(2 / 6)
    mask = torch.tensor([[1, 1, 0]])  # drop token 2 -> 1 of 4
    assert routing_diff(a, b, mask) == pytest.approx(1 / 4)
    lp = torch.zeros(1, 3)
    out = mismatch_metrics(lp, lp, mask, routing_train=a, routing_rollout=b, layer_errors={"layers.0.mlp": 0.05})
    assert out["mismatch/routing_diff"] == pytest.approx(1 / 4)
    assert out["mismatch/layer_err/layers.0.mlp"] == pytest.approx(0.05)


def test_empty_and_bad_shapes():
    out = mismatch_metrics(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2))
    assert out["mismatch/tokens"] == 0 and math.isnan(out["mismatch/k3"])
    with pytest.raises(ValueError, match="same"):
        mismatch_metrics(torch.zeros(1, 2), torch.zeros(1, 3), torch.zeros(1, 2))
    with pytest.raises(ValueError, match="routing"):
        routing_diff(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 3, 2))
