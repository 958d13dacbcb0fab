"""Routing alerts raised by the trainer's RoutingMonitor: a dead expert after N logged steps under the
threshold (and cleared when it recovers), load collapse and drops over their thresholds."""

import io

import numpy as np

from moe_core.train.alerts import AlertThresholds, RoutingMonitor
from moe_core.train.load_log import read_sidecar


def metrics(shares, drop=0.0, max_over_mean=None):
    E = len(shares)
    out = {f"moe/layer_0/expert_{e}_frac": s for e, s in enumerate(shares)}
    out["moe/layer_0/drop_rate"] = drop
    out["moe/layer_0/entropy"] = 1.0
    out["moe/layer_0/max_over_mean_load"] = max_over_mean if max_over_mean is not None else max(shares) * E
    return out


def test_alerts_follow_their_thresholds(tmp_path):
    log = io.StringIO()
    m = RoutingMonitor(
        tmp_path,
        [0],
        4,
        AlertThresholds(dead_steps=2, dead_share=0.05, max_over_mean=2.5, drop_rate=0.1),
        stream=log,
    )
    starved = [0.4, 0.3, 0.3, 0.0]
    assert m.observe(1, metrics(starved)) == {}  # one step under: not yet
    assert m.observe(2, metrics(starved)) == {"alert/dead_expert/layer_0/expert_3": 0.0}
    assert m.observe(3, metrics([0.3, 0.3, 0.3, 0.1])) == {}  # recovered: cleared, streak reset
    assert m.observe(4, metrics(starved)) == {}
    collapsed = m.observe(5, metrics([0.7, 0.1, 0.1, 0.1], drop=0.3))
    assert set(collapsed) == {"alert/load_collapse/layer_0", "alert/drops/layer_0"}
    assert (
        abs(collapsed["alert/load_collapse/layer_0"] - 2.8) < 1e-6 and collapsed["alert/drops/layer_0"] == 0.3
    )
    m.close()
    assert log.getvalue().count("routing alert alert/dead_expert") == 1  # printed when raised, not every step
    header, rows = read_sidecar(tmp_path)
    assert rows[:, 0].tolist() == [1, 2, 3, 4, 5]
    np.testing.assert_allclose(rows[0, 2:6], starved)


def test_disabled_alerts_and_dense_models_write_nothing(tmp_path):
    m = RoutingMonitor(tmp_path / "a", [0], 4, AlertThresholds(enabled=False))
    assert m.observe(1, metrics([1.0, 0.0, 0.0, 0.0])) == {}
    m.close()
    dense = RoutingMonitor(tmp_path / "b", [], 0, AlertThresholds())
    assert dense.observe(1, {"loss": 1.0}) == {} and read_sidecar(tmp_path / "b") is None


def test_per_expert_off_keeps_bias_and_shares_in_the_load_log_only(tmp_path):
    import torch

    from moe_core.train.telemetry import RoutingStats

    class AuxFree:  # what RoutingMonitor reads of an aux-free router: its bias buffer
        expert_bias = torch.tensor([0.5, -0.5, 0.0, 0.25])

    stats = RoutingStats(1, 4)
    stats.sums_LX[0, :4] = torch.tensor([4.0, 2.0, 2.0, 0.0])
    stats.reset()  # as the loop does after logging: the interval's sums stay readable
    m = RoutingMonitor(tmp_path, [0], 4, AlertThresholds(), [AuxFree()], stats, per_expert=False)
    added = m.observe(
        1, {"moe/layer_0/drop_rate": 0.0, "moe/layer_0/entropy": 1.0, "moe/layer_0/max_over_mean_load": 2.0}
    )
    m.close()
    assert not any("bias" in k or "frac" in k for k in added)
    header, rows = read_sidecar(tmp_path)
    b0, b1 = header["per_layer"]["bias"]
    np.testing.assert_allclose(rows[0, 2:6], [0.5, 0.25, 0.25, 0.0])  # shares from the routing sums
    np.testing.assert_allclose(rows[0, 2 + b0 : 2 + b1], [0.5, -0.5, 0.0, 0.25])
