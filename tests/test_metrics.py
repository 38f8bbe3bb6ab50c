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


def test_framework_aliases_match_their_definitions():
    """verl's rollout_corr/* and TRL's sampling/* names against a plain per-sequence loop in fp64, on a
    batch with an empty row and one huge log ratio (verl clamps log rho at +-20 in its chi^2 metrics)."""
    import math

    from quads.metrics.mismatch import framework_aliases

    g = torch.Generator().manual_seed(0)
    lt = -torch.rand(4, 7, generator=g, dtype=torch.float64) * 3
    lr = lt + 0.1 * torch.randn(4, 7, generator=g, dtype=torch.float64)
    mask = torch.ones(4, 7, dtype=torch.bool)
    mask[1] = False  # an empty sequence: left out of the per-sequence means
    mask[2, 4:] = False
    lr[3, 2] = lt[3, 2] - 30.0  # log rho = 30: beyond the clamp
    got = framework_aliases(lt, lr, mask)

    toks = [(float(lt[b, t]), float(lr[b, t])) for b in range(4) for t in range(7) if mask[b, t]]
    seqs = [[(float(lt[b, t]), float(lr[b, t])) for t in range(7) if mask[b, t]] for b in range(4) if mask[b].any()]
    clamp = lambda v: max(-20.0, min(20.0, v))  # noqa: E731
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    mt = [mean([a for a, _ in s]) for s in seqs]
    mr = [mean([b for _, b in s]) for s in seqs]
    diff = [r - t for t, r in zip(mt, mr)]
    want = {
        "rollout_corr/kl": mean([b - a for a, b in toks]),
        "rollout_corr/k3_kl": mean([math.exp(a - b) - (a - b) - 1 for a, b in toks]),
        "rollout_corr/chi2_token": mean([math.exp(2 * clamp(a - b)) for a, b in toks]) - 1,
        "rollout_corr/chi2_seq": mean([math.exp(2 * clamp(sum(a - b for a, b in s))) for s in seqs]) - 1,
        "rollout_corr/training_ppl": mean([math.exp(-x) for x in mt]),
        "rollout_corr/rollout_ppl": mean([math.exp(-x) for x in mr]),
        "rollout_corr/training_log_ppl": -mean(mt), "rollout_corr/rollout_log_ppl": -mean(mr),
        "rollout_corr/log_ppl_diff": mean(diff), "rollout_corr/log_ppl_abs_diff": mean([abs(x) for x in diff]),
        "rollout_corr/log_ppl_diff_max": max(diff), "rollout_corr/log_ppl_diff_min": min(diff),
        "rollout_corr/ppl_ratio": mean([math.exp(-t) / math.exp(-r) for t, r in zip(mt, mr)]),  # train / rollout
        "sampling/sampling_logp_difference/mean": mean([abs(a - b) for a, b in toks]),
        "sampling/sampling_logp_difference/max": max(abs(a - b) for a, b in toks),
    }
    assert set(got) == set(want)
    for k, v in want.items():  # the aliases compute in fp32
        assert math.isclose(got[k], v, rel_tol=1e-5, abs_tol=1e-6), (k, got[k], v)
    assert got["rollout_corr/chi2_token"] < math.exp(40)  # clamped: exp(2 * 30) would be 1.1e26

    full = mismatch_metrics(lt, lr, mask)  # emitted beside quads' own names, which agree where they coincide
    assert full["rollout_corr/kl"] == pytest.approx(full["mismatch/k1"], rel=1e-6)
    assert full["sampling/sampling_logp_difference/max"] == pytest.approx(full["mismatch/logp_gap_max"], rel=1e-6)
    assert full["rollout_corr/ppl_ratio"] != pytest.approx(full["mismatch/ppl_ratio"], rel=1e-3)  # other direction
    empty = framework_aliases(lt, lr, torch.zeros_like(mask))
    assert all(math.isnan(v) for v in empty.values())


def test_sequence_metrics_match_a_plain_fp64_loop():
    """Per response: sum_t |d| and sum_t d (d = logp_train - logp_rollout), mean / max over responses."""
    from quads.metrics.mismatch import SEQUENCE_KEYS, sequence_metrics

    g = torch.Generator().manual_seed(1)
    lt = -torch.rand(5, 300, generator=g) * 4  # fp32 inputs, long responses
    lr = lt + 0.05 * torch.randn(5, 300, generator=g)
    mask = torch.ones(5, 300, dtype=torch.bool)
    mask[1] = False  # an empty response is left out
    mask[3, 120:] = False
    lr[4, 7] = lt[4, 7] + 2.0  # one large token gap
    got = mismatch_metrics(lt, lr, mask)
    seqs = [[float(lt[b, t]) - float(lr[b, t]) for t in range(300) if mask[b, t]] for b in range(5) if mask[b].any()]
    gaps = [math.fsum(abs(d) for d in s) for s in seqs]
    ratios = [math.fsum(s) for s in seqs]
    want = {"mismatch/seq_gap_mean": sum(gaps) / len(gaps), "mismatch/seq_gap_max": max(gaps),
            "mismatch/seq_log_ratio_mean": sum(ratios) / len(ratios),
            "mismatch/seq_log_ratio_abs_max": max(abs(r) for r in ratios)}
    for k, v in want.items():
        assert math.isclose(got[k], v, rel_tol=1e-12, abs_tol=1e-12), (k, got[k], v)
    assert got["mismatch/seq_gap_max"] > 100 * got["mismatch/logp_gap_mean"]  # a sum, not a mean, over tokens
    empty = sequence_metrics(lt, lr, torch.zeros_like(mask))
    assert set(empty) == {f"mismatch/{k}" for k in SEQUENCE_KEYS} and all(math.isnan(v) for v in empty.values())
