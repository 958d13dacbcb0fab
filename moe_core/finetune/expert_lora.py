"""LoRA on the stacked experts that costs what the routed tokens cost: PEFT's adapter, our forward.

An expert stack ``[E, O, I]`` is adapted the way PEFT adapts any stacked parameter (``target_parameters``,
`peft.tuners.lora.layer.ParamWrapper`): ``lora_A`` is ``[E*R, I]``, ``lora_B`` is ``[O, R*E]``, and one wrapper
per projection, nested. This module's `ParamWrapper` is that wrapper with the same constructor, parameters, initialization,
state-dict keys, merge and unmerge, so the adapter a run saves is an ordinary PEFT adapter and stock PEFT loads it
(with its own, slower forward). Only the forward differs:

- PEFT's forward parametrizes the stack as ``W + s B A``, which forms (and keeps for backward) the full
  ``[E, O, I]`` delta of every projection at every step, for all E experts, routed to or not;
- ours gathers the factors of every projection of the nest into one `moe_core.experts.ExpertLoRA` and calls the
  expert module once with it, which applies ``s (x A_e^T) B_e^T`` per expert on the tokens routed there (the
  sorted and grouped_mm paths; `moe_core.experts` docstring). Cost: ``2 R (I + O)`` FLOPs per routed assignment
  and projection, and ``[N, R]`` activations kept for backward, against ``E O I`` for the delta.

PEFT's switches keep their meaning: ``disable_adapter()`` (the DPO reference forward) runs the base experts,
merged adapters are not applied twice, several active adapters add up. `tests/test_expert_lora.py` holds this
forward equal to PEFT's own in outputs and gradients.

Reach into PEFT (peft 0.21: `peft/tuners/lora/layer.py` ``ParamWrapper`` and ``Linear`` (`QuantizedLinearLoRA`, LoRA
on QLoRA's 4-bit attention and shared experts), `peft/tuners/lora/config.py`
``LoraConfig._register_custom_module``, PEFT's documented experimental hook for custom LoRA layers, and
`peft/utils/constants.py` ``DUMMY_TARGET_MODULES``, its marker for a model whose targets come later): this module
is the one place;
`tests/test_expert_lora.py::test_peft_seam` fails loudly when PEFT changes what it relies on.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import warnings
from typing import Any

import torch
from peft import LoraConfig, PeftModel
from peft.tuners.lora import layer as peft_lora
from peft.utils.constants import DUMMY_TARGET_MODULES

from moe_core.experts import PROJECTIONS, ExpertLoRA, StackedExperts
from moe_core.mapped import MappedExperts
from moe_core.quantized import QuantizedLinear

DUMMY_TARGETS = DUMMY_TARGET_MODULES  # PEFT's "no module targets" marker: the targets are injected afterwards


class ParamWrapper(peft_lora.ParamWrapper):
    """PEFT's ``ParamWrapper`` for one projection of a `StackedExperts`, with a routed-token forward.

    Named as PEFT's own on purpose: PEFT 0.21 recognizes a wrapper it may nest another parameter's wrapper into
    by its class name (``__class__.__name__ == "ParamWrapper"`` in `peft/tuners/tuners_utils.py`)."""

    def __init__(self, base_layer, adapter_name: str, parameter_name: str | None = None, **kwargs) -> None:
        if parameter_name is None:
            raise ValueError(
                "expert_lora.ParamWrapper adapts an expert stack named in LoraConfig.target_parameters; "
                "target the experts module's gate_proj / up_proj / down_proj, not the module"
            )
        super().__init__(base_layer, adapter_name, parameter_name=parameter_name, **kwargs)
        if not self._did_swap_in_out_features:  # our stacks are [E, O, I], as nn.Linear weights
            raise ValueError(f"{parameter_name}: expected an [E, out, in] expert stack")

    def get_param(self) -> torch.Tensor:
        """The adapted stack; for a stack held in another form (`moe_core.quantized.QuantizedExperts`' 4-bit codes,
        QLoRA; `moe_core.mapped.MappedExperts`' per-expert tensors) a stand-in of its ``[E, O, I]`` shape on its
        device, holding no weights: PEFT reads the factor shapes, device and dtype from it (fp32, the dtype PEFT
        gives adapters of low-precision models). Experts sharded over ranks
        (`moe_core.train.parallel.ExpertParallelExperts`, under a fine-tune's expert parallelism): this rank's
        stack."""
        base = self.get_base_layer()
        param = getattr(base, self.parameter_name, None)
        if isinstance(param, torch.Tensor):
            return param
        if hasattr(base, "local_stack"):
            return base.local_stack(self.parameter_name)
        device = next(itertools.chain(base.buffers(), base.parameters())).device
        return torch.zeros((), device=device).expand(base.stack_shape(self.parameter_name))

    def dense_base(self) -> bool:
        return isinstance(getattr(self.get_base_layer(), self.parameter_name, None), torch.Tensor)

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        if isinstance(self.get_base_layer(), MappedExperts):
            raise ValueError(
                f"{self.parameter_name}: the experts are memory-mapped one tensor per expert (moe_core.mapped); "
                "stack them first: moe_core.mapped.densify_experts(model) (moe_core.finetune.export.merged_model "
                "does), then merge"
            )
        if not self.dense_base():
            raise ValueError(
                f"{self.parameter_name}: a LoRA adapter on quantized experts (QLoRA) merges into the full-precision "
                "base, not into the 4-bit codes: save the adapter and apply it to the base it was trained on "
                "(moe_core.load(<adapter dir>), or PEFT on the full-precision model)"
            )
        super().merge(safe_merge=safe_merge, adapter_names=adapter_names)

    def factors(self, adapter: str) -> tuple[torch.Tensor, torch.Tensor, float]:
        """``(A_ERI, B_EOR, scale)`` with ``delta_e = scale * B_e @ A_e``: views of the adapter's parameters in
        their own dtype (fp32), PEFT's layout as ``get_delta_factors`` reads it (``lora_A`` [E*R, I], ``lora_B``
        [O, R*E]) but not cast to the stack's dtype: the routed products run in the factors' precision, as
        PEFT's LoRA layers compute (`moe_core.experts.low_rank_delta`), whatever the base's dtype."""
        A_RI = self.lora_A[adapter].weight
        B_OR = self.lora_B[adapter].weight
        E = self.num_experts
        A_ERI = A_RI.reshape(E, -1, A_RI.shape[-1])
        B_EOR = B_OR.reshape(B_OR.shape[0], -1, E).permute(2, 0, 1)
        return A_ERI, B_EOR, self.scaling[adapter]

    def nest(self) -> list[ParamWrapper]:
        """This wrapper and the ones it wraps, outermost first (one per adapted projection)."""
        chain, layer = [], self
        while isinstance(layer, ParamWrapper):
            chain.append(layer)
            layer = layer.base_layer
        return chain

    def expert_lora(self) -> ExpertLoRA | None:
        """The active, unmerged factors of every projection in the nest; None when there are none."""
        factors: dict[str, tuple] = {}
        for wrapper in self.nest():
            if wrapper.merged:
                continue
            adapters = [a for a in wrapper.active_adapters if a in wrapper.lora_A]
            per_adapter = []
            for adapter in adapters:
                per_adapter.append(wrapper.factors(adapter))
            if per_adapter:
                factors[wrapper.parameter_name] = tuple(per_adapter)
        return ExpertLoRA(factors) if factors else None

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self._check_forward_args(x, *args, **kwargs)
        if kwargs.pop("adapter_names", None) is not None:
            raise ValueError("LoRA on expert stacks does not support mixed adapter batches")
        experts = self.get_base_layer()
        if self.disable_adapters:
            for wrapper in self.nest():
                if wrapper.merged:
                    wrapper.unmerge()
            return experts(x, *args, **kwargs)
        return experts(x, *args, lora=self.expert_lora(), **kwargs)

    def __repr__(self) -> str:
        return "routed_" + super().__repr__()


def merge_deltas(wrapper: peft_lora.ParamWrapper) -> list[torch.Tensor]:
    """What PEFT's merge adds to ``wrapper``'s ``[E, O, I]`` stack: one delta per active adapter not yet merged, in
    the order it adds them (``get_delta_weight``: in fp32 where the stack is not a tensor, memory-mapped or 4-bit).
    For a writer that adds them to one expert slice at a time (``param.data += delta``, in the weight's dtype)
    rather than to a stack in memory."""
    return [
        wrapper.get_delta_weight(a)
        for a in wrapper.active_adapters
        if a in wrapper.lora_A and a not in wrapper.merged_adapters
    ]


class QuantizedLinearLoRA(peft_lora.Linear):
    """PEFT's LoRA ``Linear`` over a `moe_core.quantized.QuantizedLinear` (QLoRA's 4-bit attention or shared-expert
    projection): ``y = base(x) + s B(A(x))`` with PEFT's own factors, initialization, scaling, dtype handling and
    state-dict keys, those of LoRA on the ``nn.Linear`` the codes stand for, so stock PEFT loads the adapter onto
    the full-precision model. The base output comes from the codes (dequantized per use); merging into them is
    refused, as for the 4-bit experts."""

    def __init__(self, base_layer, adapter_name: str, **kwargs) -> None:
        with warnings.catch_warnings():  # PEFT warns of any layer type it does not know itself
            warnings.filterwarnings("ignore", "Unsupported layer type", UserWarning)
            super().__init__(base_layer, adapter_name, **kwargs)

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        raise ValueError(
            "a LoRA adapter on a 4-bit projection (QLoRA) merges into the full-precision base, not into the "
            "codes: save the adapter and apply it to the base it was trained on (moe_core.load(<adapter dir>), "
            "or PEFT on the full-precision model)"
        )


def register(config: LoraConfig, routed: bool = True) -> LoraConfig:
    """Make ``config`` adapt every `QuantizedLinear` it targets with `QuantizedLinearLoRA` and, when ``routed``,
    every `StackedExperts` stack with `ParamWrapper` (otherwise PEFT's own, the dense-delta reference)."""
    config._register_custom_module({QuantizedLinear: QuantizedLinearLoRA})
    if routed:
        config._register_custom_module({StackedExperts: ParamWrapper})
    return config


def inject(peft_model, targets: list[str], adapter_name: str = "default") -> None:
    """Adapt expert stacks PEFT cannot see (no dense ``nn.Parameter``: `QuantizedExperts`, `MappedExperts`) with the wrappers PEFT
    would have nested there, in the order it nests them (a module's parameters in registration order, the first
    innermost), so that the adapter's keys and layout are those of LoRA on the dense stacks: it loads, with stock
    PEFT too, onto the full-precision model. ``targets``: ``model.layers.{i}.mlp.experts.{proj}`` names."""
    config = peft_model.peft_config[adapter_name]
    model = peft_model.base_model.model
    by_module: dict[str, list[str]] = {}
    for target in targets:
        module_name, _, projection = target.rpartition(".")
        by_module.setdefault(module_name, []).append(projection)
    for module_name, projections in by_module.items():
        parent_name, _, child = module_name.rpartition(".")
        parent = model.get_submodule(parent_name)
        wrapped = getattr(parent, child)
        for projection in sorted(projections, key=PROJECTIONS.index):
            wrapped = ParamWrapper(
                wrapped,
                adapter_name,
                parameter_name=projection,
                config=config,
                r=config.r,
                lora_alpha=config.lora_alpha,
            )
        setattr(parent, child, wrapped)
    config.target_parameters = sorted(set(config.target_parameters or []) | set(targets))
    peft_model.base_model.targeted_parameter_names.extend(
        t for t in targets if t not in peft_model.base_model.targeted_parameter_names
    )


UNMATCHED_WARNING = "were set but no parameter was matched"  # PEFT's, on a config whose stacks it cannot see


def add_adapter(peft_model, adapter_name: str, config: LoraConfig, **kwargs) -> None:
    """``peft_model.add_adapter(adapter_name, config)`` that reaches the expert wrappers `inject` nested by hand
    too: PEFT adds the adapter where it finds its targets (the attention, dense stacks) and cannot find an
    injected wrapper's stack (it looks for an ``nn.Parameter``), so each such wrapper gets it here the way PEFT
    adds one to a wrapper it found (``update_layer``: the same shapes, initialization and scaling)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=f".*{UNMATCHED_WARNING}", category=RuntimeWarning)
        type(peft_model).add_adapter(peft_model, adapter_name, config, **kwargs)
    for module in peft_model.modules():
        if isinstance(module, ParamWrapper) and adapter_name not in module.lora_A:
            module.update_layer(adapter_name, config.r, lora_alpha=config.lora_alpha, config=config)


@contextlib.contextmanager
def adapters_reach_injected_experts(peft_model):
    """While open, ``peft_model.add_adapter`` is `add_adapter`: for a caller that adds an adapter through PEFT's
    method, such as TRL 1.16's DPO, KTO and GRPO (``beta`` above 0) trainers, whose ``__init__`` adds a frozen copy of the policy's adapter
    named "ref" as the reference (`trl/trainer/dpo_trainer.py`). Without it, on a memory-mapped or 4-bit base
    that copy skipped the experts and TRL stopped at their factors (``ModuleDict has no attribute `ref```). A model
    that is no `PeftModel` (``method=full``, ``router``) is left as it is."""
    if not isinstance(peft_model, PeftModel):
        yield peft_model
        return
    peft_model.add_adapter = functools.partial(add_adapter, peft_model)  # the instance's, over the class's
    try:
        yield peft_model
    finally:
        del peft_model.add_adapter
