"""The optimizer and the learning-rate schedule of a pretraining run (`Trainer` builds both from `TrainConfig`), and
`ExpertAdamW`, the AdamW a fine-tune steps LoRA on stacked experts with (each expert its own parameter)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch.optim.adamw import adamw  # torch's functional AdamW (public: torch.optim.adamw.__all__)

from moe_core.routing import Router
from moe_core.train import parallel as par
from moe_core.train.config import TrainConfig, TrainConfigError


def lr_lambda(config: TrainConfig):
    """Multiplier of the peak LR at each step: linear warmup, then cosine to ``min_lr_ratio`` or WSD
    (warmup-stable-decay, Hu et al. 2024 "MiniCPM": constant, then linear decay over the last fraction)."""
    optim, total = config.optim, config.steps
    warmup = optim.warmup(total)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if optim.schedule == "constant":
            return 1.0
        if optim.schedule == "wsd":
            decay_steps = max(1, round(optim.decay_fraction * total))
            decay_start = total - decay_steps
            if step < decay_start:
                return 1.0
            progress = min(1.0, (step - decay_start + 1) / decay_steps)
            return 1.0 - (1.0 - optim.min_lr_ratio) * progress
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return optim.min_lr_ratio + (1.0 - optim.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def build_optimizer(
    model: torch.nn.Module,
    config: TrainConfig,
    device: torch.device,
    allow_fused: bool = True,
    separate_experts: bool = False,
) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not norms, biases); fused kernel where this torch has one.
    FSDP2's DTensor parameters and plain ones (expert shards) go in separate groups: one foreach kernel
    cannot mix them. With ``optim.router_lr_scale != 1`` the routers' parameters get their own groups at
    ``lr * router_lr_scale`` (at 1 the groups are as before, so older checkpoints' optimizer states load).
    ``separate_experts``: expert shards in groups of their own, after the others, marked
    ``"experts": True`` (DeepSpeed's ZeRO partitions them over their expert-data-parallel group,
    `deepspeed_experts.mark_expert_params`); the update is the same."""
    scale = config.optim.router_lr_scale
    router_params = {
        id(p)
        for module in model.modules()
        if isinstance(module, Router) and scale != 1.0
        for p in module.parameters()
    }
    # (expert, decayed, router, sharded) -> parameters
    buckets: dict[tuple[bool, bool, bool, bool], list] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            expert = separate_experts and par.is_expert_param(name)
            key = (expert, param.ndim >= 2, id(param) in router_params, par.is_sharded(param))
            buckets.setdefault(key, []).append(param)
    groups = [
        {
            "params": params,
            "weight_decay": config.optim.weight_decay if decayed else 0.0,
            "lr": config.optim.lr * (scale if router else 1.0),
        }
        | ({"experts": True} if expert else {})
        for (expert, decayed, router, _), params in sorted(
            buckets.items(), key=lambda kv: (kv[0][0], not kv[0][1], kv[0][2], kv[0][3])
        )
    ]
    kwargs = dict(lr=config.optim.lr, betas=config.optim.betas, eps=config.optim.eps)
    if config.optim.fused is False or (
        config.optim.fused is None and not allow_fused
    ):  # FSDP2: DTensor params
        return torch.optim.AdamW(groups, foreach=True, **kwargs)
    try:
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    except (RuntimeError, ValueError) as err:
        if config.optim.fused:
            raise TrainConfigError(
                f"optim.fused=true: no fused AdamW for {device.type} here ({err}); set optim.fused=null"
            ) from None
        return torch.optim.AdamW(groups, foreach=True, **kwargs)


