"""Distributed training applied from outside the model: process groups, expert parallelism, gradient sync.

Layout (the seed design's hierarchy): world = ep_size x dp_size, rank = dp_rank * ep_size + ep_rank.
- An expert-parallel (EP) group is ``ep_size`` consecutive ranks; together they hold all E experts, E/ep_size
  each. Tokens move inside it with `all_to_all_single` (uneven split sizes, differentiable).
- A data-parallel (DP) group is the ``dp_size`` ranks with the same ep_rank: they hold the same experts.
- Everything that is not an expert (attention, norms, embeddings, routers, shared experts) is replicated on
  every rank.

Gradients: every rank's loss is the mean over its own tokens, and the objective is the mean over the global
batch, i.e. (1/W) sum_r L_r. Replicated parameters: average over the world (DDP does it during backward).
Expert parameters: the all-to-all already brought every EP peer's gradient to the expert's owner, so they
are summed over the DP group and divided by W (`sync_expert_grads`).

`ExpertParallelExperts` replaces each MoE block's `GroupedExperts` (torchtitan keeps parallelism beside
the model in the same way). Routing stays local to each rank; the wrapper dispatches kept slots to the rank
owning their expert, runs its local experts and returns the outputs. The load-balancing loss's scope over
the ranks (``balance_scope``) is the router losses' business (`moe_core.router_losses.LoadBalance`), not
the experts'.

Note: on gloo the list form `dist.all_to_all` fails with uneven sizes; `all_to_all_single` works.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from moe_core import torch_seam
from moe_core.errors import MoELabError
from moe_core.experts import ExpertDispatch, ExpertLoRA, ExpertModule, GroupedExperts, sort_by_expert
from moe_core.routing import RoutingRecord

# Legend: T = tokens on this rank, D = model dim, E = all experts, El = experts on this rank, K = slots per
# token, A = kept slots this rank sends, R = slots this rank receives, P = ranks in the EP group.


class ParallelError(MoELabError):
    """A parallel layout that cannot work (world size, expert count, backend)."""


@dataclass
class ParallelState:
    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    ep_size: int = 1
    dp_size: int = 1
    ep_rank: int = 0
    dp_rank: int = 0
    ep_group: object = None
    dp_group: object = None
    device: torch.device = torch.device("cpu")
    backend: str | None = None
    # a one-process group this module opened (DeepSpeed's engine needs a process group even for one process)
    single_process_group: bool = False

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ParallelError("device='cuda' but torch sees no CUDA device; set device=cpu or auto")
    return torch.device(device)


def init_parallel(ep_size: int, backend: str = "auto", device: str = "auto") -> ParallelState:
    """Read torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), join the process group and
    build the EP and DP groups. Without torchrun's variables: a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dev = resolve_device(device)
    if world == 1:
        if ep_size != 1:
            raise ParallelError(
                f"parallel.ep_size={ep_size} needs {ep_size}+ processes; run with --nproc {ep_size}"
            )
        if backend == "deepspeed" and not dist.is_initialized():
            comm = "nccl" if dev.type == "cuda" else "gloo"
            dist.init_process_group(comm, rank=0, world_size=1, store=dist.HashStore())
            return ParallelState(device=dev, backend=comm, single_process_group=True)
        return ParallelState(device=dev)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if world % ep_size:
        raise ParallelError(
            f"parallel.ep_size={ep_size} does not divide the world size {world}; "
            f"use a divisor of {world}, or --nproc a multiple of {ep_size}"
        )
    if dev.type == "cuda":
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    if backend in ("auto", "deepspeed"):  # deepspeed.comm then runs over this process group
        backend = "nccl" if dev.type == "cuda" else "gloo"
    if backend == "nccl" and dev.type != "cuda":
        raise ParallelError("parallel.backend=nccl needs CUDA devices; use gloo (or auto) on CPU")
    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=10)
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world,
            timeout=timeout,
            store=_attempt_store(timeout),
            device_id=dev if dev.type == "cuda" else None,
        )
    dp_size = world // ep_size
    ep_rank, dp_rank = rank % ep_size, rank // ep_size
    ep_group = dp_group = None
    for d in range(dp_size):  # every rank must create every group, in the same order
        ranks = [d * ep_size + e for e in range(ep_size)]
        group = dist.new_group(ranks)
        if d == dp_rank:
            ep_group = group
    for e in range(ep_size):
        ranks = [d * ep_size + e for d in range(dp_size)]
        group = dist.new_group(ranks)
        if e == ep_rank:
            dp_group = group
    return ParallelState(
        world, rank, local_rank, ep_size, dp_size, ep_rank, dp_rank, ep_group, dp_group, dev, backend
    )


