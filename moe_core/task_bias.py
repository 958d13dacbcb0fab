"""The task-conditioned router bias (`TaskRouterBias`): a learned ``bias_LNE`` added to the router logits of
the tokens of task n, saved beside a fine-tune's weights (no Hugging Face MoE architecture has one).

Legend: L = MoE layers, N = tasks, E = experts, T = tokens, B = sequences.

It is applied by a forward hook on each router that re-routes from the biased logits (the record's expert
choice, weights and losses all follow the bias); no model code changes. Fine-tuning trains it
(`moe_core.finetune.methods`), and `moe_core.load` attaches a saved one to the model beside it: both import it
from here, so the loader does not import the fine-tuning stack.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from moe_core.errors import MoELabError


class TaskBiasError(MoELabError):
    """A task router bias that does not fit the model, the batch or the task names it is given."""


def unwrap(model) -> Any:
    """Our `MoEForCausalLM` under a PEFT wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


class TaskRouterBias(nn.Module):
    """A learned bias ``bias_LNE`` on the router logits, per MoE layer and task; zero at start (the base routing).

    ``with bias.tasks(task_ids_B): model(...)`` routes the tokens of sequence b with task ``task_ids_B[b]``; outside
    that context the routers are untouched. Saved on its own (`save`/`load`) beside adapters and merged weights,
    since no Hugging Face MoE architecture has a per-task router bias.
    """

    FILE = "task_router_bias.safetensors"
    META = "task_router_bias.json"

    def __init__(self, layer_ids: list[int], task_names: list[str], num_experts: int) -> None:
        super().__init__()
        self.layer_ids = list(layer_ids)
        self.task_names = list(task_names)
        self.bias_LNE = nn.Parameter(torch.zeros(len(layer_ids), len(task_names), num_experts))
        self._task_ids_B: torch.Tensor | None = None
        self._handles: list[Any] = []

    def attach(self, model) -> TaskRouterBias:
        base = unwrap(model)
        routers = base.routers()
        if len(routers) != len(self.layer_ids):
            raise TaskBiasError(
                f"task router bias for {len(self.layer_ids)} MoE layers, model has {len(routers)}"
            )
        for i, router in enumerate(routers):
            self._handles.append(
                router.register_forward_hook(lambda m, args, rec, i=i: self._reroute(i, m, rec))
            )
        base.add_module("task_router_bias", self)  # so the optimizer sees the bias
        return self

    def detach(self, model) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        base = unwrap(model)
        if getattr(base, "task_router_bias", None) is self:
            delattr(base, "task_router_bias")  # nn.Module removes it from its submodules

    @contextmanager
    def tasks(self, task_ids_B: torch.Tensor | None):
        previous, self._task_ids_B = self._task_ids_B, task_ids_B
        try:
            yield
        finally:
            self._task_ids_B = previous

    def _reroute(self, i: int, router, record):
        if self._task_ids_B is None:
            return record
        T, B = record.logits_TE.shape[0], self._task_ids_B.shape[0]
        if T % B:
            raise TaskBiasError(
                f"task router bias: {T} routed tokens do not split over {B} task ids; pass one "
                "task id per sequence of the batch"
            )
        bias_TE = self.bias_LNE[i].index_select(0, self._task_ids_B.to(self.bias_LNE.device))
        bias_TE = bias_TE.repeat_interleave(T // B, dim=0).float()
        rerouted = router.route(record.logits_TE + bias_TE)
        if record.pruned_logits_TP is not None:  # a pruned router: its removed rows stay in the softmax
            rerouted = router.apply_pruned_rows(rerouted, record.pruned_logits_TP)
        return rerouted

    def save(self, out_dir: str | Path) -> None:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        save_file({"bias_LNE": self.bias_LNE.detach().cpu().contiguous()}, str(out_dir / self.FILE))
        (out_dir / self.META).write_text(
            json.dumps({"layer_ids": self.layer_ids, "tasks": self.task_names}, indent=2) + "\n"
        )

    @classmethod
    def load(cls, directory: str | Path) -> TaskRouterBias:
        directory = Path(directory)
        if not (directory / cls.META).is_file():
            raise TaskBiasError(
                f"{directory}: no {cls.META}; pass the directory a fine-tuning run saved it in"
            )
        if not (directory / cls.FILE).is_file():
            raise TaskBiasError(
                f"{directory}: {cls.META} without {cls.FILE}; export the fine-tune again (its task router bias "
                "is incomplete)"
            )
        meta = json.loads((directory / cls.META).read_text())
        bias_LNE = load_file(str(directory / cls.FILE))["bias_LNE"]
        module = cls(meta["layer_ids"], meta["tasks"], bias_LNE.shape[-1])
        with torch.no_grad():
            module.bias_LNE.copy_(bias_LNE)
        return module

    def task_ids(self, names: list[str]) -> torch.Tensor:
        unknown = sorted(set(names) - set(self.task_names))
        if unknown:
            raise TaskBiasError(f"unknown task(s) {unknown}; this bias knows {self.task_names}")
        return torch.tensor([self.task_names.index(n) for n in names])