# ------------------------------------------------------------------------------------------------ per-expert AdamW
@dataclass(frozen=True)
class ExpertAxis:
    """Where expert ``e``'s entries of a parameter that stacks ``experts`` experts lie: ``"rows"``, the e-th of
    ``experts`` equal leading blocks (LoRA's ``A`` [E*R, I], a stack [E, O, I]); ``"columns"``, every E-th entry
    starting at ``e`` (PEFT's LoRA ``B`` [O, R*E], whose column ``j*E + e`` is expert e's). ``module``: the
    parameters of one experts module share it; an expert took tokens in a step when any of them has a non-zero
    gradient there."""

    experts: int
    layout: Literal["rows", "columns"]
    module: int

    def per_expert(self, t_X: torch.Tensor, lead: int = 0) -> torch.Tensor:
        """``t`` as ``[E, X]``: expert e's entries in row e (a view: writes reach ``t``; strided for columns).
        ``lead``: leading dimensions kept in front (``[G, *shape]`` stacks of such parameters: ``[G, E, X]``)."""
        front = t_X.shape[:lead]
        if self.layout == "rows":
            return t_X.view(*front, self.experts, -1)
        return t_X.view(*front, -1, self.experts).transpose(-1, -2)

    def took(self, grad: torch.Tensor, lead: int = 0) -> torch.Tensor:
        """``[E]`` bool (``[G, E]`` with ``lead``, as `per_expert`): the experts with a non-zero entry in
        ``grad``, reduced in ``grad``'s own layout. The largest magnitude, not ``any``: torch's CPU ``any`` over a
        dimension ran 4-10x slower at LoRA's shapes; a NaN still counts as non-zero."""
        entries = grad.abs()
        if self.layout == "rows":
            return self.per_expert(entries, lead).amax(dim=-1).ne(0)
        front = grad.shape[:lead]
        return entries.view(*front, -1, self.experts).amax(dim=-2).ne(0)  # along the contiguous rows


# ExpertAdamW's state tensors that count (not moments): their dtypes, whatever the parameter's
COUNTS = {"expert_step": torch.float32, "slot": torch.long}


@dataclass(eq=False)
class _Stacks:
    """G stacked parameters of one shape, expert layout and parameter group, and their masked AdamW state as
    ``[G, ...]`` tensors (each parameter's state holds row i of them: ``state_dict`` saves them per parameter).
    ``rows``: each parameter's experts module in the step's table of experts that took a gradient."""

    params: list[torch.Tensor]
    group_id: int
    axis: ExpertAxis  # where the experts lie in each (its module: the first parameter's)
    rows: torch.Tensor  # [G] int64
    step: torch.Tensor  # [G] float32, on the CPU as torch's AdamW keeps it: the steps each had a gradient in
    exp_avg: torch.Tensor  # [G, *shape]
    exp_avg_sq: torch.Tensor  # [G, *shape]
    expert_step: torch.Tensor  # [G, E] float32
    rows_of_state: list[dict] = field(default_factory=list)  # each parameter's state, as this made it

    def owns(self, state: dict) -> bool:
        """Whether each parameter's state is still the one this made (not replaced by a load)."""
        return all(state[p] is mine for p, mine in zip(self.params, self.rows_of_state, strict=True))