def _attempt_store(timeout: datetime.timedelta):
    """Under torchrun's elastic agent, the store of this attempt: the agent's TCPStore, keys prefixed by the
    restart count. The agent keeps one store for the whole job and workers connect to it without a prefix, so
    a restarted group would otherwise read the dead group's keys (gloo's peer addresses: rank 1 of the new
    group dialled the killed rank 0's old port, "Connection refused", when it got there first). None: let
    init_process_group build its store from the environment (no agent, or one that does not share its store)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timeout,
    )
    # and per process group this process opened in the attempt: a process that opens a group again (several
    # trainers in one worker) would otherwise read its previous group's gloo addresses ("Connection refused",
    # or a hang, at the second or third). Every rank opens its groups in the same order, so the counts agree
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"moe-lab/attempt_{attempt}/group_{next(_GROUPS_OPENED)}", store)


_GROUPS_OPENED = itertools.count()  # (`_attempt_store`)


def shutdown_parallel(state: ParallelState) -> None:
    if (state.distributed or state.single_process_group) and dist.is_initialized():
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------ experts
class ExpertParallelExperts(nn.Module, ExpertModule):
    """An `ExpertModule`: this rank's slice of a `GroupedExperts` (``local``), with all-to-all dispatch and
    return over the EP group; ``num_experts`` is the global E."""

    def __init__(self, experts: GroupedExperts, state: ParallelState) -> None:
        super().__init__()
        E = experts.num_experts
        if E % state.ep_size:
            raise ParallelError(
                f"num_experts={E} does not split over parallel.ep_size={state.ep_size}; "
                f"choose an ep_size that divides {E}"
            )
        self.num_experts, self.ep_size, self.ep_rank = E, state.ep_size, state.ep_rank
        self.num_local = E // state.ep_size
        self.group = state.ep_group
        first = self.ep_rank * self.num_local
        F_, D = experts.up_proj.shape[1], experts.up_proj.shape[2]
        # a model built on the meta device (`moe_core.train.build`) gets a meta shard: nothing is allocated
        # here, and each rank materializes and initializes only its own experts afterwards
        with torch.device(experts.up_proj.device):
            self.local = GroupedExperts(
                self.num_local,
                D,
                F_,
                experts.activation,
                experts.impl,
                bias=experts.expert_bias("up_proj", 0) is not None,  # gpt-oss: biases and the clamped SwiGLU
                swiglu_limit=experts.swiglu_limit,
                swiglu_alpha=experts.swiglu_alpha,
            )
        if not experts.up_proj.is_meta:
            with torch.no_grad():
                for name, param in self.local.named_parameters():
                    param.copy_(getattr(experts, name)[first : first + self.num_local])
        self.first_expert = first
        self.layer_id = -1  # set by apply_expert_parallel; names the layer in the communication telemetry
        self.comm = CommStats()

    def forward(
        self,
        x_TD: torch.Tensor,
        record: RoutingRecord,
        impl: str | None = None,
        lora: ExpertLoRA | None = None,
    ) -> torch.Tensor:
        if self.ep_size == 1:
            return self.local(x_TD, record, impl, lora)
        return self.forward_all_to_all(x_TD, record, lora, impl)

    def local_stack(self, name: str) -> torch.Tensor | None:
        """This rank's ``[El, O, I]`` stack of projection ``name``: what LoRA on the experts adapts when a
        fine-tune shards them (`moe_core.finetune.parallel`); ``lora`` factors are then this rank's too."""
        return getattr(self.local, name)

    def forward_all_to_all(
        self,
        x_TD: torch.Tensor,
        record: RoutingRecord,
        lora: ExpertLoRA | None = None,
        impl: str | None = None,
    ) -> torch.Tensor:
        """Slots to the ranks holding their experts, each expert on what it received, results back; ``lora``:
        low-rank updates of the local experts (indexed by local expert), applied on the slots they received.
        The local experts run as one grouped matmul per projection where ``impl`` (default: the local experts'
        choice, `StackedExperts.resolved_impl`) is ``grouped_mm`` and it can run, else expert by expert."""
        P, El = self.ep_size, self.num_local
        # sort kept slots by expert: experts are contiguous per rank, so this also groups them by destination
        dispatch = ExpertDispatch.of(record, self.num_experts)
        send_counts_PEl = dispatch.counts_E.view(P, El)
        comm = self.comm if self.training else CommStats()  # telemetry counts training steps only, not eval
        recv_counts_PEl = timed_all_to_all(
            send_counts_PEl, [1] * P, [1] * P, self.group, comm, self.ep_rank
        )  # counts first
        send_splits = send_counts_PEl.sum(1).tolist()
        recv_splits = recv_counts_PEl.sum(1).tolist()
        comm.tokens_recv += sum(recv_splits)  # slots this rank's experts compute: the straggler view

        x_AD = dispatch.gather(x_TD)
        x_RD = TimedAllToAll.apply(x_AD, recv_splits, send_splits, self.group, comm, self.ep_rank)
        # received: per source rank, slots sorted by local expert; regroup by local expert across sources
        local_ids_R = torch.repeat_interleave(
            torch.arange(El, device=x_TD.device).repeat(P), recv_counts_PEl.flatten().to(x_TD.device)
        )
        by_local = sort_by_expert(local_ids_R, El)
        x_SD = x_RD.index_select(0, by_local.order_A)  # sorted by local expert
        impl = impl or self.local.resolved_impl(x_RD)
        if impl == "grouped_mm" and self.local.grouped_mm_ok(x_RD, lora):
            offs_El = by_local.counts_E.cumsum(0).to(torch.int32)
            out_SD = self.local.grouped_ffn(x_SD, offs_El, lora, by_local.expert_ids_A)
        else:
            out_SD = self.local.sorted_ffn(x_SD, by_local.counts_E.tolist(), lora)
        out_RD = out_SD.index_select(0, by_local.inverse())  # back to the received order
        out_AD = TimedAllToAll.apply(out_RD, send_splits, recv_splits, self.group, comm, self.ep_rank)
        return dispatch.combine(out_AD, x_TD)


