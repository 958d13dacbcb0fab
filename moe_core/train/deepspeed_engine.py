"""The optional DeepSpeed backend (``parallel.backend=deepspeed``, ``pip install .[deepspeed]``): the same model,
data, AdamW and LR schedule, trained through a DeepSpeed engine with ZeRO stage 1 or 2 (optimizer state, and at
stage 2 gradients, partitioned over the data-parallel ranks; Rajbhandari et al. 2020, "ZeRO") and optionally the
optimizer step offloaded to the CPU (ZeRO-Offload, Ren et al. 2021).

What `Trainer` (loop.py) does differently under this backend (through `backends.DeepSpeedBackend`):
- ``build_engine`` wraps the plain model and our own `torch.optim.AdamW` (`optim.build_optimizer`: the same
  groups and hyperparameters) in a `DeepSpeedEngine`. DeepSpeed accumulates over ``grad_accum`` micro-batches
  (it divides each micro-batch loss by it, as the native loop does), averages gradients over the world, clips
  to ``optim.grad_clip`` by the global norm and steps. The LR schedule stays ours (`optim.lr_lambda` on the
  wrapped AdamW), stepped by the loop after every step, skipped or not, as natively.
- A non-finite gradient: DeepSpeed's ZeRO optimizer finds it before the update (its overflow check, which runs
  in fp32 too), drops the gradients and does not step; its grad norm then reads inf, so the loop counts the step
  as skipped exactly as natively (`boundary_step`).
- Checkpoints stay in our format (`checkpoint.py`): the weights from the model (every rank holds them all under
  ZeRO 1-2), and in ``rank<r>-state.pt`` the wrapped AdamW's own ``state_dict``: this rank's ZeRO partitions of
  exp_avg/exp_avg_sq over DeepSpeed's flat fp32 partitions, plain tensors that load with ``weights_only=True``.
  DeepSpeed's own checkpoints (pickled objects) are never written nor read. On resume the fp32 master partitions
  are refreshed from the loaded weights (`restore_master_weights`; exact: the model is fp32).

Expert parallelism (``parallel.ep_size > 1``): our `ExpertParallelExperts` keep their routing and all-to-all,
and ZeRO keeps their shards in DeepSpeed's MoE parameter groups, partitioned and reduced over the
expert-data-parallel groups (`deepspeed_experts.py`, which says which parts of DeepSpeed it relies on). At
ep_size=1 every expert is replicated and ZeRO treats it as an ordinary data-parallel parameter.

Not supported (refused when the config is built, `TrainConfig._check_deepspeed`, naming the setting):
``dp_mode=fsdp2`` (ZeRO replaces it), ``precision=fp16`` (use bf16: autocast over fp32 weights, as natively)
and ``compile=true``.

DeepSpeed is imported only here (and in `deepspeed_experts`, which this module imports) and only when the
backend is chosen (it is an optional extra, and importing it
probes the accelerator: seconds, and a notice on CPU that this module silences, `import_deepspeed`).
"""

from __future__ import annotations

import contextlib
import io
import os
from typing import Any

import torch

from moe_core.quiet import quiet_deepspeed_cpu_notice
from moe_core.train.config import TrainConfig, TrainConfigError
from moe_core.train.optim import build_optimizer
from moe_core.train.parallel import ParallelState


def import_deepspeed():
    """``deepspeed``, imported without its CPU-accelerator notice; a clear error where the extra is missing."""
    try:
        with quiet_deepspeed_cpu_notice():
            import deepspeed  # lazy: optional heavy dependency (the `deepspeed` extra)
    except ImportError as err:
        raise TrainConfigError(
            f"parallel.backend=deepspeed needs DeepSpeed ({err}); install it with `pip install .[deepspeed]`"
        ) from None
    return deepspeed