class ExpertAdamW(torch.optim.AdamW):
    """AdamW (Loshchilov & Hutter 2019) in which each expert of a stacked parameter is its own parameter: an
    expert whose entries got no gradient in a step (no token was routed to it, in any micro-batch: its gradient
    there is exactly zero) is not stepped at all: its entries, moments and step count stay as they are (lazy
    Adam, as for an embedding's rows that were not looked up). That is what torch's AdamW does to per-expert
    modules that are not run without tokens (transformers 4's Mixtral and Qwen2-MoE loop over the experts hit;
    PEFT's LoRA on them gets no gradient), and what one AdamW step over the whole stack does not: there a zero
    gradient row still moves by its momentum and weight decay, and every expert carries moments from the first
    step (as in transformers 4's OLMoE, which runs every expert, on no tokens too).

    ``expert_axes``: the stacked parameters and where their experts lie (`ExpertAxis`); every other parameter
    steps by torch's AdamW, with the given ``foreach`` / ``fused`` choice.

    - On the CPU (``masked`` false; the default there) the experts that took a gradient are read back and
      their rows (transposed where strided: ``lora_B``'s columns) stepped by torch's fused AdamW, each row a
      parameter with its own step count: bitwise torch's fused AdamW (transformers' default optimizer) on
      per-expert parameters. Moments exist only for the experts that have taken a gradient: ``state[p]``
      holds ``slot`` ([E], on the CPU: expert e's row, -1 before its first gradient), ``exp_avg`` /
      ``exp_avg_sq`` ``[n_seen, X]``, ``expert_step`` ([E], each expert's step count) and ``step`` (the steps
      the stack had a gradient in). The full Qwen1.5-MoE-A2.7B's LoRA keeps moments for 65% of its expert
      factors so (benchmarks/README.md).
    - On an accelerator (``masked``: by default wherever the stack is not on the CPU) nothing is read back: the
      update runs over whole stacks with the coefficients of an expert that took no gradient making it a no-op,
      the stacks of one shape and group as one tensor (`_Stacks`), computed as torch's multi-tensor AdamW
      computes (`_adamw_rows`: on the CPU bitwise that on per-expert parameters). ``state[p]`` holds
      ``exp_avg`` and ``exp_avg_sq`` shaped as the stack, ``expert_step`` and ``step``. A GPU fine-tuning step is bound by its
      host's dispatching: the first, per-expert version made the full OLMoE-1B-7B LoRA step on an H100 0.298 s
      against 0.160 s with one AdamW over each stack; the masked path dispatches about as many operators as
      torch's fused AdamW (`benchmarks/expert_adamw.py`).

    `load_state_dict` converts a state saved by the other path (a run saved on a GPU resumes on the CPU, and the
    other way round) or by session 30's version (``state[p]["experts"][e]``), and keeps the counts out of torch's
    cast of a loaded state to each parameter's dtype.
    """

    def __init__(
        self, params, expert_axes: dict[torch.Tensor, ExpertAxis], masked: bool | None = None, **kwargs
    ) -> None:
        for flag in ("amsgrad", "maximize", "capturable", "differentiable"):
            if kwargs.get(flag):
                raise ValueError(f"ExpertAdamW: {flag}=True is not supported for stacked expert parameters")
        super().__init__(params, **kwargs)
        self.expert_axes = expert_axes
        self.masked = masked
        # each experts module's row in the masked path's table of experts that took a gradient, per expert count
        self._rows: dict[int, dict[int, int]] = {}
        for axis in sorted(set(expert_axes.values()), key=lambda a: (a.experts, a.module)):
            rows = self._rows.setdefault(axis.experts, {})
            rows.setdefault(axis.module, len(rows))
        self._stack_cache: dict[tuple, _Stacks] = {}

    def masks(self, p: torch.Tensor) -> bool:
        """Whether ``p`` steps by the masked whole-stack update (else expert by expert)."""
        return p.device.type != "cpu" if self.masked is None else self.masked

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stacked = [
            (p, group)
            for group in self.param_groups
            for p in group["params"]
            if p.grad is not None and p in self.expert_axes
        ]
        masked = [(p, group) for p, group in stacked if self.masks(p)]
        if masked:
            self._step_masked(masked)
        listed = [(p, group) for p, group in stacked if not self.masks(p)]
        took: dict[int, torch.Tensor] = {}  # experts module -> [E] bool: the experts that got a gradient
        for p, _ in listed:
            axis = self.expert_axes[p]
            took_E = axis.took(p.grad)
            took[axis.module] = took_E if axis.module not in took else took[axis.module] | took_E
        # read on the host at once (one wait for the device per step, not one per layer)
        ids = dict(zip(took, _nonzero_lists(list(took.values())), strict=True))
        for p, group in listed:
            self._step_experts(p, group, ids[self.expert_axes[p].module])
        # the rest by torch's AdamW, the stacked parameters' gradients out of its sight meanwhile
        grads = {p: p.grad for p, _ in stacked}
        for p in grads:
            p.grad = None
        try:
            super().step()
        finally:
            for p, grad in grads.items():
                p.grad = grad
        return loss

    def _step_experts(self, p: torch.Tensor, group: dict, ids: list[int]) -> None:
        """torch's fused AdamW on experts ``ids`` of ``p``, each expert's entries (a row of its per-expert view,
        transposed first where they are strided: ``lora_B``'s columns) a parameter of its own with its own moments
        and step count; moments exist only for the experts that have taken a gradient (rows of ``exp_avg`` /
        ``exp_avg_sq``, expert e's at ``slot[e]``, added at its first gradient as AdamW makes a parameter's state
        at its first step)."""
        axis = self.expert_axes[p]
        state = self.state[p] = _compact_state(p, axis, self.state[p])
        state["step"] += 1
        if not ids:
            return
        slot = state["slot"].tolist()  # (on the CPU)
        new = [e for e in ids if slot[e] < 0]
        if new:
            seen = len(state["exp_avg"])
            for i, e in enumerate(new):
                slot[e] = seen + i
            state["slot"] = torch.tensor(slot)
            for key in ("exp_avg", "exp_avg_sq"):
                grown = state[key].new_zeros(len(new), state[key].shape[1])
                state[key] = torch.cat([state[key], grown])
        p_EX, g_EX = axis.per_expert(p), axis.per_expert(p.grad)
        # strided rows (lora_B's columns) are transposed whole into a copy and back, one pass each, where gathering
        # a row at a time would walk the whole stack once per expert (fused AdamW takes contiguous tensors)
        p_rows_EX = p_EX.contiguous()  # (p_EX itself where it is)
        p_all, g_all = p_rows_EX.unbind(0), g_EX.contiguous().unbind(0)
        p_rows, g_rows = [p_all[e] for e in ids], [g_all[e] for e in ids]
        m_all, v_all, steps = state["exp_avg"].unbind(0), state["exp_avg_sq"].unbind(0), state["expert_step"]
        beta1, beta2 = group["betas"]
        adamw(
            list(p_rows),
            list(g_rows),
            [m_all[slot[e]] for e in ids],
            [v_all[slot[e]] for e in ids],
            [],
            [steps[e] for e in ids],  # views: counted in place
            fused=True,  # every row in one kernel, each with its own step count
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )
        if p_rows_EX is not p_EX:
            p_EX.copy_(p_rows_EX)

    def _step_masked(self, pairs: list[tuple[torch.Tensor, dict]]) -> None:
        """AdamW over whole stacks, each expert's coefficients its own: an expert that took a gradient steps as
        torch's AdamW steps a parameter (its decoupled weight decay, its moments, bias corrections by its own
        step count); the others are multiplied by one and moved by zero, so stay bitwise as they were (their
        gradient is exactly zero). The stacks of one shape and group step as one ``[G, ...]`` tensor
        (`_Stacks`): a few dozen operators per shape, not per stack, for the host to dispatch."""
        buckets: dict[tuple, list[torch.Tensor]] = {}
        for p, group in pairs:
            axis = self.expert_axes[p]
            key = (id(group), p.shape, p.dtype, p.device, axis.layout, axis.experts)
            buckets.setdefault(key, []).append(p)
        stacks = [self._stacks(params, group_id) for (group_id, *_), params in buckets.items()]
        # which experts took a gradient, over every stack of their experts module: one table per expert count
        grads = [torch.stack([p.grad for p in s.params]) for s in stacks]
        tables: dict[int, torch.Tensor] = {}
        for s, g_G in zip(stacks, grads, strict=True):
            E = s.axis.experts
            if E not in tables:
                tables[E] = torch.zeros(len(self._rows[E]), E, device=g_G.device)
            tables[E].index_add_(0, s.rows, s.axis.took(g_G, lead=1).to(tables[E].dtype))
        groups = {id(group): group for _, group in pairs}
        for s, g_G in zip(stacks, grads, strict=True):
            took_GE = tables[s.axis.experts].index_select(0, s.rows).gt(0)
            self._update_stacks(s, g_G, took_GE, groups[s.group_id])

    def _update_stacks(self, s: _Stacks, g_G: torch.Tensor, took_GE: torch.Tensor, group: dict) -> None:
        s.step.add_(1)
        s.expert_step.add_(took_GE)
        p_G = torch.stack(s.params)
        _adamw_rows(
            s.axis.per_expert(p_G, lead=1),
            s.axis.per_expert(g_G, lead=1),
            s.axis.per_expert(s.exp_avg, lead=1),
            s.axis.per_expert(s.exp_avg_sq, lead=1),
            s.expert_step,
            took_GE,
            group,
        )
        for p, new in zip(s.params, p_G.unbind(0), strict=True):
            p.copy_(new)

    def _stacks(self, params: list[torch.Tensor], group_id: int) -> _Stacks:
        """The `_Stacks` of ``params`` (one shape, layout and group), as the last step left it, or made from
        their per-stack states (new, loaded, or changed since) with each state's tensors then rows of it."""
        key = (group_id, tuple(map(id, params)))
        cached = self._stack_cache.get(key)
        if cached is not None and cached.owns(self.state):
            return cached
        first = params[0]
        axis = self.expert_axes[first]
        states = []
        for p in params:
            state = self.state[p]
            if "slot" in state or "experts" in state:  # the CPU path's, as saved
                state = _masked_state(p, self.expert_axes[p], state)
            if not state:
                state = {
                    "step": torch.tensor(0.0, dtype=torch.float32),
                    "expert_step": torch.zeros(axis.experts, dtype=torch.float32, device=p.device),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.contiguous_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.contiguous_format),
                }
            states.append(state)
        rows = [self._rows[axis.experts][self.expert_axes[p].module] for p in params]
        stacks = _Stacks(
            params=list(params),
            group_id=group_id,
            axis=axis,
            rows=torch.tensor(rows, dtype=torch.long, device=first.device),
            # (a loaded state's steps sit on the device under a fused group: read once, here)
            step=torch.stack([st["step"].to(torch.float32).cpu() for st in states]),
            exp_avg=torch.stack([st["exp_avg"] for st in states]),
            exp_avg_sq=torch.stack([st["exp_avg_sq"] for st in states]),
            expert_step=torch.stack([st["expert_step"].to(torch.float32) for st in states]),
        )
        for i, p in enumerate(params):
            self.state[p] = {
                "step": stacks.step[i],
                "expert_step": stacks.expert_step[i],
                "exp_avg": stacks.exp_avg[i],
                "exp_avg_sq": stacks.exp_avg_sq[i],
            }
            stacks.rows_of_state.append(self.state[p])
        self._stack_cache[key] = stacks
        return stacks

    def load_state_dict(self, state_dict: dict) -> None:
        """Load, then convert each stack's state to the path its device steps by (a checkpoint saved on a GPU
        resumes on the CPU and the other way round)."""
        # torch casts every state tensor but "step" to its parameter's dtype (a bf16 LoRA factor would round the
        # experts' step counts; the slots would turn float): these two are kept out of its sight and put back
        counts = {
            (pid, key): state[key]
            for pid, state in state_dict["state"].items()
            for key in COUNTS
            if key in state
        }
        super().load_state_dict(
            {
                **state_dict,
                "state": {
                    pid: {k: v for k, v in state.items() if k not in COUNTS}
                    for pid, state in state_dict["state"].items()
                },
            }
        )
        saved_ids = (pid for group in state_dict["param_groups"] for pid in group["params"])
        params = (p for group in self.param_groups for p in group["params"])
        for pid, p in zip(saved_ids, params, strict=True):
            for key, kind in COUNTS.items():
                if (pid, key) in counts:
                    device = "cpu" if key == "slot" else p.device
                    self.state[p][key] = counts[pid, key].to(dtype=kind, device=device)
        self._stack_cache = {}
        for p, axis in self.expert_axes.items():
            state = self.state.get(p)
            if not state:
                continue
            self.state[p] = _masked_state(p, axis, state) if self.masks(p) else _compact_state(p, axis, state)


