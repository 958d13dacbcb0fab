"""`LogInterval`: a logged row averages losses over the interval's finite steps only; throughput counts every step."""

import pytest

from moe_core.train.interval import AVERAGED, LogInterval


def _stats(loss: float, finite: bool = True) -> dict[str, float]:
    return {
        "loss": loss,
        "lm_loss": loss - 0.5,
        "aux_loss": 0.25,
        "z_loss": 0.125,
        "grad_norm": 2 * loss,
        "lr": 1e-3,
        "finite": float(finite),
    }


def test_means_skip_non_finite_steps_but_steps_and_time_count_them():
    interval = LogInterval()
    interval.add(_stats(2.0), 0.5)
    interval.add(_stats(float("nan"), finite=False), 0.25)
    interval.add(_stats(4.0), 0.25)
    assert interval.steps == 3 and interval.finite_steps == 2
    assert interval.seconds == pytest.approx(1.0)
    assert interval.means() == {
        "loss": 3.0,
        "lm_loss": 2.5,
        "aux_loss": 0.25,
        "z_loss": 0.125,
        "grad_norm": 6.0,
    }
    assert tuple(interval.means()) == AVERAGED  # the logged order


def test_an_interval_of_skipped_steps_logs_no_loss():
    interval = LogInterval()
    interval.add(_stats(float("inf"), finite=False), 0.1)
    assert interval.means() == {}
    assert interval.steps == 1
