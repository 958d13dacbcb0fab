"""The optimizer and the learning-rate schedule of a pretraining run (`Trainer` builds both from `TrainConfig`)."""

from __future__ import annotations

import math

import torch

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
