"""What trains: freezing, LoRA targeting (attention, all experts, a chosen subset, ESFT), router-only tuning,
a task-conditioned router bias. Everything is applied to the model from outside the model file.

Legend: L = MoE layers, N = tasks, E = experts, T = tokens, B = sequences, r = LoRA rank.

LoRA on the experts is a PEFT adapter over PEFT's ``target_parameters`` (`peft.tuners.lora.layer.ParamWrapper`),
which adapts a stacked ``[E, out, in]`` parameter with per-expert factors: ``lora_A`` is ``[E*r, in]`` (expert e
owns rows ``e*r .. e*r+r-1``) and ``lora_B`` is ``[out, r*E]`` (expert e owns columns ``e, E+e, 2E+e, ...``), so
``delta_e = scale * B_e @ A_e``. Its forward is ours (`moe_core.finetune.expert_lora.ParamWrapper`): the
update is applied on the tokens routed to each expert, never as a dense delta weight. PEFT always adapts every
expert of the stack. For a subset (a chosen list, ESFT,
or all but the frozen experts) `ExpertLoraMask` zeroes the other experts' rows of A and columns of B and masks
their gradients to zero: their delta stays exactly zero, so they are bitwise unchanged by merging, and the
adapter is still an ordinary PEFT adapter that PEFT loads (the unused factors are stored as zeros).

Full fine-tuning with frozen experts: the expert stack is one tensor, so `ExpertRowFreeze` masks the frozen
experts' gradient rows and copies their saved values back after every optimizer step (AdamW's decoupled weight
decay would otherwise shrink them): they are bitwise unchanged.

The task-conditioned router bias (`TaskRouterBias`, `moe_core.task_bias`, where the loader reads it from too) is
a learned ``bias_LNE`` added to the router logits of the tokens of task n, by a forward hook on each router.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from moe_core.experts import PROJECTIONS
from moe_core.finetune.config import FinetuneConfig, FinetuneError
from moe_core.frozen_linear import use_frozen_linears
from moe_core.mapped import MappedExperts
from moe_core.quantized import QuantizedExperts
from moe_core.task_bias import TaskRouterBias, unwrap  # re-exported: users import them from here
from moe_core.train.optim import ExpertAxis
from moe_core.transformers_seam import old_checkpointing_names_quiet

_LAYER = re.compile(r"layers\.(\d+)\.")


def layer_of(name: str) -> int | None:
    match = _LAYER.search(name)
    return int(match.group(1)) if match else None


# ------------------------------------------------------------------------------------------------ expert ids
def resolve_expert_ids(
    spec: list[int] | dict[int, list[int]] | None, model_config, field_name: str = "lora.expert_ids"
) -> dict[int, list[int]]:
    """A per-MoE-layer selection from a list (the same experts everywhere) or a ``{layer: [experts]}`` dict."""
    moe_layers = model_config.moe_layer_ids
    E = model_config.num_experts
    if not spec:
        return {}
    per_layer = {layer: list(spec) for layer in moe_layers} if isinstance(spec, list) else dict(spec)
    for layer, ids in per_layer.items():
        if layer not in moe_layers:
            raise FinetuneError(
                f"{field_name}: layer {layer} is not an MoE layer; MoE layers are {moe_layers}"
            )
        bad = [e for e in ids if not 0 <= e < E]
        if bad:
            raise FinetuneError(
                f"{field_name}: layer {layer} names experts {bad}; the model has experts 0..{E - 1}"
            )
    return {layer: sorted(set(ids)) for layer, ids in sorted(per_layer.items())}


# ------------------------------------------------------------------------------------------------ ESFT
@dataclass
class RoutingUsage:
    """Per MoE layer, over the real (non-padding) tokens of a dataset: routed slots per expert and summed router
    scores per expert. Counts only, never tokens."""

    layer_ids: list[int]
    slots_LE: torch.Tensor  # float64, routed (token, slot) pairs per expert, before capacity
    scores_LE: torch.Tensor  # float64, sum over tokens of the normalized router score of each expert
    tokens: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "layer_ids": self.layer_ids,
            "tokens": self.tokens,
            "slots": self.slots_LE.tolist(),
            "scores": self.scores_LE.tolist(),
        }


@torch.no_grad()
def routing_usage(model, batches: Iterable[dict[str, torch.Tensor]]) -> RoutingUsage:
    """Run ``model`` in eval mode (routers never observe in eval: no load-balancing state moves) over batches of
    ``input_ids`` (and ``attention_mask``) and count what the router did per expert."""
    base = unwrap(model)
    config = base.config
    L, E = len(config.moe_layer_ids), config.num_experts
    slots_LE = torch.zeros(L, E, dtype=torch.float64)
    scores_LE = torch.zeros(L, E, dtype=torch.float64)
    tokens = 0
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            input_ids = batch["input_ids"]
            mask_BS = batch.get("attention_mask")
            keep_T = (
                mask_BS.reshape(-1).bool()
                if mask_BS is not None
                else torch.ones(input_ids.numel(), dtype=torch.bool)
            )
            out = base(input_ids=input_ids, attention_mask=mask_BS, use_cache=False, output_routing=True)
            tokens += int(keep_T.sum())
            for i, record in enumerate(out.routing):
                ids_TK = record.expert_ids_TK[keep_T]
                slots_LE[i] += torch.bincount(ids_TK.flatten(), minlength=E).double().cpu()
                probs_TE = record.probs_TE[keep_T].double()
                scores_LE[i] += (probs_TE / probs_TE.sum(-1, keepdim=True)).sum(0).cpu()
    finally:
        model.train(was_training)
    if tokens == 0:
        raise FinetuneError(
            "ESFT: the routing profile saw no tokens; give training data with at least one example"
        )
    return RoutingUsage(list(config.moe_layer_ids), slots_LE, scores_LE, tokens)


def select_esft_experts(
    usage: RoutingUsage,
    share: float,
    score: str = "token",
    max_experts: int | None = None,
    exclude: dict[int, list[int]] | None = None,
) -> dict[int, list[int]]:
    """ESFT selection (Wang et al. 2024): per layer, experts by descending relevance until their cumulative share of
    the relevance reaches ``share``. ``score="token"``: relevance is the share of routed slots (ESFT-Token);
    ``"gate"``: the mean router score (ESFT-Gate). Experts in ``exclude`` (frozen ones) are never selected."""
    values_LE = usage.slots_LE if score == "token" else usage.scores_LE
    selection: dict[int, list[int]] = {}
    for i, layer in enumerate(usage.layer_ids):
        share_E = values_LE[i] / values_LE[i].sum().clamp_min(1e-12)
        chosen: list[int] = []
        total = 0.0
        for e in torch.argsort(share_E, descending=True, stable=True).tolist():
            if e in (exclude or {}).get(layer, []):
                continue
            chosen.append(e)
            total += float(share_E[e])
            if total >= share - 1e-9 or (max_experts is not None and len(chosen) >= max_experts):
                break
        selection[layer] = sorted(chosen)
    return selection


# ------------------------------------------------------------------------------------------------ LoRA
def lora_wrappers(model) -> Iterator[tuple[str, Any]]:
    from peft.tuners.lora.layer import ParamWrapper  # lazy: peft, only LoRA needs it (see apply_lora)

    for name, module in model.named_modules():
        if isinstance(module, ParamWrapper):
            yield name, module


def expert_axes(model) -> dict[torch.Tensor, ExpertAxis]:
    """Where each expert's entries lie in the LoRA factors of the stacked experts (for `ExpertAdamW`): ``lora_A``
    [E*R, I] by rows, ``lora_B`` [O, R*E] by columns (module docstring); the projections of one experts module
    (one nest of wrappers) share a ``module``, as their experts share the routing."""
    axes: dict[torch.Tensor, ExpertAxis] = {}
    modules: dict[int, int] = {}
    for _, wrapper in lora_wrappers(model):
        module = modules.setdefault(id(wrapper.get_base_layer()), len(modules))  # the experts module adapted
        for adapter in wrapper.lora_A:
            axes[wrapper.lora_A[adapter].weight] = ExpertAxis(wrapper.num_experts, "rows", module)
            axes[wrapper.lora_B[adapter].weight] = ExpertAxis(wrapper.num_experts, "columns", module)
    return axes


class ExpertLoraMask:
    """Keeps the LoRA factors of non-selected experts at exactly zero (see the module docstring)."""

    def __init__(self, selection: dict[int, list[int]]) -> None:
        self.selection = selection
        self._handles: list[Any] = []

    def apply(self, peft_model, adapter: str = "default") -> None:
        for name, wrapper in lora_wrappers(peft_model):
            layer = layer_of(name)
            E = wrapper.num_experts
            chosen = self.selection.get(layer)
            if chosen is None or len(chosen) == E:
                continue
            A, B = wrapper.lora_A[adapter].weight, wrapper.lora_B[adapter].weight
            r = A.shape[0] // E
            keep_E = torch.zeros(E, dtype=A.dtype, device=A.device)
            keep_E[chosen] = 1.0
            mask_A = keep_E.repeat_interleave(r)[:, None].expand_as(A).contiguous()  # rows e*r .. e*r+r-1
            mask_B = keep_E.repeat(r)[None, :].expand_as(B).contiguous()  # columns j*E + e
            with torch.no_grad():
                A.mul_(mask_A)
                B.mul_(mask_B)
            self._handles.append(A.register_hook(lambda g, m=mask_A: g * m))
            self._handles.append(B.register_hook(lambda g, m=mask_B: g * m))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def lora_targets(
    config: FinetuneConfig, model_config, expert_selection: dict[int, list[int]] | None
) -> tuple[str | None, list[str], list[str]]:
    """(``target_modules`` regex, ``target_parameters``, ``modules_to_save``) for PEFT's LoraConfig."""
    lora = config.lora
    patterns = []
    if lora.attention:
        patterns.append(rf"model\.layers\.\d+\.self_attn\.({'|'.join(map(re.escape, lora.attention))})")
    if lora.shared_expert:
        patterns.append(r"model\.layers\.\d+\.mlp\.shared_expert\.(gate_proj|up_proj|down_proj)")
    if lora.dense_ffn:
        dense = [i for i in range(model_config.num_hidden_layers) if not model_config.is_moe_layer(i)]
        if dense:
            patterns.append(
                rf"model\.layers\.({'|'.join(map(str, dense))})\.mlp\.(gate_proj|up_proj|down_proj)"
            )
    target_modules = "|".join(f"(?:{p})" for p in patterns) or None
    projs = PROJECTIONS if model_config.ffn_activation == "swiglu" else ("up_proj", "down_proj")
    target_parameters = [
        f"model.layers.{layer}.mlp.experts.{proj}"
        for layer, ids in sorted((expert_selection or {}).items())
        if ids
        for proj in projs
    ]
    modules_to_save = ["router.gate"] if config.train_router else []
    if config.objective == "reward":  # the reward model's new head trains in full beside the adapter
        modules_to_save.append("score")
    return target_modules, target_parameters, modules_to_save


