"""Configuration checks for what cannot run here: the docker compose stack, the deployments, the CI hook."""

from __future__ import annotations

from pathlib import Path

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


def test_lifecycle_recipe_keeps_its_short_run_settings_under_user_overrides():
    """The README's lifecycle (issue 17): a warm-up of a third of the run and the load-balancing coefficient
    0.1 for every family; a preset chosen with --set keeps them, and the user's own value wins."""
    from flows.cli import build_params

    recipe = build_params("lifecycle", None, "small", []).train
    assert recipe.optim.warmup_steps == recipe.steps // 3
    assert recipe.model.build_config().router_aux_loss_coef == 0.1
    olmoe = build_params("lifecycle", None, "small", ["train.model.preset=olmoe-small"]).train.model
    assert olmoe.build_config().router_aux_loss_coef == 0.1 and olmoe.build_config().num_experts == 64
    mine = build_params(
        "lifecycle", None, "small", ["train.model.overrides.router_aux_loss_coef=0.01"]
    ).train.model
    assert mine.build_config().router_aux_loss_coef == 0.01


def test_flow_parameters_render_as_a_schema():
    from prefect.utilities.callables import parameter_schema

    from flows.lifecycle import lifecycle

    schema = parameter_schema(lifecycle.fn).model_dump()
    assert "params" in schema["properties"]
    assert {"LifecycleParams", "TrainConfig"} <= set(schema["definitions"])
