"""The training configuration: one typed object, checked when built, saved as JSON with every checkpoint.

Sections: ``model`` (a preset plus overrides, or a dense baseline of it), ``data``, ``optim`` (AdamW and the
learning-rate schedule), ``parallel`` (expert x data parallel layout), ``checkpoint``, ``eval``, ``log`` and
``faults``; top-level fields hold the batch, steps, precision and seed.

Batch sizes are global: ``batch_size`` sequences per optimizer step, split over ``grad_accum`` micro-steps
and the data-parallel ranks, so one config trains the same model on one process or many.

    config = TrainConfig(model={"preset": "switch-tiny"}, steps=50)
    config = config.with_overrides(["optim.lr=1e-3", "parallel.ep_size=2"])   # the CLI's --set
"""

from __future__ import annotations

# Lazy: moe_core.config and moe_core.data.prepare (they load torch and transformers) are imported inside the
# methods that build a model or data config, so `moe-lab train --help-config` loads only pydantic.
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from moe_core.configfile import ConfigFile
from moe_core.errors import MoELabError
from moe_core.train.alerts import AlertThresholds


class TrainConfigError(MoELabError):
    """A training config that cannot be used: the message names the field and what to do."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSection(_Section):
    preset: str = "switch-tiny"
    overrides: dict[str, Any] = Field(default_factory=dict)  # MoEConfig fields, e.g. {"num_experts": 4}
    # the load-balancing coefficient: the lab's, healthy from 100 to 10^4 steps, or "paper": the family's
    # published one (`moe_core.presets.AUX_LOSS_COEF`); overrides.router_aux_loss_coef wins over both
    balance: Literal["lab", "paper"] = "lab"
    baseline: Literal["active", "total"] | None = None  # train the dense model with equal active/total params
    # a dense Llama / Mistral / Qwen2 checkpoint directory to upcycle (`moe_core.upcycle`): its config.json fixes
    # the architecture, preset + overrides the MoE fields, and its weights start every expert
    upcycle_from: str | None = None
    # an MoE checkpoint directory to continue pretraining from (`moe_core.init_from`): ours, or a Hugging Face
    # any architecture moe_core.convert reads; its config.json is the model (overrides: training fields only)
    init_from: str | None = None

    @field_validator("overrides")
    @classmethod
    def _known_fields(cls, value: dict[str, Any]) -> dict[str, Any]:
        """A typo (``num_expert``) is refused here, before any data is prepared, not trained with silently."""
        from moe_core.config import check_model_fields

        check_model_fields(value)
        return value

    def build_config(self, vocab_size: int | None = None):
        """The `MoEConfig` this section describes; ``vocab_size`` (the tokenizer's) wins over the preset's."""
        from moe_core.config import dense_baseline, get_config

        if self.upcycle_from is not None or self.init_from is not None:
            return self._checkpoint_config(vocab_size)
        overrides = dict(self.overrides)
        if vocab_size is not None and "vocab_size" not in overrides:
            overrides["vocab_size"] = vocab_size
        try:
            config = get_config(self.preset, balance=self.balance, **overrides)
            if self.baseline is not None:
                config = dense_baseline(config, self.baseline)
        except (ValueError, TypeError) as err:
            raise TrainConfigError(f"model: {err}; fix model.preset / model.overrides") from None
        return config

    @property
    def start_from(self) -> str | None:
        """The checkpoint directory the weights start from (``upcycle_from`` or ``init_from``), if any."""
        return self.upcycle_from or self.init_from

    def _checkpoint_config(self, vocab_size: int | None):
        """The checkpoint's vocabulary stays: token ids of a smaller tokenizer index into it, a larger one's
        would not (tokenize the data with the checkpoint's tokenizer)."""
        from moe_core.init_from import initial_config
        from moe_core.upcycle import upcycled_config

        given = [f for f in ("upcycle_from", "init_from", "baseline") if getattr(self, f) is not None]
        if len(given) > 1:
            raise TrainConfigError(f"model.{' and model.'.join(given)} exclude each other; keep one")
        if self.upcycle_from is not None:
            config = upcycled_config(self.upcycle_from, self.preset, self.overrides, self.balance)
        else:
            config = initial_config(self.init_from, self.overrides)
        if vocab_size is not None and vocab_size > config.vocab_size:
            raise TrainConfigError(
                f"the data's tokenizer has {vocab_size} tokens, the checkpoint in model.{given[0]}="
                f"{self.start_from} {config.vocab_size}; tokenize the data with the checkpoint's tokenizer"
            )
        return config


class DataSection(_Section):
    # "builtin" (or another moe_core.data source) is prepared (tokenized, packed) once and reused;
    # "synthetic" is random token blocks for tests and throughput benchmarks (no tokenizer).
    source: str = "builtin"
    path: str | None = None  # an already prepared data directory; skips preparation
    cache_dir: str | None = (
        None  # prepared data is cached here; default $MOE_LAB_DATA_CACHE or ~/.cache/moe-lab/data
    )
    seq_len: int = Field(64, ge=2)
    vocab_size: int | None = None  # tokenizer size; default the model preset's vocab_size
    max_documents: int | None = None
    seed: int = 0
    synthetic_blocks: int = Field(512, ge=1)

    def prepare_config(self, model_vocab: int, **fields: Any):
        """The `moe_core.data.prepare.PrepareConfig` that prepares ``source`` for this run (``fields``, e.g.
        ``validation=...``, add to it); the training loop and the flows share it, so they share the cache."""
        from moe_core.data.prepare import PrepareConfig

        return PrepareConfig(
            source=self.source,
            seq_len=self.seq_len,
            vocab_size=self.vocab_size or model_vocab,
            max_documents=self.max_documents,
            seed=self.seed,
            **fields,
        )


class OptimSection(_Section):
    lr: float = Field(3e-3, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    fused: bool | None = None  # None: the fused AdamW kernel where this torch has it for the device
    grad_clip: float | None = Field(1.0, gt=0)  # max global grad norm; None disables clipping
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    # linear warm-up: ``warmup_steps`` when set, else ``warmup_fraction`` of the run. A third is what keeps a
    # short, hot run's routers from collapsing before the balancing loss acts (switch-small at 150 steps: 10
    # warm-up steps drop 7-18% of a layer's slots in steps 100-150, 50 steps 3-9%, and every arm, dense too,
    # learns better; issue 17, benchmarks/README.md "Training quality"), and 2,500-step runs learn well with it
    warmup_steps: int | None = Field(None, ge=0)
    warmup_fraction: float = Field(1 / 3, ge=0, lt=1)
    decay_fraction: float = Field(0.2, gt=0, le=1)  # WSD: the last fraction of steps decays linearly
    # the routers' learning rate as a multiple of ``lr`` (their own optimizer group, same schedule)
    router_lr_scale: float = Field(1.0, gt=0)

    def warmup(self, steps: int) -> int:
        """The warm-up of a run of ``steps`` steps."""
        return self.warmup_steps if self.warmup_steps is not None else round(self.warmup_fraction * steps)


class ParallelSection(_Section):
    ep_size: int = Field(1, ge=1)  # experts sharded over this many ranks; world = ep_size * dp_size
    dp_mode: Literal["ddp", "fsdp2"] = "ddp"
    # the collective backend ("auto": nccl on CUDA, gloo on CPU), or "deepspeed": train through a DeepSpeed
    # engine (ZeRO, `moe_core.train.deepspeed_engine`; `pip install .[deepspeed]`), its collectives on
    # deepspeed.comm over the same process group (gloo on CPU, nccl on CUDA); with ep_size > 1 the expert shards
    # sit in DeepSpeed's MoE parameter groups (`moe_core.train.deepspeed_experts`)
    backend: Literal["auto", "gloo", "nccl", "deepspeed"] = "auto"
    # deepspeed only: ZeRO stage 1 (optimizer state partitioned over the ranks) or 2 (gradients too)
    zero_stage: Literal[1, 2] = 2
    # deepspeed only: the optimizer state and step on the CPU (ZeRO-Offload); on a CPU-only machine the same
    # memory, but the code path a GPU run takes
    offload_optimizer: bool = False

    @model_validator(mode="after")
    def _offload_needs_deepspeed(self) -> ParallelSection:
        if self.offload_optimizer and self.backend != "deepspeed":
            raise ValueError("parallel.offload_optimizer=true needs parallel.backend=deepspeed")
        return self


class CheckpointSection(_Section):
    every: int = Field(100, ge=1)
    keep_last: int = Field(2, ge=1)
    keep_best: bool = True  # also keep the checkpoint with the lowest validation loss
    export: bool = True  # write a Hugging Face-loadable <out>/final at the end


class EvalSection(_Section):
    every: int = Field(0, ge=0)  # 0: only at the end
    batches: int = Field(8, ge=1)
    batch_size: int | None = None  # default: the training micro-batch size


class LogSection(_Section):
    every: int = Field(10, ge=1)
    progress: Literal["auto", "bar", "lines", "off"] = "auto"  # auto: a bar on a terminal, lines otherwise
    per_expert: bool = True  # per-expert token fractions in telemetry
    peak_flops: float | None = None  # per device, for MFU; None: a known GPU's bf16 peak, else no MFU
    alerts: AlertThresholds = Field(default_factory=AlertThresholds)  # dead expert, load collapse, drops

    @field_validator("progress", mode="before")
    @classmethod
    def _yaml_off(cls, value):
        return "off" if value is False else value  # `progress: off` in a YAML file


class FaultSection(_Section):
    max_bad_steps_in_a_row: int = Field(5, ge=0)  # non-finite loss/grads: skip; stop after more than this


class TrainConfig(_Section, ConfigFile):
    error_cls: ClassVar[type[MoELabError]] = TrainConfigError
    config_name: ClassVar[str] = "training config"
    command: ClassVar[str] = "train"

    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection = Field(default_factory=DataSection)
    optim: OptimSection = Field(default_factory=OptimSection)
    parallel: ParallelSection = Field(default_factory=ParallelSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    log: LogSection = Field(default_factory=LogSection)
    faults: FaultSection = Field(default_factory=FaultSection)

    steps: int = Field(50, ge=1)
    batch_size: int = Field(8, ge=1)  # global sequences per optimizer step
    grad_accum: int = Field(1, ge=1)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # the load-balancing loss's statistics (`moe_core.router_losses.LoadBalance`): each micro-batch's own
    # tokens; every data-parallel rank's micro-batch (f_e and P_e all-reduced: a run on W processes optimizes
    # what one process would on the same batch; Megatron-LM's global_aux_loss); or the whole step, every
    # micro-batch and every rank (f_e only; Qiu et al. 2025, "Demons in the Detail": lets experts specialize)
    balance_scope: Literal["micro_batch", "data_parallel", "global_batch"] = "data_parallel"
    activation_checkpointing: bool = False
    compile: bool = False
    deterministic: bool = True  # torch.use_deterministic_algorithms, for exact resume
    seed: int = 0
    version: int = 1  # bump when a field changes meaning; old configs keep loading

    @model_validator(mode="before")
    @classmethod
    def _old_balance_settings(cls, data: Any) -> Any:
        """Configs saved before ``balance_scope`` took ``data_parallel`` carry ``parallel.global_aux_loss``:
        ``micro_batch`` with it on was what ``data_parallel`` is now."""
        parallel = data.get("parallel") if isinstance(data, dict) else None
        if not isinstance(parallel, dict) or "global_aux_loss" not in parallel:
            return data
        parallel = dict(parallel)
        all_ranks = parallel.pop("global_aux_loss")
        scope = data.get("balance_scope", "micro_batch")
        if scope == "micro_batch" and all_ranks:
            scope = "data_parallel"
        return {**data, "parallel": parallel, "balance_scope": scope}

    @model_validator(mode="after")
    def _check_deepspeed(self) -> TrainConfig:
        """What parallel.backend=deepspeed does not cover (`moe_core.train.deepspeed_engine`), refused before any
        process starts."""
        if self.parallel.backend != "deepspeed":
            return self
        refused = []
        if self.parallel.dp_mode == "fsdp2":
            refused.append("parallel.dp_mode=fsdp2 (ZeRO takes its place: parallel.zero_stage)")
        if self.precision == "fp16":
            refused.append("precision=fp16 (use bf16)")
        if self.compile:
            refused.append("compile=true")
        if refused:
            raise ValueError(
                "parallel.backend=deepspeed does not support " + "; ".join(refused) + "; change these "
                "settings or use parallel.backend=auto"
            )
        return self

    @model_validator(mode="after")
    def _check_batch(self) -> TrainConfig:
        if self.batch_size % self.grad_accum:
            raise ValueError(
                f"batch_size={self.batch_size} must be a multiple of grad_accum={self.grad_accum}"
            )
        return self

    # ------------------------------------------------------------------ derived
    def micro_batch_size(self, dp_world: int) -> int:
        """Sequences per rank per micro-step; every rank gets the same number."""
        per_micro = self.batch_size // self.grad_accum
        if per_micro % dp_world:
            raise TrainConfigError(
                f"batch_size={self.batch_size} / grad_accum={self.grad_accum} = {per_micro} sequences per "
                f"micro-step do not split over {dp_world} processes; make batch_size a multiple of "
                f"grad_accum * {dp_world}"
            )
        return per_micro // dp_world

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_preset(cls, preset: str, **fields: Any) -> TrainConfig:
        """``TrainConfig.from_preset("switch-tiny", steps=100)``: a model preset with default training."""
        return cls.build({"model": {"preset": preset}, **fields})