def apply_lora(
    model, config: FinetuneConfig, expert_selection: dict[int, list[int]] | None, *, routed: bool = True
):
    """Wrap ``model`` with PEFT LoRA; returns ``(peft_model, ExpertLoraMask or None)``. ``routed``: the expert
    stacks' LoRA runs on the routed tokens (`expert_lora.ParamWrapper`); False: PEFT's own ``ParamWrapper``
    forward (a dense delta per stack and step: the reference the parity tests compare with)."""
    # lazy: peft, an optional heavy dependency, is needed only for LoRA
    from peft import LoraConfig, get_peft_model

    from moe_core.finetune import expert_lora

    target_modules, target_parameters, modules_to_save = lora_targets(config, model.config, expert_selection)
    if target_modules is None and not target_parameters:
        raise FinetuneError(
            "lora: nothing to adapt (no attention projection and no selected expert); check "
            "lora.attention, lora.experts and freeze.experts"
        )
    # 4-bit experts (QLoRA) hold codes, memory-mapped per-expert ones (moe_core.mapped) one tensor per expert, not a
    # Parameter PEFT could find: their wrappers are nested by hand
    quantized = any(isinstance(m, (QuantizedExperts, MappedExperts)) for m in model.modules())
    if quantized and not routed:
        raise FinetuneError(
            "LoRA on quantized or memory-mapped per-expert experts runs on the routed tokens only (routed=True)"
        )
    peft_config = LoraConfig(
        r=config.lora.r,
        lora_alpha=config.lora.alpha,
        lora_dropout=0.0,
        bias="none",
        target_modules=target_modules
        if target_modules is not None
        else ([] if not quantized else expert_lora.DUMMY_TARGETS),
        target_parameters=(target_parameters or None) if not quantized else None,
        modules_to_save=modules_to_save or None,
    )
    expert_lora.register(peft_config, routed=routed)
    use_frozen_linears(model)  # bf16/fp16 on CPU: the frozen base's input gradients on their fast kernel
    with old_checkpointing_names_quiet():
        peft_model = get_peft_model(model, peft_config)
    if quantized and target_parameters:
        expert_lora.inject(peft_model, target_parameters)
    mask = None
    if target_parameters:
        mask = ExpertLoraMask(expert_selection or {})
        mask.apply(peft_model)
    return peft_model, mask