# ------------------------------------------------------------------------------------------------ telemetry
@dataclass
class CommStats:
    """One MoE layer's expert-parallel traffic on this rank since the last read: all-to-all wall time (forward
    and backward, counts included) and bytes sent to / received from the other ranks (not to itself), and the
    expert slots this rank's experts received."""

    seconds: float = 0.0
    bytes_sent: int = 0
    bytes_recv: int = 0
    tokens_recv: int = 0

    def as_list(self) -> list[float]:
        return [self.seconds, float(self.bytes_sent), float(self.bytes_recv), float(self.tokens_recv)]


def timed_all_to_all(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group, stats: CommStats, me: int
) -> torch.Tensor:
    """`all_to_all_single` (rows of ``x`` split by ``in_splits``, received by ``out_splits``), timed into
    ``stats``. On CUDA the stream is synchronized around it, so the time is the collective's, not the launch's
    (the next op waits for its output anyway)."""
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    x = x.contiguous()
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    t0 = time.perf_counter()
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    stats.seconds += time.perf_counter() - t0
    row = math.prod(x.shape[1:]) * x.element_size()  # bytes per row; a rank may send or receive no rows
    stats.bytes_sent += (sum(in_splits) - in_splits[me]) * row
    stats.bytes_recv += (sum(out_splits) - out_splits[me]) * row
    return out