def _adamw_rows(
    p_RX: torch.Tensor,
    g_RX: torch.Tensor,
    m_RX: torch.Tensor,
    v_RX: torch.Tensor,
    step_R: torch.Tensor,
    took_R: torch.Tensor,
    group: dict,
) -> None:
    """torch's AdamW update, in place, on rows that are each a parameter of their own (``[..., R, X]``, one
    expert's entries a row): row r by its own step count ``step_R[r]`` (already counted), and not at all where
    ``took_R`` is 0 (multiplied by one and moved by zero: bitwise as it was, its gradient being zero).
    Every coefficient is computed in doubles and cast to the rows' dtype (float32 for bf16 rows), as torch's AdamW
    passes Python floats: on the CPU bitwise torch's AdamW (foreach) on each fp32 row."""
    beta1, beta2 = group["betas"]
    lr = group["lr"].item() if isinstance(group["lr"], torch.Tensor) else group["lr"]
    wd, eps = group["weight_decay"], group["eps"]
    step = step_R.to(torch.float64).clamp(min=1)
    bias1, bias2 = 1 - beta1**step, 1 - beta2**step

    # the coefficients in the rows' dtype, at least float32: torch's AdamW computes bf16 rows with float scalars
    # (a step size -lr / (1 - beta1^t) rounded to bf16 is off by up to 0.4%)
    dtype = torch.promote_types(p_RX.dtype, torch.float32)

    def per_row(values_R: torch.Tensor) -> torch.Tensor:  # [..., R] -> [..., R, 1]
        return values_R.to(dtype).unsqueeze(-1)

    took = took_R.to(torch.float64)
    p_RX.mul_(per_row(1 - lr * wd * took))
    if dtype == m_RX.dtype:
        m_RX.lerp_(g_RX, per_row((1 - beta1) * took))
    else:  # lerp takes a weight in its own dtype only: bf16 moments are stepped in float32
        m_RX.copy_(m_RX.to(dtype).lerp_(g_RX.to(dtype), per_row((1 - beta1) * took)))
    v_RX.mul_(per_row(beta2 * took + (1 - took))).addcmul_(g_RX, g_RX, value=1 - beta2)
    step_size = per_row(-lr / bias1 * took)
    denom_RX = v_RX.sqrt().div_(per_row(bias2.sqrt())).add_(eps)
    p_RX.add_(m_RX.mul(step_size).div_(denom_RX))  # addcdiv's order: (s m) / d


