"""Expert parallelism under the DeepSpeed backend (``parallel.backend=deepspeed`` with ``parallel.ep_size > 1``).

Our `ExpertParallelExperts` (`parallel.py`) keep their routing, capacity, router losses and all-to-all; DeepSpeed's
ZeRO optimizer keeps their shards in its own MoE parameter groups, partitioned and reduced over the
expert-data-parallel group, as it does for its own `deepspeed.moe.layer.MoE`. Imported only by
`deepspeed_engine.build_engine`, after `deepspeed_engine.import_deepspeed` (DeepSpeed is imported at the top here).

How, against DeepSpeed 0.19.8 (each step names what of DeepSpeed it relies on):
1. The expert shards are marked the way DeepSpeed's `deepspeed.moe.experts.Experts` marks its parameters,
   ``allreduce = False`` and ``group_name = "ep_size_<P>"`` (read by `deepspeed.moe.utils.is_moe_param`), and
   their optimizer groups carry ``moe=True`` and ``name="ep_size_<P>"``, as DeepSpeed's MoE tutorial has them made
   (`deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer`).
2. DeepSpeed's expert-parallel and expert-data-parallel groups are created with its own
   `deepspeed.utils.groups._create_expert_and_data_parallel` (what `MoE.set_deepspeed_parallelism` calls) before
   the engine is built, so the engine reads them (``expert_data_parallel_group``, runtime/engine.py:2171) and its
   `_broadcast_model` broadcasts each shard inside its own expert-data-parallel group only. Its layout (E + D:
   EP groups of P consecutive ranks, expert-data-parallel groups strided by P) is `parallel.init_parallel`'s;
   `create_expert_groups` checks that rather than assuming it.
3. The one switch DeepSpeed sets by type: ``DeepSpeedEngine.has_moe_layers`` becomes true in
   `_configure_distributed_model` only for modules that are `deepspeed.moe.layer.MoE` or AutoEP's
   `AutoEPMoELayer` (runtime/engine.py:2101-2107), and it is what hands the expert groups to the ZeRO optimizer
   (`_configure_zero_optimizer`, engine.py:2684-2685, 2699) and turns on its MoE handling (runtime/zero/
   stage_1_and_2.py: `_configure_moe_settings` partitions each moe group over its expert-data-parallel group;
   `average_tensor` reduces expert gradient slices over that group; `_average_expert_grad_norms`).
   `ExpertParallelEngine` overrides `_configure_distributed_model` to set it when the model holds marked
   parameters: after DeepSpeed's own scan, before `_configure_optimizer` reads it (engine.py:621, then 682).
   `deepspeed.initialize` always builds a plain `DeepSpeedEngine`, so `build` does what it does for a plain
   module (deepspeed/__init__.py:505-590): `deepspeed.comm.init_distributed`, `DeepSpeedConfig`, the engine. The
   steps of `initialize` left out apply to what this run does not use: zero.Init, tensor parallelism, Muon
   flags, pipeline and hybrid engines, ``disable_python_gc``.

Why not AutoEP: it swaps each MoE block for its `AutoEPMoELayer` with DeepSpeed's router (its own score function
and top-k, no capacity or dropped tokens, and a load-balancing coefficient it refuses), so the model would train
a different objective; and it only finds blocks by Hugging Face presets or name patterns.

The arithmetic is the native one: ZeRO divides every gradient bucket by the world size W (``gradient_average``)
and sums expert slices over the expert-data-parallel group, i.e. (1/W) sum over the ranks holding the same
experts (`parallel.sync_expert_grads`); the gradient norm sums every rank's partition norms over the world, which
counts each expert shard once (`parallel.global_grad_norm`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from deepspeed import comm as ds_comm
from deepspeed.accelerator import get_accelerator
from deepspeed.moe.utils import is_moe_param
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.utils import groups as ds_groups

from moe_core.train.parallel import ParallelError, ParallelState, expert_modules, is_expert_param


def expert_group_name(ep_size: int) -> str:
    """DeepSpeed's name for the expert groups of this EP size (`deepspeed.moe.layer.MoE.expert_group_name`)."""
    return f"ep_size_{ep_size}"


def mark_expert_params(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: ParallelState
) -> None:
    """Expert shards (and their optimizer groups, built with ``separate_experts``) marked as DeepSpeed MoE
    parameters of this run's expert group. Only for ``ep_size > 1``: at ep_size=1 every expert is replicated
    and is an ordinary data-parallel parameter."""
    name = expert_group_name(state.ep_size)
    for param_name, param in model.named_parameters():
        if is_expert_param(param_name):
            param.allreduce = False  # `is_moe_param`: not all-reduced over the whole data-parallel world
            param.group_name = name
    for group in optimizer.param_groups:
        if group.get("experts"):
            group.update(moe=True, name=name)


def create_expert_groups(state: ParallelState) -> None:
    """DeepSpeed's expert-parallel and expert-data-parallel groups (collective: every rank calls it), checked to
    hold the same ranks as ours."""
    name = expert_group_name(state.ep_size)
    if name not in ds_groups._get_expert_parallel_group_dict():
        ds_groups._create_expert_and_data_parallel(state.ep_size)
    theirs = [
        sorted(dist.get_process_group_ranks(ds_groups._get_expert_parallel_group(name))),
        sorted(dist.get_process_group_ranks(ds_groups._get_expert_data_parallel_group(name))),
    ]
    ours = [sorted(dist.get_process_group_ranks(g)) for g in (state.ep_group, state.dp_group)]
    if theirs != ours:
        raise ParallelError(
            f"rank {state.rank}: DeepSpeed's expert groups {theirs} (expert-parallel, expert-data-parallel) differ "
            f"from this run's {ours}; parallel.init_parallel and deepspeed.utils.groups disagree on the layout"
        )


class ExpertParallelEngine(DeepSpeedEngine):
    """A `DeepSpeedEngine` that counts our expert-parallel shards as MoE layers (module docstring, step 3)."""

    def _configure_distributed_model(self, model):
        super()._configure_distributed_model(model)
        marked = {p.group_name for p in self.module.parameters() if is_moe_param(p)}
        if not marked:
            return
        missing = marked - set(self.expert_data_parallel_group)
        if missing:
            raise ParallelError(
                f"expert parameters of group(s) {sorted(missing)} but no such DeepSpeed expert group; "
                f"call deepspeed_experts.create_expert_groups before building the engine"
            )
        self.has_moe_layers = True
        self.num_experts = [m.num_experts for _, m in expert_modules(self.module)]


def build(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: dict, state: ParallelState
) -> DeepSpeedEngine:
    """The engine `deepspeed.initialize` would build for this plain module, as an `ExpertParallelEngine`; with
    ``ep_size > 1`` the expert shards in DeepSpeed's MoE groups (``optimizer``: built with ``separate_experts``)."""
    # the process group exists already (`parallel.init_parallel`); this makes deepspeed.comm run over it
    ds_comm.init_distributed(
        dist_backend=get_accelerator().communication_backend_name(), dist_init_required=False
    )
    if state.ep_size > 1:
        create_expert_groups(state)
        mark_expert_params(model, optimizer, state)
    return ExpertParallelEngine(
        args=None,
        model=model,
        optimizer=optimizer,
        config=config,
        config_class=DeepSpeedConfig(config),
        dist_init_required=False,
    )