# ------------------------------------------------------------------------------------------------ freezing
class ExpertRowFreeze:
    """Frozen experts inside a trainable stack: gradient rows masked to zero, values restored after each step."""

    def __init__(self, model, frozen: dict[int, list[int]]) -> None:
        self.frozen = {layer: ids for layer, ids in frozen.items() if ids}
        self._saved: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._handles: list[Any] = []
        layers = unwrap(model).model.layers
        for layer, ids in self.frozen.items():
            experts = layers[layer].mlp.experts
            for proj in PROJECTIONS:
                param = getattr(experts, proj, None)
                if param is None or not param.requires_grad:
                    continue
                idx = torch.tensor(ids, device=param.device)
                self._saved.append((param, idx, param.detach()[idx].clone()))
                keep = torch.ones(param.shape[0], 1, 1, dtype=param.dtype, device=param.device)
                keep[idx] = 0
                self._handles.append(param.register_hook(lambda g, k=keep: g * k))

    @torch.no_grad()
    def restore(self) -> None:
        for param, idx, values in self._saved:
            param.index_copy_(0, idx, values)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _set_trainable(model, predicate) -> None:
    for name, param in model.named_parameters():
        param.requires_grad_(bool(predicate(name)))


# ------------------------------------------------------------------------------------------------ plan
@dataclass
class MethodPlan:
    """What `apply_method` did, for the report, the trainer callbacks and the export."""

    method: str
    expert_selection: dict[int, list[int]] = field(default_factory=dict)  # LoRA: experts with adapters
    frozen_experts: dict[int, list[int]] = field(default_factory=dict)
    train_router: bool = False
    lora_mask: ExpertLoraMask | None = None
    expert_freeze: ExpertRowFreeze | None = None
    task_bias: TaskRouterBias | None = None
    idle_experts: Literal["hold", "step"] = (
        "hold"  # optim.idle_experts: how the optimizer treats experts with no token
    )


