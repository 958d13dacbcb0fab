"""The one place the GRPO trainer (`moe_core.finetune.grpo`) relies on TRL's GRPOTrainer beyond its documented
arguments. Checked against TRL 1.16 (``trl/trainer/grpo_trainer.py``); `tests/test_finetune_grpo.py::
test_trl_seam` reads the installed TRL's source and fails loudly when any of these stops holding:

- ``rollout_func`` (a documented argument, marked experimental upstream, which warns on every construction):
  called as ``rollout_func(prompts, trainer)`` from ``GRPOTrainer._generate``, returning ``prompt_ids``,
  ``completion_ids`` and ``logprobs``; the warning is silenced here, for that construction only.
- The batch ``compute_loss`` receives (built by ``_generate_and_score_completions``): ``prompt_ids`` left-padded
  with ``prompt_mask``, ``completion_ids`` right-padded with ``completion_mask``; ``_compute_loss`` scores
  ``cat([prompt_ids, completion_ids])`` in one forward of the whole micro-batch (no chunks), calling the model
  with ``fused_lm_head=True`` (`add_fused_lm_head`'s convention, which `objectives.fused_forward` answers).
- ``aux_loss_enabled``: set in ``__init__``; True would add a transformers-style MoE aux loss on top of ours.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

TRL_CHECKED = "1.16"
BATCH_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
ROLLOUT_WARNING = "You are using 'rollout_func'"  # the start of TRL's experimental-feature warning


@contextlib.contextmanager
def rollout_func_accepted():
    """Build a GRPOTrainer with a ``rollout_func`` without TRL's experimental-feature warning (only that one)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=ROLLOUT_WARNING, category=UserWarning)
        yield


def without_trl_aux_loss(trainer) -> None:
    """Our router losses are added by the trainer itself; TRL's own MoE aux loss stays off."""
    trainer.aux_loss_enabled = False


def batch_layout(inputs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(prompt_ids_BP, prompt_mask_BP, completion_ids_BC, completion_mask_BC) of a GRPO training micro-batch;
    the forward the loss takes runs over their concatenation, [B, P + C]."""
    missing = [key for key in BATCH_KEYS if key not in inputs]
    if missing:
        raise RuntimeError(
            f"TRL's GRPO batch has no {missing} (checked against TRL {TRL_CHECKED}): moe_core.finetune.trl_seam "
            "needs updating for this TRL"
        )
    return tuple(inputs[key] for key in BATCH_KEYS)
