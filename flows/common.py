"""Small helpers the flows share: where a flow run writes, and the data preparation a training config implies."""

from __future__ import annotations

import os
import time
from pathlib import Path

from prefect.artifacts import create_link_artifact
from prefect.runtime import flow_run

from moe_core.data.prepare import PrepareConfig
from moe_core.data.validation import ValidationConfig
from moe_core.train import TrainConfig
from moe_core.train.batches import data_cache_dir
from tasks import settings


def out_dir_for(flow_name: str, requested: str | None) -> Path:
    """``requested``, or ``<MOE_LAB_HOME>/runs/<flow>-<time>-<flow run name>``."""
    if requested:
        return Path(requested)
    return settings.runs_dir() / f"{flow_name}-{time.strftime('%Y%m%d-%H%M%S')}-{flow_run.name or 'local'}"


def prepare_config_for(train: TrainConfig, validation: ValidationConfig | None = None) -> PrepareConfig:
    """The preparation `moe_core.train` would do for ``train.data`` (same fields as its own data cache)."""
    return train.data.prepare_config(
        train.model.build_config().vocab_size, validation=validation or ValidationConfig()
    )


def data_dir_for(config: PrepareConfig) -> str:
    """Prepared data is shared by flow runs: ``<MOE_LAB_HOME>/data/<source>-<settings hash>``."""
    return str(data_cache_dir(str(settings.lab_home() / "data"), config))


def with_data(train: TrainConfig, data_dir: str) -> TrainConfig:
    return train.model_copy(update={"data": train.data.model_copy(update={"path": data_dir})})


DASHBOARD_URL_ENV = "MOE_LAB_DASHBOARD_URL"  # set by `moe-lab run ... --dashboard` (without any token)


def link_dashboard(flow_name: str) -> str | None:
    """A Prefect link artifact to the live dashboard, when one was started beside this flow run."""
    url = os.environ.get(DASHBOARD_URL_ENV)
    if url:
        create_link_artifact(
            url,
            link_text="live dashboard",
            key=f"{flow_name}-dashboard",
            description="moe-lab dashboard: training, routing, compare",
        )
    return url
