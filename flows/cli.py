"""`moe-lab run | ui | sync`: the orchestration commands over the flows.

    moe-lab run lifecycle                          # the whole lifecycle, small preset: about 2.5 min on 2 idle CPU cores
    moe-lab run lifecycle --size tiny --set baseline=active --set promotion.margin=0.02
    moe-lab run pretrain --params pretrain.yaml    # any flow; parameters from a YAML/JSON file
    moe-lab run lifecycle --dashboard              # the live dashboard beside the flow
    moe-lab ui                                     # MLflow UI on 127.0.0.1:5000 (--prefect: Prefect's UI)
    moe-lab sync .moe_lab/runs/<flow run>          # upload what was kept while MLflow was unreachable

With nothing configured, Prefect runs an ephemeral server with PREFECT_HOME under the project data
directory ($MOE_LAB_HOME or ./.moe_lab) and MLflow records into SQLite there; PREFECT_API_URL and
MLFLOW_TRACKING_URI point the same commands at real servers. ``moe-lab deploy | serve`` live in
`deployments.cli`; ``run --dashboard`` is added by the program above the flows (`moe_lab.run`).

Heavy imports happen inside the handlers (by design), so ``moe-lab --help`` stays fast (tests/test_cli_help.py).
The command's own help is `HELP` below: it speaks to users.
"""

from __future__ import annotations

# Lazy: each command imports what it runs (torch, the library, servers) inside its function, so `moe-lab --help`
# and a mistyped argument answer at once.
import argparse
import json
import os
import sys
from pathlib import Path

from moe_core.cli import add_config_help

FLOWS = {  # command name -> (module, flow function, params class)
    "lifecycle": ("flows.lifecycle", "lifecycle", "flows.params:LifecycleParams"),
    "pretrain": ("flows.pretrain", "pretrain", "flows.params:PretrainParams"),
    "validate-data": ("flows.validate_data", "validate_data", "flows.params:ValidateParams"),
    "evaluate": ("flows.evaluate", "evaluate", "flows.evaluate:EvaluateFlowParams"),
    "optimize": ("flows.optimize", "optimize", "flows.optimize:OptimizeFlowParams"),
    "finetune": ("flows.finetune", "finetune", "flows.finetune:FinetuneFlowParams"),
}


HELP = """Run one of the lab's flows (Prefect), every stage recorded in MLflow.

    moe-lab run lifecycle                          # the whole lifecycle, small preset: about 4 min on 2 idle CPU cores
    moe-lab run lifecycle --size tiny --set baseline=active --set promotion.margin=0.02
    moe-lab run pretrain --params pretrain.yaml    # any flow; parameters from a YAML/JSON file
    moe-lab run lifecycle --dashboard              # the live dashboard beside the flow

With nothing configured, Prefect runs a temporary server and MLflow records into SQLite, both under
$MOE_LAB_HOME (default ./.moe_lab); set PREFECT_API_URL and MLFLOW_TRACKING_URI to use real servers.
moe-lab ui opens the MLflow UI on what was recorded. --help-config lists every field --set takes.
"""


def add_cli(subparsers) -> None:
    run = subparsers.add_parser(
        "run",
        help="run a Prefect flow (lifecycle, pretrain, validate-data, ...)",
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument(
        "flow", choices=sorted(FLOWS), help="the flow to run (its parameters: FLOW --help-config)"
    )
    run.add_argument("--params", help="YAML/JSON file with the flow's parameters")
    run.add_argument(
        "--size",
        choices=["tiny", "small"],
        default="small",
        help="training preset for lifecycle/pretrain: tiny (seconds, CI) or small (minutes)",
    )
    run.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a parameter, e.g. --set train.steps=300 --set baseline=active "
        "(all parameters: moe-lab run FLOW --help-config)",
    )
    add_config_help(run, _params_class)
    run.set_defaults(func=run_flow)

    ui = subparsers.add_parser(
        "ui",
        help="the MLflow UI on 127.0.0.1 (or Prefect's with --prefect)",
        description="Open the MLflow UI on the lab's tracking store (MLFLOW_TRACKING_URI, "
        "or the SQLite store under $MOE_LAB_HOME) on http://HOST:PORT; with "
        "--prefect, start the Prefect server and its UI instead. Ctrl-C stops it.",
    )
    ui.add_argument("--port", type=int, default=None, help="default: 5000 (MLflow), 4200 (Prefect)")
    ui.add_argument("--host", default="127.0.0.1")
    ui.add_argument("--prefect", action="store_true", help="start the Prefect server and UI instead")
    ui.set_defaults(func=run_ui)

    sync = subparsers.add_parser(
        "sync", help="upload what a flow or training run kept while MLflow was unreachable"
    )
    sync.add_argument(
        "run_dir",
        help="a flow's output directory (holds mlflow_pending.jsonl) or a training "
        "output directory (holds metrics.jsonl)",
    )
    sync.add_argument(
        "--run-id", default=None, help="MLflow run to upload into (default: the one it was recording to)"
    )
    sync.add_argument(
        "--all", action="store_true", help="upload every event, not only those after the outage"
    )
    sync.set_defaults(func=run_sync)