def _masked_state(p: torch.Tensor, axis: ExpertAxis, state: dict) -> dict:
    """A state of the CPU path (``slot`` rows, or the older ``experts`` dict) as the masked path's stack-shaped
    one; a masked or empty state as it is."""
    if "slot" not in state and "experts" not in state:
        return state
    out = {
        "step": state["step"],
        "expert_step": torch.zeros(axis.experts, dtype=torch.float32, device=p.device),
        "exp_avg": torch.zeros_like(p, memory_format=torch.contiguous_format),
        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.contiguous_format),
    }
    if "experts" in state:
        experts = state["experts"]  # session 30's
        ids = sorted(experts)
        for e in ids:
            out["expert_step"][e] = experts[e]["step"].to(torch.float32)
            axis.per_expert(out["exp_avg"])[e] = experts[e]["exp_avg"]
            axis.per_expert(out["exp_avg_sq"])[e] = experts[e]["exp_avg_sq"]
        return out
    slot = state["slot"].tolist()
    ids = [e for e, s in enumerate(slot) if s >= 0]
    rows = [slot[e] for e in ids]
    out["expert_step"].copy_(state["expert_step"])
    for key in ("exp_avg", "exp_avg_sq"):
        axis.per_expert(out[key])[ids] = state[key][rows].to(p.device)
    return out


