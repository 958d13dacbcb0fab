"""The promotion gate: promotes a better candidate, refuses one inside the margin and records why."""

from __future__ import annotations

import pytest

from tasks.registry import decide


def test_decide_lower_and_higher_is_better():
    assert decide(9.0, None, 0.1, False) == (True, "no champion yet")
    assert decide(9.0, 10.0, 0.05, False)[0] is True
    assert decide(9.8, 10.0, 0.05, False)[0] is False  # better, but not by 5%
    assert decide(0.80, 0.70, 0.1, True)[0] is True
    assert decide(0.75, 0.70, 0.1, True)[0] is False
    assert decide(None, 10.0, 0.0, False)[0] is False
    assert decide(float("nan"), 10.0, 0.0, False)[0] is False
    assert decide(float("nan"), None, 0.0, False)[0] is False  # not even as the first champion


def test_promotion_gate_promotes_and_refuses(lab_env):
    from mlflow import MlflowClient
    from prefect import flow

    from tasks import tracking
    from tasks.registry import promote

    @flow
    def gate_flow(version: str, **gate) -> dict:
        return promote(version=version, **gate)

    client = MlflowClient()
    run_id = tracking.start_run("gate-test")
    client.log_text(run_id, "placeholder", "model/README.txt")
    source = f"runs:/{run_id}/model"
    name = "gate-lm"
    client.create_registered_model(name)

    def new_version(ppl: float) -> str:
        version = client.create_model_version(
            name,
            source,
            run_id,
            tags={
                "metric.eval.validation_ppl": str(ppl),
                "eval.text_sha256": "same text",
                "eval.tokenizer_sha256": "same tokenizer",
            },
        )
        return str(version.version)

    gate = dict(
        name=name, metric="eval.validation_ppl", margin=0.02, higher_is_better=False, parent_run_id=run_id
    )
    assert gate_flow(new_version(10.0), **gate)["promoted"] is True  # the first one becomes champion
    refused = gate_flow(new_version(9.9), **gate)  # 1% better: inside the 2% margin
    assert refused["promoted"] is False and refused["champion"] == "1"
    assert str(client.get_model_version_by_alias(name, "champion").version) == "1"
    tags = client.get_model_version(name, "2").tags
    assert tags["promotion.decision"] == "kept_champion" and "does not beat" in tags["promotion.reason"]
    assert client.get_run(run_id).data.tags["promotion.decision"] == "kept_champion"
    assert gate_flow(new_version(9.0), **gate)["promoted"] is True
    assert str(client.get_model_version_by_alias(name, "champion").version) == "3"
    tracking.end_run(run_id)


@pytest.mark.parametrize("margin", [-0.1])
def test_promotion_params_reject_a_negative_margin(margin):
    from pydantic import ValidationError

    from flows.params import PromotionParams

    with pytest.raises(ValidationError):
        PromotionParams(margin=margin)
