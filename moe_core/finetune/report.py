"""The trainable-parameter report: exactly which tensors train, and for expert tensors which experts.

Each row is one tensor with ``requires_grad``: its name, shape, element count, how many of those elements can
change (an expert subset trains only its own rows), its kind (``lora_attention``, ``lora_expert``, ``router``,
``experts``, ...) and, for expert tensors, the experts that train per layer. `TrainableReport.require_expert_adapters`
fails loudly when expert LoRA was asked for and no expert weight got an adapter (the classic "LoRA silently missed
the experts" trap: ``target_modules=["w1", "w2"]`` on a model whose experts are stacked parameters).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from moe_core.experts import EXPERTS_MARK
from moe_core.finetune.config import FinetuneError
from moe_core.finetune.methods import MethodPlan, layer_of, lora_wrappers


@dataclass
class TensorRow:
    name: str
    shape: list[int]
    numel: int
    trainable_numel: int  # elements that can change (an expert subset trains only its experts' slices)
    kind: str
    layer: int | None = None
    experts: list[int] | None = None  # expert tensors: the experts of this layer that train
    target: str | None = None  # LoRA on a stacked parameter: the parameter it adapts (mlp.experts.gate_proj)


@dataclass
class TrainableReport:
    rows: list[TensorRow]
    total_params: int
    trainable_params: int
    by_kind: dict[str, int] = field(default_factory=dict)
    expert_adapters: dict[int, list[int]] = field(
        default_factory=dict
    )  # layer -> experts with a LoRA adapter

    def require_expert_adapters(self) -> None:
        """Raise when no routed-expert weight got a LoRA adapter."""
        if not any(row.kind == "lora_expert" and row.experts for row in self.rows):
            raise FinetuneError(
                "expert LoRA was asked for but no expert weight got an adapter (no trainable "
                "'mlp.experts.*lora_*' tensor); check lora.experts / lora.expert_ids / freeze.experts, and that the "
                "model's experts are stacked parameters mlp.experts.{gate_proj,up_proj,down_proj}"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "total_params": self.total_params,
            "trainable_params": self.trainable_params,
            "trainable_fraction": self.trainable_params / max(self.total_params, 1),
            "by_kind": self.by_kind,
            "expert_adapters": {str(k): v for k, v in self.expert_adapters.items()},
            "tensors": [asdict(row) for row in self.rows],
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def to_text(self, max_rows: int = 40) -> str:
        lines = [
            f"trainable {self.trainable_params:,} of {self.total_params:,} parameters "
            f"({100 * self.trainable_params / max(self.total_params, 1):.3f}%)"
        ]
        lines += [f"  {kind:<18} {n:>12,}" for kind, n in sorted(self.by_kind.items())]
        for row in self.rows[:max_rows]:
            experts = f" experts={row.experts}" if row.experts is not None else ""
            target = f" adapts {row.target}" if row.target else ""
            lines.append(
                f"  {row.name} {tuple(row.shape)} {row.trainable_numel:,}/{row.numel:,}{target}{experts}"
            )
        if len(self.rows) > max_rows:
            lines.append(f"  ... {len(self.rows) - max_rows} more tensors (see trainable_parameters.json)")
        return "\n".join(lines)


def _kind(name: str) -> str:
    lora = ".lora_" in name
    if "task_router_bias" in name:
        return "task_router_bias"
    if ".mlp.router." in name:
        return "router"
    if EXPERTS_MARK in name or name.endswith(EXPERTS_MARK.rstrip(".")):
        return "lora_expert" if lora else "experts"
    if ".mlp.shared_expert" in name:
        return "lora_shared_expert" if lora else "shared_expert"
    if ".self_attn." in name:
        return "lora_attention" if lora and "_norm" not in name else "attention"
    if ".mlp." in name:
        return "lora_dense_ffn" if lora else "dense_ffn"
    if "embed_tokens" in name:
        return "embedding"
    if "lm_head" in name:
        return "lm_head"
    return "norm" if "norm" in name else "other"


def _clean(name: str) -> str:
    for prefix in ("base_model.model.",):
        if name.startswith(prefix):
            name = name[len(prefix) :]
    return name


def trainable_parameter_report(model, plan: MethodPlan | None = None) -> TrainableReport:
    """List every tensor that trains in ``model`` (a PEFT model or ours), with expert detail from ``plan``."""
    rows: list[TensorRow] = []
    total = 0
    wrapped = {}  # ParamWrapper module name -> the parameter it adapts, without PEFT's base_layer nesting
    if any(".lora_" in n for n, _ in model.named_parameters()):
        for module_name, wrapper in lora_wrappers(model):
            plain = _clean(module_name).replace(".base_layer", "")
            wrapped[_clean(module_name)] = f"{plain}.{wrapper.parameter_name}"
    num_experts = getattr(getattr(model, "config", None), "num_experts", 0) or 0
    for raw_name, param in model.named_parameters():
        name = _clean(raw_name)
        is_adapter = ".lora_" in name or ".modules_to_save." in name or "task_router_bias" in name
        if not is_adapter:
            total += param.numel()
        if not param.requires_grad:
            continue
        kind = _kind(name)
        layer = layer_of(name)
        experts = None
        trainable_numel = param.numel()
        if kind in ("experts", "lora_expert") and num_experts:
            if kind == "lora_expert":
                experts = (
                    plan.expert_selection.get(layer, []) if plan is not None else list(range(num_experts))
                )
            else:
                frozen = plan.frozen_experts.get(layer, []) if plan is not None else []
                experts = [e for e in range(num_experts) if e not in frozen]
            trainable_numel = param.numel() * len(experts) // num_experts
        owner = name.split(".lora_")[0] if ".lora_" in name else None
        rows.append(
            TensorRow(
                name,
                list(param.shape),
                param.numel(),
                trainable_numel,
                kind,
                layer,
                experts,
                wrapped.get(owner),
            )
        )
    by_kind: dict[str, int] = {}
    for row in rows:
        by_kind[row.kind] = by_kind.get(row.kind, 0) + row.trainable_numel
    expert_adapters: dict[int, list[int]] = {}
    for row in rows:
        if row.kind == "lora_expert" and row.experts and row.layer is not None:
            expert_adapters[row.layer] = row.experts
    return TrainableReport(rows, total, sum(r.trainable_numel for r in rows), by_kind, expert_adapters)
