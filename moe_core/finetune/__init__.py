"""Fine-tuning MoE models: full, LoRA on attention and experts (all, a chosen list, or ESFT's most-used experts),
router-only and task-conditioned router bias; SFT, DPO, ORPO, KTO, reward models and GRPO (online RL with MoE
routing replay) through TRL with the router losses kept in the objective.

    from moe_core.finetune import FinetuneConfig, finetune

    config = FinetuneConfig.build({"model": {"path": "runs/switch-tiny/final"}, "data": {"source": "sft.jsonl"},
                                   "method": "lora", "lora": {"experts": "esft"}, "steps": 50})
    result = finetune(config, out_dir="runs/ft")     # result.adapter_dir, result.merged_dir, result.hf_dir

The same from the command line: ``moe-lab finetune --config finetune.yaml --out runs/ft``. Modules: `config`
(FinetuneConfig), `methods` (freezing, LoRA targets, expert subsets, ESFT, task router bias), `objectives` (TRL
SFT/DPO/ORPO/KTO/reward trainers with the MoE losses), `report` (trainable-parameter report), `export` (adapter, merged, HF),
`grpo` (GRPO: the lab's decode path as TRL's rollout, routing replay, routing-shift telemetry, checked
rewards; `rewards` the bundled reward functions; `trl_seam` what it relies on in TRL), `sizing` (the defaults that follow the base model's size), `as_trained` (an adapter-only output loaded unmerged on its base as it trained), `qlora` (how QLoRA holds the base), `parallel` (several processes: experts split over
them, per-rank checkpoints; `trainer_seam` the Trainer hooks it replaces), `run` (finetune), `cli`.

The names above are resolved on first use (moe_core._lazy): `moe-lab finetune --help` imports this package
through moe_core.finetune.cli and must not pay for pydantic, TRL and transformers it does not need.
"""

from typing import TYPE_CHECKING

from moe_core._lazy import lazy_exports

if TYPE_CHECKING:
    from moe_core.finetune.config import FinetuneConfig, FinetuneDivergedError, FinetuneError
    from moe_core.finetune.report import TrainableReport, trainable_parameter_report
    from moe_core.finetune.run import FinetuneResult, finetune

_EXPORTS = {
    "FinetuneConfig": ".config",
    "FinetuneDivergedError": ".config",
    "FinetuneError": ".config",
    "finetune": ".run",
    "FinetuneResult": ".run",
    "trainable_parameter_report": ".report",
    "TrainableReport": ".report",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    "FinetuneConfig",
    "FinetuneDivergedError",
    "FinetuneError",
    "FinetuneResult",
    "TrainableReport",
    "finetune",
    "trainable_parameter_report",
]