class TimedAllToAll(torch.autograd.Function):
    """Differentiable `timed_all_to_all`: the backward is the all-to-all with the splits swapped, as in
    `torch.distributed.nn.functional.all_to_all_single`, and is timed into the same stats."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, stats, me):
        ctx.args = (out_splits, in_splits, group, stats, me)
        return timed_all_to_all(x, out_splits, in_splits, group, stats, me)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits, group, stats, me = ctx.args
        return timed_all_to_all(grad, in_splits, out_splits, group, stats, me), None, None, None, None, None


def comm_metrics(model: nn.Module, state: ParallelState, steps: int, seconds: float) -> dict[str, float]:
    """Expert-parallel communication since the last call, per optimizer step (collective: every rank calls it).

    ``comm/layer_<i>/a2a_ms`` (mean over ranks), ``comm/a2a_ms`` and ``comm/a2a_ms_max`` (all layers; mean and
    slowest rank), ``comm/a2a_bytes_sent|recv`` (mean per rank), ``comm/rank_<r>/a2a_bytes_sent|recv|a2a_ms``,
    ``comm/ep_rank_<j>/tokens_recv`` (slots its experts computed, mean over data-parallel replicas) and
    ``comm/tokens_recv_imbalance`` (max / mean over EP ranks: the straggler view), ``comm/frac_step`` (the share
    of step time spent in all-to-all, mean over ranks)."""
    mods = [m for _, m in expert_modules(model)]
    if not state.distributed or state.ep_size == 1 or not mods:
        return {}
    local_LX = torch.tensor(
        [m.comm.as_list() for m in mods] + [[seconds, 0.0, 0.0, 0.0]], dtype=torch.float64
    )
    for m in mods:
        m.comm = CommStats()
    gathered = [torch.empty_like(local_LX) for _ in range(state.world_size)]
    dist.all_gather(gathered, local_LX)
    all_WLX = torch.stack(gathered)
    per_WLX, step_time_W = all_WLX[:, :-1] / max(steps, 1), all_WLX[:, -1, 0]
    out: dict[str, float] = {}
    for j, m in enumerate(mods):
        out[f"comm/layer_{m.layer_id}/a2a_ms"] = per_WLX[:, j, 0].mean().item() * 1e3
    ms_W = per_WLX[..., 0].sum(1) * 1e3
    out["comm/a2a_ms"], out["comm/a2a_ms_max"] = ms_W.mean().item(), ms_W.max().item()
    sent_W, recv_W = per_WLX[..., 1].sum(1), per_WLX[..., 2].sum(1)
    out["comm/a2a_bytes_sent"], out["comm/a2a_bytes_recv"] = sent_W.mean().item(), recv_W.mean().item()
    for r in range(state.world_size):
        out[f"comm/rank_{r}/a2a_ms"] = ms_W[r].item()
        out[f"comm/rank_{r}/a2a_bytes_sent"], out[f"comm/rank_{r}/a2a_bytes_recv"] = (
            sent_W[r].item(),
            recv_W[r].item(),
        )
    tokens_W = per_WLX[..., 3].sum(1)
    tokens_P = tokens_W.view(state.dp_size, state.ep_size).mean(0)  # rank = dp_rank * ep_size + ep_rank
    for j in range(state.ep_size):
        out[f"comm/ep_rank_{j}/tokens_recv"] = tokens_P[j].item()
    out["comm/tokens_recv_imbalance"] = (tokens_P.max() / tokens_P.mean().clamp_min(1e-9)).item()
    out["comm/frac_step"] = (ms_W / 1e3 * max(steps, 1) / step_time_W.clamp_min(1e-9)).mean().item()
    return out


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, ExpertParallelExperts)]


def apply_expert_parallel(model: nn.Module, state: ParallelState) -> nn.Module:
    """Replace every MoE block's experts by this rank's `ExpertParallelExperts` (in place). Also at
    ``ep_size=1``: every distributed run then has one layout (expert gradients synced by `sync_expert_grads`,
    expert shards in their own checkpoint files) whatever its router or balancing scope."""
    if not state.distributed:
        return model
    for i, layer in enumerate(model.model.layers):
        if layer.is_moe:
            layer.mlp.experts = ExpertParallelExperts(layer.mlp.experts, state)
            layer.mlp.experts.layer_id = i
    return model


# every parameter of an expert shard carries this in its name (`ExpertParallelExperts.local`): what the
# gradient sync, the optimizer's groups and the checkpoint's per-rank expert files select by
EXPERT_MARK = ".experts.local."


def is_expert_param(name: str) -> bool:
    return EXPERT_MARK in name


def full_model_name(name: str) -> str:
    """The name of an expert shard's parameter in the whole model (`MoEForCausalLM`'s ``.experts.``)."""
    return name.replace(EXPERT_MARK, ".experts.")


# ------------------------------------------------------------------------------------------------ gradients
def wrap_data_parallel(model: nn.Module, state: ParallelState, mode: str = "ddp") -> nn.Module:
    """Data parallelism for the replicated parameters; expert shards are left out (`sync_expert_grads`).

    ``ddp``: `DistributedDataParallel`, gradients averaged over the world during backward.
    ``fsdp2``: `fully_shard` per decoder layer and at the root over a 1-D mesh of the world (ZeRO-3 style:
    parameters, gradients and optimizer state sharded, gradients reduce-scattered as averages); returns the
    same module object, now holding DTensor parameters.
    """
    if not state.distributed:
        return model
    ignored = [name for name, _ in model.named_parameters() if is_expert_param(name)]
    if mode == "fsdp2":
        mesh = init_device_mesh(state.device.type, (state.world_size,))
        ignored_params = {p for name, p in model.named_parameters() if is_expert_param(name)}
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, ignored_params=ignored_params & set(layer.parameters()) or None)
        fully_shard(model, mesh=mesh, ignored_params=ignored_params or None)
        return model

    torch_seam.ddp_ignore(model, ignored)
    device_ids = [state.device.index] if state.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, broadcast_buffers=False)


def shard_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` of dim 0 that rank ``rank`` holds under FSDP2's ``Shard(0)`` over ``world``
    ranks (``torch.chunk``'s split: chunks of ceil(rows / world), the last ones shorter or empty)."""
    chunk = math.ceil(rows / world)
    return min(rank * chunk, rows), min((rank + 1) * chunk, rows)