def apply_method(
    model,
    config: FinetuneConfig,
    *,
    expert_selection: dict[int, list[int]] | None = None,
    task_names: list[str] | None = None,
):
    """Freeze, wrap and attach what ``config`` asks for. Returns ``(model_to_train, MethodPlan)``; for LoRA the
    first is a PEFT model. ``expert_selection`` is the LoRA expert subset (None: from the config; ESFT needs it
    given, see `select_esft_experts`)."""
    mc = model.config
    frozen = resolve_expert_ids(config.freeze.experts, mc, "freeze.experts") if mc.num_experts else {}
    plan = MethodPlan(
        config.method,
        frozen_experts=frozen,
        train_router=config.train_router,
        idle_experts=config.optim.idle_experts,
    )
    if config.method == "lora":
        if config.lora.experts == "none" or not mc.num_experts:
            selection: dict[int, list[int]] = {}
        elif config.lora.experts == "all":
            selection = {layer: list(range(mc.num_experts)) for layer in mc.moe_layer_ids}
        elif config.lora.experts == "list":
            selection = resolve_expert_ids(config.lora.expert_ids, mc)
        else:
            if expert_selection is None:
                raise FinetuneError(
                    "lora.experts='esft' needs the selection from a routing profile of the task's "
                    "data; compute it with routing_usage + select_esft_experts (finetune() does)"
                )
            selection = expert_selection
        selection = {
            layer: [e for e in ids if e not in frozen.get(layer, [])] for layer, ids in selection.items()
        }
        plan.expert_selection = {layer: ids for layer, ids in selection.items() if ids}
        model, plan.lora_mask = apply_lora(model, config, plan.expert_selection)
    elif config.method == "full":

        def trainable(name: str) -> bool:
            if ".mlp.router." in name:
                return config.train_router
            if config.freeze.shared_expert and ".mlp.shared_expert" in name:
                return False
            if config.freeze.embeddings and (
                name.startswith("model.embed_tokens") or name.startswith("lm_head")
            ):
                return False
            return True

        _set_trainable(model, trainable)
        if frozen:
            plan.expert_freeze = ExpertRowFreeze(model, frozen)
    elif config.method == "router":
        _set_trainable(model, lambda name: ".mlp.router." in name)
    else:  # router_bias
        _set_trainable(model, lambda name: False)
    if config.uses_task_bias:
        if not mc.num_experts:
            raise FinetuneError("a task-conditioned router bias needs an MoE model; this one is dense")
        if not task_names:
            raise FinetuneError("a task-conditioned router bias needs the task names of the training data")
        plan.task_bias = TaskRouterBias(mc.moe_layer_ids, task_names, mc.num_experts).attach(model)
    return model, plan