def _compact_state(p: torch.Tensor, axis: ExpertAxis, state: dict) -> dict:
    """Any state as the CPU path's: ``slot`` ([E], on the CPU: expert e's row of the moments, -1 before its first
    gradient), ``exp_avg`` / ``exp_avg_sq`` ``[n, X]`` for the n experts that have taken one, ``expert_step``
    ([E]) and ``step``."""
    if "slot" in state:
        return state
    X = p.numel() // axis.experts
    out = {
        "step": state.get("step", torch.tensor(0.0, dtype=torch.float32)),
        "expert_step": torch.zeros(axis.experts, dtype=torch.float32, device=p.device),
        "slot": torch.full((axis.experts,), -1, dtype=torch.long),
        "exp_avg": p.new_zeros(0, X),
        "exp_avg_sq": p.new_zeros(0, X),
    }
    if "experts" in state:
        experts = state["experts"]  # session 30's
        ids = sorted(experts)
        moments = {key: [experts[e][key] for e in ids] for key in ("exp_avg", "exp_avg_sq")}
        steps = [experts[e]["step"].to(torch.float32) for e in ids]
    elif "expert_step" in state:
        ids = [e for e, n in enumerate(state["expert_step"].tolist()) if n > 0]
        moments = {key: list(axis.per_expert(state[key])[ids]) for key in ("exp_avg", "exp_avg_sq")}
        steps = list(state["expert_step"][ids].to(torch.float32))
    else:
        return out
    if ids:
        out["slot"][ids] = torch.arange(len(ids))
        out["expert_step"][ids] = torch.stack(steps).to(p.device)
        for key, rows in moments.items():
            out[key] = torch.stack(rows).to(p.device)
    return out


def _nonzero_lists(masks: list[torch.Tensor]) -> list[list[int]]:
    """The indices of each bool mask's true entries, read from the device in one transfer."""
    if not masks:
        return []
    flat = torch.cat(masks).cpu()
    out, start = [], 0
    for mask in masks:
        out.append(flat[start : start + len(mask)].nonzero().flatten().tolist())
        start += len(mask)
    return out