def ds_config(config: TrainConfig, micro_batch: int, world_size: int, n_params: int) -> dict[str, Any]:
    """The DeepSpeed config of this run: batch split, clipping and ZeRO; fp32 weights (bf16 is our autocast).
    ``n_params``: the model's trainable parameter count, which bounds the communication buckets."""
    # DeepSpeed's default buckets hold 5e8 elements (2 GB in fp32), allocated afresh every step: for a model
    # smaller than that, 4 of the 4.5 s of a CPU step of mixtral-tiny (measured with cProfile: torch.empty and
    # the list clear that frees it). A bucket of the whole model reduces the same elements in one call.
    bucket = max(1, min(int(5e8), n_params))
    zero: dict[str, Any] = {
        "reduce_bucket_size": bucket,
        "allgather_bucket_size": bucket,
        "stage": config.parallel.zero_stage,
        # on CPU (gloo) there is no second stream to overlap on; off keeps the reduction order fixed
        "overlap_comm": False,
        "contiguous_gradients": True,
    }
    if config.parallel.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    return {
        "train_batch_size": micro_batch * config.grad_accum * world_size,
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": config.grad_accum,
        "gradient_clipping": config.optim.grad_clip or 0.0,
        "zero_optimization": zero,
        # our torch AdamW (the same update as the native backends), not DeepSpeed's Adam kernels: those are
        # JIT-compiled C++/CUDA ops, and ZeRO-Offload steps a torch optimizer on the CPU just the same
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,  # our telemetry logs; DeepSpeed's own step log stays quiet
        "wall_clock_breakdown": False,
    }


def build_engine(
    model: torch.nn.Module, config: TrainConfig, state: ParallelState, micro_batch: int
) -> tuple[Any, torch.optim.Optimizer]:
    """The `DeepSpeedEngine` around ``model`` and the AdamW it steps (the one the LR schedule, the logged LR and
    the checkpoint's optimizer state use: its parameters are DeepSpeed's flat fp32 partitions of this rank)."""
    import_deepspeed()
    from moe_core.train import deepspeed_experts  # lazy: imports DeepSpeed (the optional extra) at its top

    # DeepSpeed reads its device from LOCAL_RANK (torchrun sets it; a one-process run in Python does not). Set
    # for the engine's life only (`close_engine` takes it back): left behind, it makes accelerate and TRL in a
    # later fine-tune of this process take the process for a torchrun worker and wait for MASTER_ADDR.
    sets_local_rank = "LOCAL_RANK" not in os.environ
    os.environ.setdefault("LOCAL_RANK", str(state.local_rank))
    # ZeRO then swaps its params for flat partitions; expert shards in groups of their own (DeepSpeed's MoE groups)
    optimizer = build_optimizer(model, config, state.device, separate_experts=state.ep_size > 1)
    printed = io.StringIO()
    with quiet_deepspeed_cpu_notice(), contextlib.redirect_stdout(printed):
        engine = deepspeed_experts.build(
            model,
            optimizer,
            ds_config(
                config,
                micro_batch,
                state.world_size,
                sum(p.numel() for p in model.parameters() if p.requires_grad),
            ),
            state,
        )
    for line in printed.getvalue().splitlines():  # all but the CPU comm kernel's "... built successfully"
        if not line.endswith("built successfully"):
            print(line, flush=True)
    engine.moe_lab_sets_local_rank = sets_local_rank
    return engine, engine.optimizer.optimizer


def boundary_step(engine) -> torch.Tensor:
    """The last micro-batch's ``engine.step()``: clip, AdamW step (or DeepSpeed's skip on a non-finite gradient).
    Returns the global gradient norm before clipping (inf for a skipped step), as `parallel.global_grad_norm`.
    DeepSpeed decides from the gradients alone: a NaN loss gives NaN gradients, so it skips that step too."""
    engine.step()
    norm = engine.get_global_grad_norm()
    return torch.tensor(float("inf") if norm is None else float(norm), dtype=torch.float64)


def restore_master_weights(engine) -> None:
    """After the model's weights were loaded from a checkpoint: copy them into DeepSpeed's fp32 master
    partitions, which the optimizer steps (the weights are fp32, so the copy is exact)."""
    engine.optimizer.refresh_fp32_params()


def close_engine(engine) -> None:
    """Release the engine and end the process group through deepspeed.comm, which also drops DeepSpeed's cached
    groups (a later engine in this process would otherwise reach for the destroyed ones)."""
    deepspeed = import_deepspeed()
    engine.destroy()
    if deepspeed.comm.is_initialized():
        deepspeed.comm.destroy_process_group()
    if getattr(engine, "moe_lab_sets_local_rank", False):
        os.environ.pop("LOCAL_RANK", None)
