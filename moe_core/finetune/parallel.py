"""Fine-tuning on several processes: the pretraining engine's expert parallelism under the Trainer's data parallelism.

Layout (`moe_core.train.parallel`, reused: its process groups, `ExpertParallelExperts` and all-to-all): world =
ep_size x dp_size. Each rank is a data-parallel replica that trains on its own ``batch_size`` sequences per
micro-step (transformers' Trainer shards the batches); with ``parallel.ep_size`` > 1 each MoE layer's routed
experts are split over the ``ep_size`` ranks of an expert-parallel group, and tokens travel to their experts'
rank and back by all-to-all.

Order of operations, so that a run on N processes trains what one process would:
1. every rank loads the whole base model and applies the method (PEFT LoRA) with the same seed: identical
   factors everywhere, exactly those a one-process run starts from (the Trainer is built on it: TRL's DPO copies
   the adapter into its frozen reference adapter);
2. `shard_experts` then replaces each MoE layer's experts by this rank's `ExpertParallelExperts` slice and cuts
   the LoRA factors of the experts to the same slice (``lora_A [E*R, I]``: rows ``e*R .. e*R+R-1`` per expert;
   ``lora_B [O, R*E]``: columns ``j*E + e``), keeping PEFT's wrappers, names and forward;
3. the Trainer wraps the model in DDP, told to leave every expert tensor alone (`ddp_ignored_names`: DDP
   would otherwise broadcast rank 0's experts over the others', and average factors of different experts), so
   it averages the replicated trainable parameters (attention LoRA) over the world;
4. `ExpertGradients.finish_step`, after the last micro-step's backward: the expert factors' gradients (each
   already summed over its expert-parallel group by the all-to-all's backward) summed over the ranks holding
   the same experts and divided by the world size (the engine's `sync_expert_grads` rule); the step's loss
   averaged over the world; the gradient clipped by its global norm (expert part summed over the
   expert-parallel group, `global_grad_norm`'s rule); a non-finite loss or gradient on any rank makes every
   rank skip the step (`FiniteStepGuard`);
5. the adapter is gathered to rank 0 (`gathered_adapter`) and written once, in the format and with the keys and
   shapes of a one-process run's.

So N processes of ``batch_size`` B equal one process of ``batch_size`` B and ``grad_accum`` N x G (same batches,
same order), to float tolerance (tests/test_finetune_parallel.py).

Why the dense frozen weights are replicated, not sharded (FSDP2): the Trainer wraps the model itself
(accelerate's DDP, or its own FSDP plugin over the whole model), and neither leaves out the rank-local expert
tensors the way the engine's `wrap_data_parallel` does (``ignored_params``); and in an MoE the routed experts are
most of the weights (OLMoE-1B-7B 93 %, Mixtral-8x7B 97 %), which expert parallelism already splits.

Checkpoints (`CheckpointStore`, ``checkpoint.every``): each rank writes its own trainable tensors, optimizer,
scheduler and RNG state; rank 0 the Trainer's state and the metrics so far; the directory appears complete or not
at all (staged, renamed by rank 0 after every rank wrote). The Trainer resumes from it (its batch skipping, its
step count) through the hooks in `moe_core.finetune.trainer_seam`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moe_core import torch_seam
from moe_core.experts import EXPERTS_MARK, GroupedExperts
from moe_core.finetune.config import FinetuneConfig, FinetuneError
from moe_core.finetune.methods import ExpertLoraMask, MethodPlan, lora_wrappers
from moe_core.mapped import MappedExperts
from moe_core.task_bias import unwrap
from moe_core.train.parallel import (
    ExpertParallelExperts,
    ParallelState,
    barrier,
    init_parallel,
    squared_norm,
)

# Legend: E = experts, El = experts on this rank, R = LoRA rank, I / O = a projection's input / output width,
# P = ranks in the expert-parallel group.

# under expert parallelism every tensor whose name carries `EXPERTS_MARK` is this rank's own


def world_size() -> int:
    """The processes of this run: torchrun's ``WORLD_SIZE``, 1 outside torchrun."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_world(config: FinetuneConfig, world: int) -> None:
    """Refuse, before anything loads, a fine-tune that cannot run on ``world`` processes."""
    ep = config.parallel.ep_size
    if world == 1:
        if ep > 1:
            raise FinetuneError(
                f"parallel.ep_size={ep} needs {ep} or more processes: run `moe-lab finetune --nproc {ep}` (or "
                "under torchrun)"
            )
        return
    if config.objective == "grpo":
        raise FinetuneError(
            f"objective=grpo on {world} processes: GRPO fine-tunes on one process yet (each rank's rollout and "
            "its recorded routing are not gathered over ranks); use one process"
        )
    if world % ep:
        raise FinetuneError(
            f"parallel.ep_size={ep} does not divide the {world} processes; use a divisor of {world}"
        )
    if config.method != "lora":
        raise FinetuneError(
            f"method={config.method} on {world} processes: only LoRA fine-tunes run on several processes yet "
            "(the other methods train weights the ranks would have to keep in step beyond LoRA's); use "
            "method=lora, or one process"
        )
    if config.train_router:
        raise FinetuneError(
            f"freeze.router=false on {world} processes: a trained router (and its load-balancing bias) is not "
            "kept in step over ranks yet; keep the router frozen, or use one process"
        )


