"""How one optimizer step reaches the weights: the native backend (torch alone) or DeepSpeed's engine.

`Trainer` (loop.py) runs one algorithm and calls its backend only where the two differ:

    model = backend.shard(model)                    before materializing (FSDP2 shards on the meta device)
    forward_model, optimizer = backend.wrap(model)  compile + DDP, or the DeepSpeed engine around our AdamW
    per micro-batch:
        with backend.accumulating(forward_model, model, last): out = forward_model(...)
        backend.backward(out.loss, last)
    grad_norm = backend.finish_gradients(model)     complete gradients and their global norm before clipping
    backend.apply_update(model, grad_norm)          a finite step: clip, AdamW step
    or backend.skip_update(losses_finite)           a non-finite one: whether it counts towards divergence
    backend.zero_grad()
    backend.after_load(); backend.close()

`NativeBackend` (``parallel.backend`` auto, gloo or nccl): one process, DDP or FSDP2 (`parallel.py`), expert
gradients summed over their data-parallel group, our clipping, AdamW and the fp16 loss scaler.
`DeepSpeedBackend` (``parallel.backend=deepspeed``): the engine does the backward, the gradient average, clipping
and the step (ZeRO 1-2); everything that touches DeepSpeed is in `deepspeed_engine.py`, its seam.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

import torch
from torch import nn

from moe_core.train import deepspeed_engine as ds_engine
from moe_core.train import parallel as par
from moe_core.train.config import TrainConfig
from moe_core.train.optim import build_optimizer


class TrainBackend(Protocol):
    scaler: torch.amp.GradScaler | None  # the fp16 loss scaler (checkpointed), None without one
    optimizer_in_rank_file: bool  # the checkpoint keeps the whole optimizer state per rank (`checkpoint.py`)

    def shard(self, model: nn.Module) -> nn.Module: ...
    def wrap(self, model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]: ...
    def accumulating(self, forward_model: nn.Module, model: nn.Module, last: bool) -> Any: ...
    def backward(self, loss: torch.Tensor, last: bool) -> None: ...
    def finish_gradients(self, model: nn.Module) -> torch.Tensor: ...
    def apply_update(self, model: nn.Module, grad_norm: torch.Tensor) -> None: ...
    def skip_update(self, losses_finite: bool) -> bool: ...
    def zero_grad(self) -> None: ...
    def after_load(self) -> None: ...
    def close(self) -> None: ...


def for_config(config: TrainConfig, state: par.ParallelState) -> TrainBackend:
    """The backend ``parallel.backend`` names (nothing is built or imported until `shard` and `wrap`)."""
    if config.parallel.backend == "deepspeed":
        return DeepSpeedBackend(config, state)
    return NativeBackend(config, state)


class NativeBackend:
    """torch alone: DDP or FSDP2 over the data-parallel ranks, expert shards synced apart, our clipping and step."""

    optimizer_in_rank_file = False

    def __init__(self, config: TrainConfig, state: par.ParallelState) -> None:
        self.config, self.state = config, state
        self.fsdp = state.distributed and config.parallel.dp_mode == "fsdp2"
        self.optimizer: torch.optim.Optimizer | None = None
        self.scaler: torch.amp.GradScaler | None = None

    def shard(self, model: nn.Module) -> nn.Module:
        """FSDP2 shards the model while it is still on the meta device: each rank then allocates its shards only."""
        return par.wrap_data_parallel(model, self.state, "fsdp2") if self.fsdp else model

    def wrap(self, model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
        """What the training forward runs (compiled, then DDP-wrapped, as configured) and the AdamW it steps."""
        forward_model = torch.compile(model) if self.config.compile else model
        if not self.fsdp:
            forward_model = par.wrap_data_parallel(forward_model, self.state, self.config.parallel.dp_mode)
        self.optimizer = build_optimizer(model, self.config, self.state.device, allow_fused=not self.fsdp)
        self.scaler = torch.amp.GradScaler("cuda") if self.config.precision == "fp16" else None
        return forward_model, self.optimizer

    def accumulating(self, forward_model: nn.Module, model: nn.Module, last: bool):
        """Data-parallel gradients sync on the last micro-batch only (DDP ``no_sync``, FSDP2's switch)."""
        return contextlib.nullcontext() if last else par.no_gradient_sync(forward_model, model)

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        loss = loss / self.config.grad_accum
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def finish_gradients(self, model: nn.Module) -> torch.Tensor:
        """Expert gradients summed over the ranks holding the same experts, unscaled (fp16), and the global
        L2 norm of the whole gradient (`parallel.global_grad_norm`)."""
        par.sync_expert_grads(model, self.state)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        return par.global_grad_norm(model, self.state).cpu()

    def apply_update(self, model: nn.Module, grad_norm: torch.Tensor) -> None:
        """Clip to ``optim.grad_clip`` by the global norm, then the AdamW (or scaler) step."""
        grad_clip = self.config.optim.grad_clip
        if grad_clip is not None and grad_norm > grad_clip:
            scale = grad_clip / (grad_norm.item() + 1e-6)
            for param in model.parameters():
                if param.grad is not None:
                    param.grad.mul_(scale)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()

    def skip_update(self, losses_finite: bool) -> bool:
        """No update. Under fp16 a finite loss with an overflowing gradient is the loss scale's fault: the scaler
        backs off and the step does not count towards divergence (returns False); otherwise it does (True)."""
        if self.scaler is not None and losses_finite:
            self.scaler.update(self.scaler.get_scale() / 2)
            return False
        return True

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def after_load(self) -> None:
        pass

    def close(self) -> None:
        pass


class DeepSpeedBackend:
    """A DeepSpeed engine (ZeRO 1-2) around the model and our AdamW (`deepspeed_engine.py`): it accumulates,
    averages, clips and steps, and skips a non-finite gradient itself (its grad norm then reads inf)."""

    optimizer_in_rank_file = True  # DeepSpeed's engine owns the optimizer's layout: its state stays per rank
    scaler = None  # fp16 is refused under this backend (`TrainConfig._check_deepspeed`)

    def __init__(self, config: TrainConfig, state: par.ParallelState) -> None:
        self.config, self.state = config, state
        self.engine = None  # built by `wrap`

    def shard(self, model: nn.Module) -> nn.Module:
        return model  # ZeRO partitions the optimizer state in `wrap` (dp_mode=fsdp2 is refused)

    def wrap(self, model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
        """The engine is what the training forward runs; the AdamW it steps is the one the LR schedule, the logged
        LR and the checkpoint's optimizer state use."""
        micro_batch = self.config.micro_batch_size(self.state.world_size)
        self.engine, optimizer = ds_engine.build_engine(model, self.config, self.state, micro_batch)
        return self.engine, optimizer

    def accumulating(self, forward_model: nn.Module, model: nn.Module, last: bool):
        return contextlib.nullcontext()  # the engine knows its accumulation boundary

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        self.engine.backward(loss)  # divides by grad_accum itself
        if not last:
            self.engine.step()  # a micro-step; the last one steps in `finish_gradients`

    def finish_gradients(self, model: nn.Module) -> torch.Tensor:
        """The boundary ``engine.step()``: clip and AdamW step, or DeepSpeed's skip of a non-finite gradient;
        returns the global norm before clipping (inf for a skipped step)."""
        return ds_engine.boundary_step(self.engine)

    def apply_update(self, model: nn.Module, grad_norm: torch.Tensor) -> None:
        pass  # done in `finish_gradients`

    def skip_update(self, losses_finite: bool) -> bool:
        return True  # DeepSpeed did not step; the step counts towards divergence

    def zero_grad(self) -> None:
        pass  # DeepSpeed clears its own buffers (and offload keeps fp32 .grad allocated)

    def after_load(self) -> None:
        """DeepSpeed steps fp32 master copies of the weights just loaded: refresh them."""
        ds_engine.restore_master_weights(self.engine)

    def close(self) -> None:
        """Release the engine and end the process group the DeepSpeed way."""
        if self.engine is not None:
            ds_engine.close_engine(self.engine)
            self.engine = None
