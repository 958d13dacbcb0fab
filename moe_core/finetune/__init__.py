"""Fine-tuning MoE models: full, LoRA on attention and experts (all, a chosen list, or ESFT's most-used experts),
router-only and task-conditioned router bias; SFT and DPO through TRL with the router losses kept in the objective.

    from moe_core.finetune import FinetuneConfig, finetune

    config = FinetuneConfig.build({"model": {"path": "runs/switch-tiny/final"}, "data": {"source": "sft.jsonl"},
                                   "method": "lora", "lora": {"experts": "esft"}, "steps": 50})
    result = finetune(config, out_dir="runs/ft")     # result.adapter_dir, result.merged_dir, result.hf_dir

The same from the command line: ``moe-lab finetune --config finetune.yaml --out runs/ft``. Modules: `config`
(FinetuneConfig), `methods` (freezing, LoRA targets, expert subsets, ESFT, task router bias), `objectives` (TRL
SFT/DPO trainers with the MoE losses), `report` (trainable-parameter report), `export` (adapter, merged, HF),
`run` (finetune), `cli`.
"""

import importlib

# Resolved on first use (PEP 562), not on import: `moe-lab finetune --help` imports this package through
# moe_core.finetune.cli and must not pay for pydantic, TRL and transformers it does not need.
_EXPORTS = {
    "FinetuneConfig": "config",
    "FinetuneDivergedError": "config",
    "FinetuneError": "config",
    "finetune": "run",
    "FinetuneResult": "run",
    "trainable_parameter_report": "report",
    "TrainableReport": "report",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'moe_core.finetune' has no attribute {name!r}")
    return getattr(importlib.import_module(f"moe_core.finetune.{_EXPORTS[name]}"), name)


__all__ = [
    "FinetuneConfig",
    "FinetuneDivergedError",
    "FinetuneError",
    "FinetuneResult",
    "TrainableReport",
    "finetune",
    "trainable_parameter_report",
]
