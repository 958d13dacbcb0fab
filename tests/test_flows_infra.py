"""Configuration checks for what cannot run here: the docker compose stack, the deployments, the CI hook."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_compose_stack_wires_prefect_postgres_mlflow_and_a_worker():
    compose = yaml.safe_load((ROOT / "infra" / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"postgres", "prefect-server", "mlflow", "worker"} <= set(services)
    for name in ("postgres", "prefect-server", "mlflow", "worker"):
        assert services[name]["healthcheck"]["test"], f"{name} has no healthcheck"
    assert "4200:4200" in services["prefect-server"]["ports"]
    assert "5000:5000" in services["mlflow"]["ports"]
    assert (
        "postgres:5432/prefect"
        in services["prefect-server"]["environment"]["PREFECT_SERVER_DATABASE_CONNECTION_URL"]
    )
    assert "postgres:5432/mlflow" in services["mlflow"]["command"]
    assert "CREATE DATABASE mlflow" in (ROOT / "infra" / "postgres-init.sql").read_text()
    for name in ("prefect-server", "mlflow"):
        assert services[name]["depends_on"]["postgres"]["condition"] == "service_healthy"
    worker = services["worker"]
    assert worker["environment"]["PREFECT_API_URL"] == "http://prefect-server:4200/api"
    assert worker["environment"]["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    assert "--pool moe-lab-process" in worker["command"]
    assert {s: c["condition"] for s, c in worker["depends_on"].items()} == {
        "prefect-server": "service_healthy",
        "mlflow": "service_healthy",
    }
    assert (ROOT / worker["build"]["dockerfile"]).is_file()
    assert "--nnodes" in (ROOT / "infra" / "README.md").read_text()  # multi-node torchrun instructions


def test_prefect_yaml_declares_the_same_deployments_as_deploy_py():
    from deployments.deploy import DEPLOYMENTS, NIGHTLY_CRON, WORK_POOL
    from flows.params import LifecycleParams

    spec = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())
    declared = {d["name"]: d for d in spec["deployments"]}
    assert set(declared) == set(DEPLOYMENTS)
    for name, (entrypoint, cron, _) in DEPLOYMENTS.items():
        assert declared[name]["entrypoint"] == entrypoint
        assert declared[name]["work_pool"]["name"] == WORK_POOL
        assert [s["cron"] for s in declared[name].get("schedules", [])] == ([cron] if cron else [])
        module = ROOT / entrypoint.split(":")[0]
        assert module.is_file() and f"def {entrypoint.split(':')[1]}(" in module.read_text()
    assert declared["nightly-retrain"]["schedules"][0]["cron"] == NIGHTLY_CRON
    LifecycleParams.model_validate(declared["nightly-retrain"]["parameters"]["params"])  # valid flow params


def test_ci_workflow_triggers_the_deployment_or_runs_the_flow():
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "retrain.yml").read_text())
    triggers = workflow[True]  # YAML 1.1 reads the key `on` as True
    assert "data/**" in triggers["push"]["paths"] and "workflow_dispatch" in triggers
    steps = " ".join(str(s.get("run", "")) for s in workflow["jobs"]["retrain"]["steps"])
    assert "prefect deployment run 'lifecycle/on-demand'" in steps and "--watch" in steps
    assert "moe-lab run lifecycle" in steps


def test_cli_has_the_orchestration_commands_and_builds_typed_params():
    from flows.cli import build_params
    from moe_lab.cli import build_parser

    parser = build_parser()
    for argv in (["run", "lifecycle"], ["ui"], ["sync", "runs/x"], ["deploy"], ["serve"]):
        assert callable(parser.parse_args(argv).func)
    params = build_params(
        "lifecycle", None, "tiny", ["train.steps=7", "baseline=active", "promotion.margin=0.05"]
    )
    assert (params.train.steps, params.baseline, params.promotion.margin) == (7, "active", 0.05)
    assert params.train.data.max_documents == 60  # the tiny preset underneath


def test_the_library_defaults_are_the_lifecycle_settings():
    """Issue 28 §2: a run from the CLI or Python gets what the lifecycle trains with (a warm-up of a third of
    the run, the lab's aux coefficient 0.1 for every loss-balanced family), the papers' coefficients are one
    setting away, and the user's own value wins over both."""
    from flows.cli import build_params
    from moe_core.presets import AUX_LOSS_COEF
    from moe_core.train.config import TrainConfig, TrainConfigError

    recipe = build_params("lifecycle", None, "small", []).train
    plain = TrainConfig.build({"steps": recipe.steps, "model": {"preset": recipe.model.preset}})
    assert plain.optim.warmup(plain.steps) == recipe.optim.warmup(recipe.steps) == 50
    assert plain.model.build_config().router_aux_loss_coef == recipe.model.build_config().router_aux_loss_coef
    assert TrainConfig.build({"steps": 3000}).optim.warmup(3000) == 1000
    assert TrainConfig.build({"optim": {"warmup_steps": 7}}).optim.warmup(3000) == 7
    for preset in (
        "switch-small",
        "mixtral-small",
        "olmoe-small",
        "shared-small",
        "qwen3-tiny",
        "gptoss-tiny",
    ):
        family = preset.split("-")[0]
        lab = TrainConfig.build({"model": {"preset": preset}}).model.build_config()
        paper = TrainConfig.build({"model": {"preset": preset, "balance": "paper"}}).model.build_config()
        assert lab.router_aux_loss_coef == 0.1, preset
        assert paper.router_aux_loss_coef == AUX_LOSS_COEF[family]["paper"] < 0.1, preset
    assert AUX_LOSS_COEF["switch"]["paper"] == 0.01  # Fedus et al. 2022
    mine = build_params(
        "lifecycle", None, "small", ["train.model.overrides.router_aux_loss_coef=0.01"]
    ).train.model
    assert mine.build_config().router_aux_loss_coef == 0.01
    with pytest.raises(TrainConfigError, match="model.balance: Input should be 'lab' or 'paper'"):
        TrainConfig.build({"model": {"balance": "papers"}})


def test_flow_parameters_render_as_a_schema():
    from prefect.utilities.callables import parameter_schema

    from flows.lifecycle import lifecycle

    schema = parameter_schema(lifecycle.fn).model_dump()
    assert "params" in schema["properties"]
    assert {"LifecycleParams", "TrainConfig"} <= set(schema["definitions"])