def check_experts_split(config: FinetuneConfig, model_config) -> None:
    """``parallel.ep_size`` must divide the expert count (read from the model's config, before its weights)."""
    ep, E = config.parallel.ep_size, model_config.num_experts
    if ep > 1 and (not E or E % ep):
        raise FinetuneError(
            f"parallel.ep_size={ep} does not divide the model's {E} experts; choose an ep_size that divides {E}"
        )


@dataclass
class FinetuneParallel:
    """This process's place in a several-process fine-tune."""

    state: ParallelState
    max_grad_norm: float | None  # the global clip (the Trainer's own clip is off: it sees one rank's norm)

    @classmethod
    def start(cls, config: FinetuneConfig) -> FinetuneParallel:
        """Join the process group torchrun set up (gloo on CPU, NCCL on GPUs) and build the groups."""
        state = init_parallel(config.parallel.ep_size, backend="auto", device="auto")
        return cls(state, config.optim.grad_clip)

    @property
    def is_main(self) -> bool:
        return self.state.is_main

    @property
    def sharded(self) -> bool:
        return self.state.ep_size > 1

    def agree_on_signal(self, signum: int) -> int:
        """The largest of every rank's ``signum`` (0: none): the signal the whole run stops for."""
        t = torch.tensor([signum], dtype=torch.int64, device=self.state.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def gradients(self, model) -> ExpertGradients:
        return ExpertGradients(self, model)


# ------------------------------------------------------------------------------------------------ sharding
def shard_experts(model, state: ParallelState, plan: MethodPlan) -> None:
    """Replace every MoE layer's experts of ``model`` (a PEFT model or ours) by this rank's slice, in place, with
    the LoRA factors of the experts cut to the same slice (see the module docstring); the expert subset mask
    (`ExpertLoraMask`) is rebuilt for the local experts."""
    base = unwrap(model)
    for i, layer in enumerate(base.model.layers):
        if not layer.is_moe:
            continue
        outer = layer.mlp.experts
        nest = outer.nest() if hasattr(outer, "nest") else []
        dense = nest[-1].base_layer if nest else outer
        if isinstance(
            dense, MappedExperts
        ):  # a Hugging Face layout memory-mapped: this layer's stacks, briefly
            dense = dense.densified()
        if not isinstance(dense, GroupedExperts):
            raise FinetuneError(
                f"layer {i}: experts of type {type(dense).__name__} cannot be split over ranks (dense stacked "
                "experts only); use parallel.ep_size=1"
            )
        sharded = ExpertParallelExperts(dense, state).to(dense.up_proj.device)
        sharded.layer_id = i
        for name, param in sharded.local.named_parameters():
            param.requires_grad_(getattr(dense, name).requires_grad)
        first, El = sharded.first_expert, sharded.num_local
        for wrapper in nest:
            _cut_factors(wrapper, first, El)
        if nest:
            nest[-1].base_layer = sharded
        else:
            layer.mlp.experts = sharded
    if plan.lora_mask is not None:
        plan.lora_mask.remove()
        plan.lora_mask = ExpertLoraMask(
            _local_selection(plan.expert_selection, state, base.config.num_experts)
        )
        plan.lora_mask.apply(model)


def _cut_factors(wrapper, first: int, El: int) -> None:
    E = wrapper.num_experts
    for adapter in list(wrapper.lora_A):
        A = wrapper.lora_A[adapter].weight  # [E*R, I]: expert e's rows e*R .. e*R+R-1
        B = wrapper.lora_B[adapter].weight  # [O, R*E]: expert e's columns j*E + e
        R = A.shape[0] // E
        A_local = A.detach().view(E, R, -1)[first : first + El].reshape(El * R, -1)
        B_local = B.detach().view(B.shape[0], R, E)[:, :, first : first + El].reshape(-1, R * El)
        wrapper.lora_A[adapter].weight = nn.Parameter(A_local.clone(), requires_grad=A.requires_grad)
        wrapper.lora_B[adapter].weight = nn.Parameter(B_local.clone(), requires_grad=B.requires_grad)
    wrapper.num_experts = El


def _local_selection(selection: dict[int, list[int]], state: ParallelState, E: int) -> dict[int, list[int]]:
    El = E // state.ep_size
    first = state.ep_rank * El
    return {layer: [e - first for e in ids if first <= e < first + El] for layer, ids in selection.items()}


def ddp_ignored_names(model) -> list[str]:
    """Names (in ``model``, the module the Trainer hands to DDP) of every rank-local expert tensor, and of every
    frozen parameter: each rank read the same base from the same files, so DDP's start-up broadcast of them
    would only cost time, and, for a base memory-mapped from its files (`moe_core.mapped`), a private copy of
    every page it writes on each rank but the first."""
    names = [n for n, p in model.named_parameters() if EXPERTS_MARK in n or not p.requires_grad]
    return names + [n for n, _ in model.named_buffers() if EXPERTS_MARK in n]


def leave_experts_to_us(model) -> None:
    """Tell DDP (which the Trainer's accelerate builds around ``model``) to neither broadcast nor reduce the
    rank-local expert tensors: `ExpertGradients` syncs their gradients."""
    torch_seam.ddp_ignore(model, ddp_ignored_names(model))


# ------------------------------------------------------------------------------------------------ gradients
class ExpertGradients:
    """The end of an optimizer step's backward on every rank (see the module docstring, step 4)."""

    def __init__(self, parallel: FinetuneParallel, model) -> None:
        self.parallel = parallel
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.expert = [p for n, p in named if parallel.sharded and EXPERTS_MARK in n]
        self.replicated = [p for n, p in named if not (parallel.sharded and EXPERTS_MARK in n)]
        self.last_norm: float | None = None

    def finish_step(self, step_loss: float) -> float:
        """Sync the expert gradients, clip by the global norm; returns the step's loss averaged over the world
        (NaN when any rank's loss or gradient was not finite: every rank then skips the step)."""
        state = self.parallel.state
        W = state.world_size
        for p in self.expert:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if state.dp_size > 1:
                dist.all_reduce(p.grad, group=state.dp_group)
            p.grad.div_(W)
        grads = [p.grad for p in self.expert + self.replicated if p.grad is not None]
        bad = sum(int(not torch.isfinite(g).all()) for g in grads)
        shared = torch.tensor([step_loss, float(bad)], dtype=torch.float64, device=state.device)
        dist.all_reduce(shared)
        loss = shared[0].item() / W if shared[1].item() == 0 else float("nan")
        self.last_norm = self._clip()
        return loss

    # the per-micro-batch metrics the trainers keep (`objectives._MoEMetrics`), averaged over the world when logged
    AVERAGED = ("lm_loss", "aux_loss", "z_loss", "mean_token_accuracy")

    def average_metrics(self, metrics: dict[str, list[float]]) -> None:
        """Replace each of `AVERAGED` in ``metrics`` (name -> this rank's values since the last log) by the mean
        over every rank's values, as one process would log them. Collective: every rank logs at the same steps."""
        names = [name for name in self.AVERAGED if name in metrics]
        if not names:
            return
        sums = torch.tensor(
            [[sum(metrics[n]), float(len(metrics[n]))] for n in names],
            dtype=torch.float64,
            device=self.parallel.state.device,
        )
        dist.all_reduce(sums)
        for name, (total, count) in zip(names, sums.tolist()):
            metrics[name] = [total / count] if count else []

    def _clip(self) -> float:
        state = self.parallel.state
        sq = [
            squared_norm([p.grad.detach() for p in params if p.grad is not None], state.device)
            for params in (self.replicated, self.expert)
        ]
        if self.expert and state.ep_size > 1:
            dist.all_reduce(sq[1], group=state.ep_group)
        norm = (sq[0] + sq[1]).sqrt()
        max_norm = self.parallel.max_grad_norm
        if max_norm:
            # torch.nn.utils.clip_grad_norm_'s rule (what the Trainer applies on one process)
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            for p in self.expert + self.replicated:
                if p.grad is not None:
                    p.grad.mul_(coef.to(p.grad.dtype))
        return norm.item()


# ------------------------------------------------------------------------------------------------ the adapter
@contextlib.contextmanager
def gathered_adapter(model, parallel: FinetuneParallel | None):
    """Within: on rank 0, the expert LoRA factors of every expert (gathered over the expert-parallel group, in a
    one-process run's layout), so the ordinary export writes the adapter a one-process run would; the local
    factors are back afterwards. Collective: every rank enters it. Not for a forward."""
    if parallel is None or not parallel.sharded:
        yield
        return
    state = parallel.state
    swapped: list[tuple[nn.Module, nn.Parameter, nn.Parameter]] = []  # (factor's Linear, local, gathered)
    wrappers = [w for name, w in lora_wrappers(model) if EXPERTS_MARK in f".{name}."]
    for wrapper in wrappers:
        El = wrapper.num_experts
        for adapter in list(wrapper.lora_A):
            for factor, module in (("A", wrapper.lora_A[adapter]), ("B", wrapper.lora_B[adapter])):
                local = module.weight.detach().contiguous()
                parts = [torch.empty_like(local) for _ in range(state.ep_size)]
                dist.all_gather(parts, local, group=state.ep_group)
                if factor == "A":  # [El*R, I] per rank, expert-major rows: the ranks' blocks in order
                    full = torch.cat(parts, 0)
                else:  # [O, R*El] per rank, column j*El + e: regroup as [O, R, E]
                    O, R = local.shape[0], local.shape[1] // El
                    full = torch.cat([p.view(O, R, El) for p in parts], 2).reshape(O, R * El * state.ep_size)
                swapped.append((module, module.weight, nn.Parameter(full, requires_grad=False)))
    try:
        for module, _, full in swapped:
            module.weight = full
        for wrapper in wrappers:
            wrapper.num_experts *= state.ep_size
        yield
    finally:
        for module, local, _ in swapped:
            module.weight = local
        for wrapper in wrappers:
            wrapper.num_experts //= state.ep_size


# ------------------------------------------------------------------------------------------------ checkpoints
CHECKPOINTS = "checkpoints"
_PREFIX = "step_"


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


class CheckpointStore:
    """``OUT/checkpoints/step_<n>``: per rank ``rank_<r>.pt`` (its trainable tensors, optimizer, scheduler, RNG,
    skipped-step count), and from rank 0 ``trainer_state.json`` (the Trainer's) and ``metrics.jsonl`` (the rows
    so far). A directory is staged under a temporary name and renamed by rank 0 once every rank wrote: one
    without the final name is incomplete and never resumed from."""

    def __init__(self, root: Path, parallel: FinetuneParallel | None, keep: int) -> None:
        self.root, self.parallel, self.keep = Path(root), parallel, keep

    @property
    def rank(self) -> int:
        return self.parallel.state.rank if self.parallel is not None else 0

    def _barrier(self) -> None:
        if self.parallel is not None:
            barrier(self.parallel.state)

    def latest(self) -> Path | None:
        done = sorted(
            p for p in self.root.glob(f"{_PREFIX}*") if p.is_dir() and p.name[len(_PREFIX) :].isdigit()
        )
        return done[-1] if done else None

    def save(self, step: int, rank_state: dict[str, Any], trainer_state, metrics: Path | None) -> Path:
        final = self.root / f"{_PREFIX}{step:08d}"
        tmp = self.root / f".tmp-{_PREFIX}{step:08d}"
        if self.rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        self._barrier()
        torch.save(rank_state, tmp / rank_file(self.rank))
        if self.rank == 0:
            trainer_state.save_to_json(str(tmp / "trainer_state.json"))
            if metrics is not None and metrics.is_file():
                shutil.copyfile(metrics, tmp / "metrics.jsonl")
        self._barrier()
        if self.rank == 0:
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            for old in sorted(self.root.glob(f"{_PREFIX}*"))[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        self._barrier()
        return final

    def load_rank(self, checkpoint: Path) -> dict[str, Any]:
        path = Path(checkpoint) / rank_file(self.rank)
        if not path.is_file():
            raise FinetuneError(
                f"{checkpoint}: no {path.name}; it was written by a run on fewer processes. Resume with the "
                "process count and parallel.ep_size it was written with"
            )
        return torch.load(path, map_location="cpu", weights_only=True)  # tensors and plain containers

    def check_layout(self, checkpoint: Path) -> None:
        """The checkpoint was written by as many processes as this run has."""
        world = self.parallel.state.world_size if self.parallel is not None else 1
        ranks = len(list(Path(checkpoint).glob("rank_*.pt")))
        if ranks != world:
            raise FinetuneError(
                f"{checkpoint} was written by {ranks} processes and this run has {world}; resume with --nproc "
                f"{ranks} (and the same parallel.ep_size)"
            )


def has_checkpoint(root: Path) -> bool:
    """Whether ``root`` (``OUT/checkpoints``) holds a complete checkpoint to resume from."""
    return CheckpointStore(root, None, 1).latest() is not None


def drop_incomplete_checkpoints(root: Path) -> None:
    """Remove ``root`` when it holds no complete checkpoint (a run killed during its first save)."""
    if root.is_dir() and not has_checkpoint(root):
        shutil.rmtree(root, ignore_errors=True)
