"""RoutingStats: the trainer's per-layer routing sums read back once per logging step, equal to the plain
per-token formulas (entropy of normalized scores, shares, drop rate), and the monitor's load row from them."""

import math

import numpy as np
import torch

from moe_core.routing import RoutingRecord
from moe_core.train.alerts import AlertThresholds, RoutingMonitor
from moe_core.train.load_log import read_sidecar
from moe_core.train.telemetry import ENTROPY_TOKENS, RoutingStats


def record(probs_TE: torch.Tensor, K: int = 2, dropped: float = 0.0, seed: int = 0) -> RoutingRecord:
    T, E = probs_TE.shape
    ids_TK = probs_TE.topk(K, -1).indices
    g = torch.Generator().manual_seed(seed)
    dropped_TK = torch.rand(T, K, generator=g) < dropped
    return RoutingRecord(
        expert_ids_TK=ids_TK,
        weights_TK=probs_TE.gather(-1, ids_TK),
        dropped_TK=dropped_TK,
        probs_TE=probs_TE,
        logits_TE=probs_TE.log(),
        tokens_per_expert_E=torch.bincount(ids_TK.flatten(), minlength=E),
    )


def reference_entropy(probs_TE: torch.Tensor) -> float:
    p = probs_TE.double() / probs_TE.double().sum(-1, keepdim=True)
    return float(-(p * p.clamp_min(1e-300).log()).sum(-1).mean())


def test_metrics_equal_the_per_token_formulas_for_softmax_and_sigmoid_scores():
    g = torch.Generator().manual_seed(0)
    E = 8
    softmax_TE = torch.softmax(torch.randn(300, E, generator=g), -1)
    sigmoid_TE = torch.sigmoid(torch.randn(200, E, generator=g))  # scores that do not sum to 1
    stats = RoutingStats(2, E)
    recs = (record(softmax_TE, dropped=0.1), record(sigmoid_TE, dropped=0.3, seed=1))
    stats.add(recs)
    out = stats.metrics([1, 3])
    for layer, (probs_TE, rec) in zip([1, 3], zip((softmax_TE, sigmoid_TE), recs)):
        counts_E = torch.bincount(rec.expert_ids_TK.flatten(), minlength=E).double()
        prefix = f"moe/layer_{layer}/"
        assert math.isclose(out[prefix + "entropy"], reference_entropy(probs_TE), rel_tol=1e-5)
        assert math.isclose(out[prefix + "drop_rate"], rec.dropped_TK.sum().item() / counts_E.sum().item())
        shares = [out[prefix + f"expert_{e}_frac"] for e in range(E)]
        np.testing.assert_allclose(shares, (counts_E / counts_E.sum()).numpy())
        assert math.isclose(out[prefix + "max_over_mean_load"], max(shares) * E)
    assert not any("frac" in k for k in stats.metrics([1, 3], per_expert=False))


def test_expert_choice_drop_rate_is_the_share_of_tokens_no_expert_took():
    """Expert choice's K = E slots enumerate the experts, so most are 'dropped' by construction (1 - C/T);
    its drop rate is the share of tokens left without any expert (they skip the FFN)."""
    from moe_core.config import MoEConfig
    from moe_core.routing import build_router

    torch.manual_seed(0)
    E, T = 8, 64
    router = build_router(
        MoEConfig(num_experts=E, num_experts_per_tok=2, hidden_size=16, router="expert_choice")
    )
    rec = router.route(torch.randn(T, E))
    assert not rec.slots_are_choices and rec.dropped_TK.float().mean() > 0.7  # 1 - 2/8 of the slots
    stats = RoutingStats(1, E)
    stats.add((rec,))
    out = stats.metrics([0])
    assert math.isclose(out["moe/layer_0/drop_rate"], rec.dropped_tokens_T.float().mean().item())
    assert out["moe/layer_0/drop_rate"] < 0.2  # C = 2T/E per expert leaves few tokens without an expert


def test_entropy_of_a_long_batch_is_a_close_strided_estimate():
    g = torch.Generator().manual_seed(1)
    T, E = 16 * ENTROPY_TOKENS, 16
    # per-token entropies that vary along the batch: a strided sample must still see all of them
    temperature_T1 = torch.linspace(0.2, 3.0, T).unsqueeze(1)
    probs_TE = torch.softmax(torch.randn(T, E, generator=g) / temperature_T1, -1)
    stats = RoutingStats(1, E)
    stats.add((record(probs_TE),))
    got = stats.metrics([0])["moe/layer_0/entropy"]
    assert abs(got - reference_entropy(probs_TE)) < 0.01 * reference_entropy(probs_TE)
    counts = stats.sums_LX[0, :E].sum().item()
    assert counts == T * 2  # the shares still count every routed slot


def test_monitor_load_row_comes_from_the_sums_without_per_expert_keys(tmp_path):
    E = 4
    probs_TE = torch.tensor([[0.7, 0.1, 0.1, 0.1]] * 7 + [[0.1, 0.7, 0.1, 0.1]])
    stats = RoutingStats(1, E)
    stats.add((record(probs_TE, K=1),))
    metrics = stats.metrics([0], per_expert=False)
    stats.reset()
    monitor = RoutingMonitor(tmp_path, [0], E, AlertThresholds(dead_steps=1), [], stats, per_expert=False)
    added = monitor.observe(1, {**metrics, "tokens": 8.0})
    monitor.close()
    header, rows = read_sidecar(tmp_path)
    np.testing.assert_allclose(rows[0, 2 : 2 + E], [0.875, 0.125, 0.0, 0.0])
    assert set(added) == {
        "alert/dead_expert/layer_0/expert_2",
        "alert/dead_expert/layer_0/expert_3",
        "alert/load_collapse/layer_0",
    }
    assert float(stats.sums_LX.abs().sum()) == 0.0  # reset for the next interval
