"""The routers' selection bias in fine-tuning outputs: one rule, one home.

The aux-loss-free routers (``aux_free``, ``deepseek``, and the ``glm4moe`` preset's: `moe_core.routing.AuxLossFreeRouter`)
select experts with ``scores + expert_bias``, a buffer that ``router_bias_update_rate > 0`` moves after each optimizer
step (DeepSeek-V3, Liu et al. 2024, §2.1.2). It is not a parameter, so nothing that saves "the trainable tensors"
(PEFT's adapter, our resumable checkpoints) holds it unless told to; a bias left behind makes the saved model route
differently from the one that was trained and evaluated.

The rule (also in `moe_core.finetune.config`'s docstring):
- the bias moves only while its router trains (``FinetuneConfig.train_router``: `objectives.MoEStepCallback`); a
  frozen router keeps the base model's bias, as DeepSeek-V3 stopped the update (speed 0) for the last 500B
  pretraining tokens, ESFT trains with the gates frozen, and transformers never updates ``e_score_correction_bias``;
- whenever a router trained, its bias is saved with what the run writes:

  adapter (our names)  ``base_model.model.<router>.expert_bias`` in adapter_model.safetensors, beside the trained
                       gate (modules_to_save): the PeftModel's own name for the buffer, so stock PEFT's
                       ``PeftModel.from_pretrained`` loads it into the base router as it loads the adapter's other
                       tensors, and `moe_core.load` copies it there itself (`restore_router_biases`), onto
                       the full-precision base or a QLoRA output's quantized one (`moe_core.finetune.qlora`)
  adapter (HF names)   the saved gate's ``e_score_correction_bias`` (`moe_core.finetune.hf_adapter`); refused for an
                       architecture whose router has no bias (DeepSeek-V2) unless it is still zero
  merged/, hf/         the model's own buffer (``save_pretrained``; `moe_core.convert.to_hf`)
  checkpoints/         every router's bias in each ``rank_<r>.pt`` (`router_bias_state`), so a resumed run equals
                       an uninterrupted one
"""

from __future__ import annotations

from pathlib import Path

import torch
from peft.utils import ModulesToSaveWrapper
from safetensors import safe_open
from safetensors.torch import save_file

from moe_core.finetune.config import FinetuneError
from moe_core.task_bias import unwrap

BUFFER = "expert_bias"  # `AuxLossFreeRouter`'s selection bias


def _biased_routers(model) -> dict[str, torch.nn.Module]:
    """Every router of ``model`` with a selection bias, by its module name in ``model``."""
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(getattr(module, BUFFER, None), torch.Tensor) and hasattr(module, "gate")
    }


def saved_router_biases(peft_model) -> dict[str, torch.Tensor]:
    """The selection bias of each router whose trained gate the adapter saves (PEFT ``modules_to_save``: the router
    trained, so its bias may have moved), by the PeftModel's state-dict name of the buffer
    (``base_model.model.model.layers.i.mlp.router.expert_bias``), fp32."""
    return {
        f"{name}.{BUFFER}": getattr(router, BUFFER).detach().float().cpu().clone()
        for name, router in _biased_routers(peft_model).items()
        if isinstance(router.gate, ModulesToSaveWrapper)
    }


def add_router_biases(peft_model, weights_file: Path) -> None:
    """Write `saved_router_biases` into a PEFT ``adapter_model.safetensors`` that ``save_pretrained`` just wrote
    (in our module names), keeping its metadata. Nothing to add: the file is left as it is."""
    biases = saved_router_biases(peft_model)
    if not biases:
        return
    with safe_open(str(weights_file), "pt") as f:
        metadata = f.metadata()
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    tensors.update(biases)
    save_file(tensors, str(weights_file), metadata=metadata)


def restore_router_biases(peft_model, weights_file: Path) -> None:
    """Copy the routers' selection biases an adapter in our module names carries (`add_router_biases`) into the
    base routers of ``peft_model``; a key that names no router of this base, or has another expert count, is
    refused naming the file and key."""
    routers = _biased_routers(peft_model)
    with safe_open(str(weights_file), "pt") as f:
        keys = [key for key in f.keys() if key.endswith(f".{BUFFER}")]
        biases = {key: f.get_tensor(key) for key in keys}
    for key, bias in biases.items():
        router = routers.get(key.removesuffix(f".{BUFFER}"))
        if router is None or getattr(router, BUFFER).shape != bias.shape:
            raise FinetuneError(
                f"{weights_file}: key {key} is a router's selection bias of shape {tuple(bias.shape)}, which "
                "this base model has no router for (or with another expert count); is this the adapter of this "
                "base model? Give base= the model it was fine-tuned from"
            )
        with torch.no_grad():
            getattr(router, BUFFER).copy_(bias)


def router_bias_state(model) -> dict[str, torch.Tensor]:
    """Every router's selection bias, by its module name in our model (under any PEFT wrapper): for checkpoints."""
    return {
        name: getattr(r, BUFFER).detach().cpu().clone() for name, r in _biased_routers(unwrap(model)).items()
    }


def load_router_bias_state(model, state: dict[str, torch.Tensor], source: str) -> None:
    """Put `router_bias_state`'s biases back; refused naming ``source`` when they are not this model's routers."""
    routers = _biased_routers(unwrap(model))
    if state.keys() != routers.keys():
        raise FinetuneError(
            f"{source}: its routers' selection biases ({len(state)}) are not this model's ({len(routers)}); "
            "resume with the config and base model it was written with"
        )
    with torch.no_grad():
        for name, bias in state.items():
            getattr(routers[name], BUFFER).copy_(bias)