def is_sharded(tensor: torch.Tensor) -> bool:

    return isinstance(tensor, DTensor)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of a (possibly FSDP-sharded DTensor) tensor held by this rank."""
    return tensor.to_local() if is_sharded(tensor) else tensor


@contextlib.contextmanager
def no_gradient_sync(forward_model: nn.Module, model: nn.Module):
    """Accumulation micro-steps: skip the gradient reduction (DDP `no_sync`, FSDP2 `set_requires_gradient_sync`)."""
    if hasattr(forward_model, "no_sync"):
        with forward_model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def sync_expert_grads(model: nn.Module, state: ParallelState) -> None:
    """Sum expert gradients over the DP group (ranks holding the same experts) and divide by the world size."""
    if not state.distributed:
        return
    for name, param in model.named_parameters():
        if not is_expert_param(name) or is_sharded(param):
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        if state.dp_size > 1:
            dist.all_reduce(param.grad, group=state.dp_group)
        param.grad.div_(state.world_size)


def squared_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of squares of ``grads`` (zero for none), a float64 scalar on ``device``, for norms summed over
    groups and ranks: torch's norm of the tensors (`torch.nn.utils.get_total_norm`, as ``clip_grad_norm_``
    computes it: one fused reduction per tensor, in its dtype). Copying every gradient to float64 first, as this
    once did, cost a third of an olmoe-small CPU training step (benchmarks/README.md)."""
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.nn.utils.get_total_norm(grads, 2.0).to(device, torch.float64).square()


def global_grad_norm(model: nn.Module, state: ParallelState) -> torch.Tensor:
    """L2 norm of the full gradient: replicated parameters once, FSDP shards summed over the world, expert
    shards summed over the EP group."""
    groups: dict[str, list[torch.Tensor]] = {"replicated": [], "sharded": [], "expert": []}
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        kind = "sharded" if is_sharded(param.grad) else "expert" if is_expert_param(name) else "replicated"
        groups[kind].append(local(param.grad).detach())
    replicated_sq, sharded_sq, expert_sq = (squared_norm(grads, state.device) for grads in groups.values())
    if state.distributed:
        dist.all_reduce(sharded_sq)
        if state.ep_size > 1:
            dist.all_reduce(expert_sq, group=state.ep_group)
    return (replicated_sq + sharded_sq + expert_sq).sqrt()


def all_reduce_(tensor: torch.Tensor, state: ParallelState, op=None) -> torch.Tensor:
    if state.distributed:
        dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM)
    return tensor


def barrier(state: ParallelState) -> None:
    if state.distributed:
        dist.barrier()