def _params_class(namespace):
    import importlib

    flow = getattr(namespace, "flow", None)
    if flow not in FLOWS:
        raise SystemExit(
            "moe-lab run: name the flow first: moe-lab run FLOW --help-config "
            f"(FLOW: {', '.join(sorted(FLOWS))})"
        )
    module, _, cls_name = FLOWS[flow][2].partition(":")
    title = (
        f"moe-lab run {flow} --set KEY=VALUE (fields of {module}.{cls_name}; --params takes the same in YAML"
    )
    if flow in ("lifecycle", "pretrain"):
        title += "; train.* defaults shown are the class's, --size tiny|small sets the training preset"
    title += "):"
    return getattr(importlib.import_module(module), cls_name), title


def _settings():
    from tasks import settings

    settings.apply_defaults()  # before prefect is imported
    return settings


def build_params(flow: str, params_file: str | None, size: str, overrides: list[str]):
    """The flow's typed parameters from a file, the size preset and ``key=value`` overrides; bad input
    raises `FlowParamsError` naming the file or the ``--set`` item (the CLI prints it and exits 2)."""
    import importlib

    from pydantic import ValidationError

    from flows.params import FlowParamsError, small_train_config, tiny_train_config
    from moe_core.configfile import apply_override, describe_errors

    module, _, cls_name = FLOWS[flow][2].partition(":")
    cls = getattr(importlib.import_module(module), cls_name)
    data = _read_params_file(params_file) if params_file else {}
    if flow in ("lifecycle", "pretrain") and "train" not in data:
        data["train"] = (small_train_config() if size == "small" else tiny_train_config()).model_dump(
            mode="json"
        )
    hint = f"; see moe-lab run {flow} --help-config"
    for item in overrides:
        apply_override(data, item, cls, error_cls=FlowParamsError, hint=hint)
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        where = " and ".join(filter(None, [params_file, "--set" if overrides else None])) or "defaults"
        raise FlowParamsError(
            f"moe-lab run {flow} parameters ({where}): {describe_errors(cls, err)}; "
            f"see moe-lab run {flow} --help-config"
        ) from None


def _read_params_file(path: str) -> dict:
    import yaml

    from flows.params import FlowParamsError

    file = Path(path)
    if not file.is_file():
        raise FlowParamsError(f"--params {path}: file not found")
    try:
        data = yaml.safe_load(file.read_text())
    except yaml.YAMLError as err:
        raise FlowParamsError(f"--params {path}: not valid YAML/JSON: {' '.join(str(err).split())}") from None
    except UnicodeDecodeError:
        raise FlowParamsError(f"--params {path}: not a text file (expected YAML/JSON)") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise FlowParamsError(
            f"--params {path}: expected a mapping of parameters at the top level, got {type(data).__name__}"
        )
    return data


def run_flow(args, params=None) -> int:
    """Run the flow; ``params``: `build_params` from the arguments when the caller already has them."""
    settings = _settings()
    import importlib

    from tasks.process import sigterm_exits  # torch, through the checkpoint reader: only when a flow runs

    params = params or build_params(args.flow, args.params, args.size, args.overrides)
    module, name, _ = FLOWS[args.flow]
    flow = getattr(importlib.import_module(module), name)
    with sigterm_exits():  # SIGTERM, like Ctrl-C: the flow's training process checkpoints, its runs close
        result = flow(params)
    _print_where_to_look(args.flow, result, settings.describe())
    return 0


