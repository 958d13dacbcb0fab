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

from moe_core.finetune.config import FinetuneConfig, FinetuneDivergedError, FinetuneError


def __getattr__(name: str):  # the trainers import TRL and transformers: only when asked for
    if name in ("finetune", "FinetuneResult", "load_base_model", "load_finetuned"):
        from moe_core.finetune import run

        return getattr(run, name)
    if name in ("trainable_parameter_report", "TrainableReport"):
        from moe_core.finetune import report

        return getattr(report, name)
    raise AttributeError(f"module 'moe_core.finetune' has no attribute {name!r}")


__all__ = ["FinetuneConfig", "FinetuneDivergedError", "FinetuneError", "FinetuneResult", "TrainableReport", "finetune", "load_base_model",
           "load_finetuned", "trainable_parameter_report"]
