"""The one place the fine-tuning trainers replace transformers' Trainer internals: its checkpoint hooks.

The Trainer's own checkpoint is one process's: rank 0 writes the model and the optimizer, every rank later loads
those. Under expert parallelism each rank holds other experts, so other LoRA factors and other optimizer
moments, and a resumed rank must get its own back. `PerRankCheckpoints` keeps the Trainer's resume logic (its
step count, its batch skipping, ``trainer_state.json``) and replaces what is saved and loaded with
`moe_core.finetune.parallel.CheckpointStore`'s per-rank files; one process is the case of one rank.

Reach into transformers (5.24, `transformers/trainer.py`): ``Trainer._save_checkpoint(model, trial)`` (called when
``save_strategy`` says so), ``Trainer._load_from_checkpoint(resume_from_checkpoint, model=None)``,
``Trainer._load_optimizer_and_scheduler(checkpoint)`` and ``Trainer._load_rng_state(checkpoint)`` (called by
``train(resume_from_checkpoint=...)``, ``_inner_training_loop``, ``_prepare_for_training`` and ``_run_epoch``). `tests/test_finetune_parallel.py::test_trainer_seam` fails loudly when
transformers renames them or stops calling them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from moe_core.finetune.config import FinetuneError
from moe_core.finetune.parallel import CheckpointStore
from moe_core.finetune.selection_bias import load_router_bias_state, router_bias_state
from moe_core.train.checkpoint import rng_state, set_rng_state
from moe_core.train.optim import ExpertAdamW

# the Trainer methods `PerRankCheckpoints` replaces, and the Trainer methods that call them (the seam test)
REPLACED = ("_save_checkpoint", "_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_rng_state")


class PerRankCheckpoints:
    """Mixed into a `transformers.Trainer` subclass: checkpoints through a `CheckpointStore` (set with
    `use_checkpoints`); without one, saving writes nothing and resuming is refused."""

    _store: CheckpointStore | None = None
    _metrics_path: Path | None = None
    _loaded: tuple[str, dict[str, Any]] | None = None

    def use_checkpoints(self, store: CheckpointStore, metrics_path: Path | None) -> None:
        self._store, self._metrics_path = store, metrics_path

    def _rank_state(self, checkpoint) -> dict[str, Any]:
        if self._store is None:
            raise FinetuneError("resuming needs checkpoint.every (no checkpoint store was set up)")
        if self._loaded is None or self._loaded[0] != str(checkpoint):
            self._store.check_layout(Path(checkpoint))
            self._loaded = (str(checkpoint), self._store.load_rank(Path(checkpoint)))
        return self._loaded[1]

    # ---------------------------------------------------------------- Trainer hooks
    def _save_checkpoint(self, model, trial) -> None:
        if self._store is None:
            return
        guard = getattr(self, "_guard", None)
        state = {
            "trainable": {
                name: p.detach().cpu().clone() for name, p in self.model.named_parameters() if p.requires_grad
            },
            # not a parameter, but moved by a trained router (`moe_core.finetune.selection_bias`)
            "router_biases": router_bias_state(self.model),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.lr_scheduler.state_dict(),
            "rng": rng_state(),
            "guard": guard.state_dict() if guard is not None else {},
        }
        self._store.save(self.state.global_step, state, self.state, self._metrics_path)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None) -> None:
        saved = self._rank_state(resume_from_checkpoint)
        params = {name: p for name, p in self.model.named_parameters() if p.requires_grad}
        if saved["trainable"].keys() != params.keys():
            missing = sorted(params.keys() - saved["trainable"].keys())[:3]
            raise FinetuneError(
                f"{resume_from_checkpoint}: its trainable tensors are not this run's (e.g. {missing} missing); "
                "resume with the config it was written with"
            )
        with torch.no_grad():
            for name, tensor in saved["trainable"].items():
                params[name].copy_(tensor)
        if "router_biases" in saved:  # (checkpoints written before it was saved resume without it)
            load_router_bias_state(self.model, saved["router_biases"], str(resume_from_checkpoint))
        guard = getattr(self, "_guard", None)
        if guard is not None and saved["guard"]:
            guard.load_state_dict(saved["guard"])

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        if checkpoint is None:
            return
        saved = self._rank_state(checkpoint)
        # AdamW's state of the stacked experts' factors, per expert (`ExpertAdamW`, either of its paths) or per
        # stack: as saved
        per_expert = any(
            "experts" in state or "expert_step" in state for state in saved["optimizer"]["state"].values()
        )
        ours = isinstance(getattr(self.optimizer, "optimizer", self.optimizer), ExpertAdamW)
        if per_expert != ours:
            saved_as, running = ("hold", "step") if per_expert else ("step", "hold")
            raise FinetuneError(
                f"{checkpoint}: its optimizer state was saved with optim.idle_experts={saved_as} and this run has "
                f"{running}; resume with --set optim.idle_experts={saved_as}"
            )
        self.optimizer.load_state_dict(saved["optimizer"])
        self.lr_scheduler.load_state_dict(saved["scheduler"])

    def _load_rng_state(self, checkpoint) -> None:
        if checkpoint is None:
            return
        set_rng_state(self._rank_state(checkpoint)["rng"])
