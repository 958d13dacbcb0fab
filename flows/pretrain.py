"""Flow: prepare the data a training config names, then pretrain (in this process, or a torchrun process
group for ``nproc`` > 1, cleaned up if the flow run is cancelled), optionally with its dense baseline."""

from __future__ import annotations

from dataclasses import asdict

from prefect import flow

from flows.common import data_dir_for, link_dashboard, out_dir_for, prepare_config_for, with_data
from flows.params import PretrainParams
from tasks import data, train
from tasks.stages import flow_record, open_journal

DEFAULTS = PretrainParams()  # what the Prefect form shows; flows never modify their parameters


@flow(name="pretrain")
def pretrain(params: PretrainParams = DEFAULTS) -> dict:
    out = out_dir_for("pretrain", params.out_dir)
    link_dashboard("pretrain")
    journal = open_journal(out)  # where MLflow's records wait while it is unreachable
    with flow_record("pretrain", params, journal) as run_id:
        config = params.train
        if config.data.source != "synthetic" and config.data.path is None:
            prepare_cfg = prepare_config_for(config)
            config = with_data(config, data.prepare_data(prepare_cfg, data_dir_for(prepare_cfg), run_id))
        result = train.pretrain(
            config,
            str(out),
            run_id,
            params.nproc,
            params.subprocess,
            params.log_model,
            max_restarts=params.max_restarts,
            launcher=params.launcher,
            ray_address=params.ray_address,
            log_checkpoint=params.log_checkpoint,
        )
    return {**asdict(result), "mlflow_run_id": run_id, "out_dir": str(out), **journal.summary()}