def _print_where_to_look(flow: str, result: dict, where: dict) -> None:
    print(f"\nmoe-lab run {flow}: done")
    run_id = result.get("mlflow_run_id")
    if run_id and result.get("mlflow_pending"):  # the flow's journal holds its records, MLflow not yet
        print(f"  MLflow run        {run_id}  (not in MLflow yet: see MLflow pending below)")
    elif run_id:
        from tasks import tracking

        print(f"  MLflow run        {tracking.run_url(run_id)}  (tracking: {where['mlflow']}; `moe-lab ui`)")
    if result.get("version"):
        state = "champion" if result.get("promoted") else "candidate (champion kept)"
        print(
            f"  registered model  models:/{result['model_name']}/{result['version']} -> {state} ({result['reason']})"
        )
    elif "version" in result:
        print(f"  registered model  none: {result['reason']}")
    for key in ("out_dir", "export_dir", "data_dir"):
        if result.get(key):
            print(f"  {key.replace('_', ' '):<17} {result[key]}")
    if plots := _plots_dir(result):
        print(
            f"  plots             {plots}  (router load, token-to-expert, flow, specialization: PNG and HTML)"
        )
    print(f"  Prefect           {where['prefect']}")
    print(f"  dashboard         moe-lab dashboard --runs {where['home']}/runs  (training, routing, compare)")
    metrics = result.get("metrics") or {}
    compared = (result.get("comparison") or {}).get("validation_ppl") or {}
    if len(compared) > 1:  # the MoE and the baseline it was trained beside, on the same text
        shown = ", ".join(f"{name} {ppl:.2f}" for name, ppl in compared.items() if ppl is not None)
        print(f"  validation ppl    {shown}  ({result['comparison']['file']})")
    elif "eval.validation_ppl" in metrics:
        print(f"  validation ppl    {metrics['eval.validation_ppl']:.2f}")
    if "eval.validation_bpb" in metrics:
        print(f"  bits per byte     {metrics['eval.validation_bpb']:.4f}")
    if result.get("mlflow_pending"):
        print(
            f"  MLflow pending    {result['mlflow_offline']}: the records wait in {result['mlflow_pending']};\n"
            f"                    upload them once MLflow is back: {result['sync_command']}"
        )


def _plots_dir(result: dict) -> Path | None:
    """Where the flow drew its router pictures: beside the profile (the lifecycle's, inside the MoE's run
    directory), or <out_dir>/analysis/plots."""
    candidates = [Path(result["out_dir"]) / "analysis" / "plots"] if result.get("out_dir") else []
    if result.get("profile_dir"):
        candidates.append(Path(result["profile_dir"]).parent / "plots")
    return next((c for c in candidates if c.is_dir()), None)


def run_ui(args) -> int:
    # heavy (torch, through the checkpoint reader): imported for this command only
    from tasks.process import run_until_stopped

    settings = _settings()
    if args.prefect:
        env = {**os.environ, "PREFECT_SERVER_API_HOST": args.host}
        return run_until_stopped(
            ["prefect", "server", "start", "--host", args.host, "--port", str(args.port or 4200)], env=env
        )
    uri = os.environ["MLFLOW_TRACKING_URI"]
    cmd = [
        sys.executable,
        "-m",
        "mlflow",
        "ui",
        "--backend-store-uri",
        uri,
        "--host",
        args.host,
        "--port",
        str(args.port or 5000),
    ]
    if uri.startswith("sqlite:"):
        cmd += ["--default-artifact-root", settings.artifact_root().as_uri()]
    from tasks.tracking import UI_TRAINING_VIEW, experiment_id  # mlflow: only for this command

    base = f"http://{args.host}:{args.port or 5000}"
    experiment = f"{base}/#/experiments/{experiment_id()}?{UI_TRAINING_VIEW}"  # the runs table, not GenAI's
    print(f"MLflow UI on {experiment} ({uri}); Ctrl-C stops it", flush=True)
    return run_until_stopped(cmd)  # Ctrl-C or SIGTERM stops the server and its workers, not only this process


def run_sync(args) -> int:
    _settings()
    from tasks.sync import sync

    print(json.dumps(sync(args.run_dir, args.run_id, everything=args.all), indent=1))
    return 0
