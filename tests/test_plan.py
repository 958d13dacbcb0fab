"""The planner (`moe_core.train.plan`, `moe-lab plan`): its activation model against what autograd really saves
(a `saved_tensors_hooks` probe: the slow reference), its parameter accounting against the dry run's, the layouts
it offers, and `moe-lab train`'s refusal of a layout that cannot work, before anything is allocated."""

from __future__ import annotations

import pytest
import torch

from moe_core.config import get_config
from moe_core.model import MoEForCausalLM
from moe_core.train import plan


def saved_bytes(model: MoEForCausalLM, ids_BS: torch.Tensor) -> int:
    """Bytes autograd saves for backward in one training forward: every saved tensor's storage once,
    parameters left out (they are the weights, not activations)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids_BS, labels=ids_BS, use_cache=False)
    assert out.loss.requires_grad
    return sum(seen.values())


CASES = [  # (preset, overrides, micro-batch, seq_len, checkpointing)
    ("switch-tiny", {"capacity_factor": None}, 2, 16, False),
    ("mixtral-tiny", {}, 3, 24, False),
    ("mixtral-tiny", {"num_key_value_heads": 4, "moe_every_n": 2, "num_hidden_layers": 3}, 2, 8, False),
    ("olmoe-tiny", {}, 1, 32, False),
    ("shared-tiny", {}, 2, 12, False),
    ("dense-tiny", {}, 2, 16, False),
    ("mixtral-tiny", {}, 2, 16, True),
    ("olmoe-tiny", {}, 2, 8, True),
]


@pytest.mark.parametrize("preset,overrides,B,S,ckpt", CASES)
def test_activation_formula_matches_saved_tensors(preset, overrides, B, S, ckpt):
    config = get_config(preset, **overrides)
    torch.manual_seed(0)
    model = MoEForCausalLM(config).train()
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids_BS = torch.randint(0, config.vocab_size, (B, S))
    measured = saved_bytes(model, ids_BS)
    predicted = sum(plan.activation_parts(config, B, S, checkpointing=ckpt).values())
    assert predicted == measured, (preset, overrides, predicted, measured)
