"""Flow parameters: typed models, so the Prefect UI renders a form and validates what it gets.

The training config is the library's own `TrainConfig`, the data checks the library's `ValidationConfig`
and the quantization the library's bounds; the models here only add what a flow decides (which stages run,
where outputs go, how the promotion gate judges).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from moe_core.data.validation import ValidationConfig
from moe_core.errors import MoELabError
from moe_core.finetune import FinetuneConfig
from moe_core.quantized import QuantConfig
from moe_core.train import TrainConfig
from tasks import settings
from tasks.sections import EvaluateParams, FlowParams  # the sections stage tasks take whole


class FlowParamsError(MoELabError):
    """Flow parameters that cannot be read: a malformed params file or ``--set`` item, or invalid values."""


def tiny_train_config(**fields) -> TrainConfig:
    """CI size: seconds of data preparation and training on a CPU."""
    base = {
        "model": {"preset": "switch-tiny"},
        "steps": 12,
        "batch_size": 4,
        "data": {"max_documents": 60, "seq_len": 32, "vocab_size": 384},
        "checkpoint": {"every": 6},
        "log": {"every": 3, "progress": "off"},
        "eval": {"batches": 2, "every": 6},
        "optim": {"warmup_steps": 2},
    }
    return TrainConfig.build(_merge(base, fields))


def small_train_config(**fields) -> TrainConfig:
    """The README's run, a model that visibly learns: the lifecycle with its dense baseline took 2m15s on 2
    idle CPU cores (2026-11-27; 1m53s without the baseline). The library's defaults, nothing special: a
    warm-up of a third of the run and the lab's load-balancing coefficient 0.1 (`OptimSection.warmup_fraction`,
    `moe_core.presets.AUX_LOSS_COEF`: the measurements behind both are there)."""
    base = {
        "model": {"preset": "switch-small"},
        "steps": 150,
        "batch_size": 8,
        "data": {"max_documents": 800, "seq_len": 128, "vocab_size": 4000},
        "checkpoint": {"every": 50},
        "log": {"every": 10, "progress": "auto"},
        "eval": {"batches": 8, "every": 25},
    }
    return TrainConfig.build(_merge(base, fields))


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = (
            _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        )
    return out


class ValidateParams(FlowParams):
    source: str = "builtin"
    kind: Literal["text", "instruction", "preference"] = "text"
    max_documents: int | None = Field(200, ge=1)
    validation: ValidationConfig = Field(default_factory=ValidationConfig)


class PretrainParams(FlowParams):
    train: TrainConfig = Field(default_factory=tiny_train_config)
    nproc: int = Field(
        1,
        ge=1,
        description="processes (torchrun) on this node; 1 trains in the flow's process "
        "unless `subprocess` is set",
    )
    subprocess: bool = Field(False, description="train in a child process group (killed with the flow run)")
    max_restarts: int = Field(
        2,
        ge=0,
        description="process groups: torchrun's elastic agent restarts the group "
        "this many times when a rank dies (it resumes from the last "
        "checkpoint); recorded in MLflow as elastic/restarts",
    )
    launcher: Literal["torchrun", "ray"] = Field(
        "torchrun",
        description="process groups: torchrun on this "
        "worker's machine, or Ray Train on the cluster at ray_address",
    )
    ray_address: str | None = Field(
        None, description="Ray cluster address (launcher=ray); None: $RAY_ADDRESS or a local cluster"
    )
    out_dir: str | None = Field(None, description="default: <MOE_LAB_HOME>/runs/<flow run name>")
    log_model: bool = True
    log_checkpoint: bool = Field(
        False,
        description="also upload the last checkpoint (weights and optimizer "
        "state, ~3x the model) to MLflow; it stays on disk anyway",
    )


class OptimizeParams(FlowParams):
    quantize_bits: Literal[4, 8] = 8
    quantize_method: Literal["rtn", "gptq", "awq"] = "rtn"  # gptq/awq calibrate on the prepared data
    group_size: int = Field(32, ge=2)
    onnx: bool = True
    benchmark_batches: int = Field(
        2,
        ge=1,
        description="unused by the lifecycle, which benchmarks on the "
        "evaluation's batches (one perplexity per model and split)",
    )

    def quant_config(self) -> QuantConfig:
        """The library's quantization config these settings choose (what the quantize task takes)."""
        return QuantConfig(bits=self.quantize_bits, method=self.quantize_method, group_size=self.group_size)


class FinetuneParams(FlowParams):
    enabled: bool = Field(False, description="fine-tune the pretrained model (needs config.data.source)")
    config: FinetuneConfig = Field(default_factory=FinetuneConfig)


def default_alignment() -> FinetuneConfig:
    """GRPO with the bundled verifiable reward (the README's example, `moe_core.finetune.rewards`)."""
    return FinetuneConfig(objective="grpo", grpo={"rewards": ["moe_core.finetune.rewards:sum_of_two"]})


class AlignParams(FlowParams):
    enabled: bool = Field(
        False,
        description="an alignment stage after fine-tuning (or pretraining): GRPO, DPO, ... (config.objective; "
        "needs config.data.source, e.g. examples/sums.jsonl for the default GRPO reward)",
    )
    config: FinetuneConfig = Field(default_factory=default_alignment)


class PromotionParams(FlowParams):
    model_name: str = settings.REGISTERED_MODEL
    metric: str = Field(
        "eval.validation_bpb",
        description="an evaluation metric of the candidate's run; "
        "bits per byte (*_bpb) compares models with different tokenizers, per-token metrics "
        "(loss, ppl) only models with the same tokenizer",
    )
    higher_is_better: bool = False
    margin: float = Field(
        0.0,
        ge=0,
        description="relative improvement over the champion needed to promote, "
        "e.g. 0.02 = 2% fewer bits per byte",
    )


class LifecycleParams(FlowParams):
    """Everything the lifecycle does, in one form: validate, prepare, pretrain (+ dense baseline), evaluate,
    fine-tune, align (off by default), optimize, register, promote."""

    train: TrainConfig = Field(default_factory=tiny_train_config)
    validation: ValidationConfig = Field(default_factory=ValidationConfig)
    baseline: Literal["active", "total", "none"] | None = Field(
        "active",
        description="also train the dense baseline with equal active (or total) parameters, on the same data "
        "and steps, and evaluate the model against it; none skips it",
    )
    nproc: int = Field(1, ge=1)
    subprocess: bool = False
    log_checkpoint: bool = Field(
        False,
        description="also upload the last checkpoint (weights and optimizer "
        "state, ~3x the model) to MLflow; it stays on disk anyway",
    )
    evaluate: EvaluateParams = Field(default_factory=EvaluateParams)
    finetune: FinetuneParams = Field(default_factory=FinetuneParams)
    align: AlignParams = Field(default_factory=AlignParams)
    optimize: OptimizeParams | None = Field(
        default_factory=OptimizeParams, description="null skips the stage"
    )
    promotion: PromotionParams = Field(default_factory=PromotionParams)
    out_dir: str | None = None
