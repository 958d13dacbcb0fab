"""A frozen base model memory-mapped from its safetensors files: fine-tuning a model larger than memory.

Legend: E = experts, O = output features, I = input features (one expert's weight is ``[O, I]``).

    from moe_core.mapped import load_mapped
    model = load_mapped("path/to/olmoe", dtype=torch.bfloat16)   # ours or a HF dir convert reads

`load_mapped` builds the model on the meta device (`moe_core.convert.open_streaming`, the plan QLoRA's streaming
loader uses too) and assigns the checkpoint's tensors to it as they are: each weight is a view of safetensors'
mapping of its file (``safe_open(..., framework="pt")`` maps every file ``MAP_PRIVATE``, read-write and
copy-on-write: a write would give the process a private copy of the page, never reach the file). Nothing is
copied, so the base costs page cache, which the kernel fills on first touch and drops under pressure, not
anonymous memory: a step reads the pages it touches (its tokens' experts, attention, embeddings rows) and a model
larger than RAM fine-tunes as long as what a step touches fits (the README's fine-tuning section says when that
pages and when QLoRA is the better choice). What does get copied into ordinary memory, being small or changing:
the router gates (a method may train them), buffers, and any tensor stored in another dtype than ``dtype``
(cast). The model keeps the `CheckpointReader` (and so the mappings) referenced as ``model.mapped_from``.

Experts: our own checkpoints store each projection as one ``[E, O, I]`` tensor, mapped as it is into a
`GroupedExperts` (every path of `moe_core.experts`, grouped_mm included). Hugging Face checkpoints store one
``[O, I]`` tensor per expert (``experts.{e}.gate_proj.weight``), in no order a stride could stack, so their
layers get `MappedExperts`: a `StackedExperts` holding those per-expert tensors, the dense stack never formed.
gpt-oss stores its experts fused and transposed, gate and up interleaved (``gate_up_proj`` [E, D, 2F]): each
expert's gate / up / down weight is a strided view of that mapping (`moe_core.convert.CheckpointReader`), and its
biases ([E, O] per projection, a few numbers per expert) are copied, with the clamped SwiGLU kept.
LoRA on them nests PEFT's wrappers by hand, as for QLoRA's `QuantizedExperts` (`expert_lora.inject`, through
``stack_shape``). To hold a merged model in memory, `densify_experts` first stacks them into ordinary memory
(`moe_core.finetune.export.merged_model` does), one layer at a time. The writers (`save_streaming`, and
`moe_core.convert.to_hf` through `stacked_tensors`: a fine-tune's exports, ``moe-lab convert to-hf``, prune,
quantize) instead add a fine-tune's adapter to each expert as they write it, a projection's stack or expert at a
time, never a stacked copy of the model, and hand what they have read to `release_pages`, so the pages leave the
process as they go. The files are never written.

Full fine-tuning keeps the copying loader: its weights change at every step. Refusals (`MappingError`, before
any weight is read): a checkpoint whose weights are not in safetensors, or stored in another dtype than asked, or
whose experts are MXFP4 (gpt-oss as published: dequantized on read, nothing would stay mapped; QLoRA fits them).
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import functools
import json
import math
import mmap
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from moe_core.convert import (
    Deferred,
    StreamingLoad,
    check_shape,
    made,
    open_streaming,
    source_dtype,
    stream_weights,
)
from moe_core.errors import MoELabError
from moe_core.experts import PROJECTIONS, GroupedExperts, StackedExperts, replace_experts
from moe_core.frozen_linear import frozen_linear, share_hooks
from moe_core.model import MoEForCausalLM


class MappingError(MoELabError):
    """A checkpoint that cannot be memory-mapped as asked; the message says why and what to do instead."""


class MappedExperts(StackedExperts):
    """A `StackedExperts` whose weights are one frozen ``[O, I]`` tensor per expert and projection (views of a
    checkpoint's file mapping, `load_mapped`), never stacked: the per-expert paths (reference, sorted, decode)
    run on them as they are, ``grouped_mm`` runs as ``sorted`` while they are the file's, and ``static`` / ``gather``,
    which read whole stacks by design, stack a copy per call (export and compiled decoding, not fine-tuning).
    Moved to a GPU (``.to("cuda")``: a copy anyway), each projection is copied into one ``[E, O, I]`` stack there
    and ``grouped_mm`` runs on it (`_apply`, `stack`).

    The tensors are frozen parameters ``{projection}_{e}``, as a `GroupedExperts`' frozen stacks are parameters:
    ``.to(device)`` moves them, parameter counts include them, and data-parallel wrappers treat them alike (a
    buffer would be broadcast at every forward). A state dict names them so, not in the stacked layout a
    checkpoint has: save after `densify_experts`, which turns the module into a `GroupedExperts`."""

    def __init__(
        self,
        num_experts: int,
        activation: str,
        shapes: dict[str, tuple[int, int]],
        impl: str = "auto",
        max_slots: int = 0,
        *,
        bias: bool = False,
        swiglu_limit: float | None = None,
        swiglu_alpha: float = 1.702,
        bias_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(num_experts, activation, impl, max_slots)
        self.projections = tuple(shapes)
        self.shapes = dict(shapes)  # projection -> (O, I) of one expert's weight
        self._stacks: dict[str, torch.Tensor] = {}  # projection -> the device stack `_apply` made (`stack`)
        for name, (O, I) in shapes.items():
            for e in range(num_experts):  # placeholders until `set_expert` (built on the meta device)
                self.register_parameter(f"{name}_{e}", nn.Parameter(torch.empty(O, I), requires_grad=False))
        # gpt-oss: its biases ([E, O] per projection, a few numbers per expert: copied, `set_bias`), the clamp
        self.init_frozen_biases(shapes, bias, bias_dtype)
        self.swiglu_limit, self.swiglu_alpha = swiglu_limit, swiglu_alpha

    @classmethod
    def shaped_like(
        cls, experts: StackedExperts, bias_dtype: torch.dtype | None, num_experts: int | None = None
    ) -> MappedExperts:
        """Placeholders of ``experts``' structure (``num_experts`` of them, default as many), to be given the
        file's tensors (`set_expert`, or a state dict with ``assign``): built on the meta device by the loader and
        by pruning."""
        return cls(
            experts.num_experts if num_experts is None else num_experts,
            experts.activation,
            experts.projection_shapes(),
            experts.impl,
            experts.max_slots,
            **experts.ffn_options(),
            bias_dtype=bias_dtype,
        )

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """``{projection: (O, I)}``: one expert's weight shape per projection it has."""
        return dict(self.shapes)

    def expert_weight(self, leaf: str) -> tuple[str, int] | None:
        """``(projection, expert)`` of a parameter name ``{projection}_{e}`` of this module; None for any other
        (a bias)."""
        p, _, e = leaf.rpartition("_")
        return (p, int(e)) if e.isdigit() and p in self.projections else None

    def stack_shape(self, name: str) -> tuple[int, int, int]:
        """``(E, O, I)``: the shape of the ``name`` stack these tensors stand for (PEFT's factor shapes)."""
        return (self.num_experts, *self.shapes[name])

    def set_expert(self, name: str, e: int, w_OI: torch.Tensor) -> None:
        """Expert ``e``'s ``name`` weight: ``w_OI`` itself (no copy), frozen."""
        setattr(self, f"{name}_{e}", nn.Parameter(w_OI, requires_grad=False))

    def set_bias(self, name: str, e: int | None, b: torch.Tensor) -> None:
        """Expert ``e``'s bias of projection ``name`` (``name_bias``; ``e`` None: all experts' [E, O]), copied in
        the bias's dtype; the first call for a projection allocates its [E, O] storage (built on the meta device)."""
        bias_EO = getattr(self, f"{name}_bias")
        if bias_EO.is_meta:
            bias_EO = nn.Parameter(torch.zeros(bias_EO.shape, dtype=bias_EO.dtype), requires_grad=False)
            setattr(self, f"{name}_bias", bias_EO)
        with torch.no_grad():
            (bias_EO if e is None else bias_EO[e]).copy_(b)

    def weights(self, name: str) -> tuple[torch.Tensor, ...] | None:
        """The E tensors of projection ``name`` (None when the experts have no such projection)."""
        if name not in self.projections:
            return None
        return tuple(getattr(self, f"{name}_{e}") for e in range(self.num_experts))

    def unbound(self) -> tuple:
        return tuple(self.weights(p) for p in PROJECTIONS)

    def stack(self, p: str) -> torch.Tensor | None:
        """The ``[E, O, I]`` stack `_apply` copied projection ``p`` into, while every ``{p}_{e}`` is still a
        view of it; None for weights that are the file's views (or were replaced since: `__setattr__` lets go
        of the stack). Called per layer and pass, so it reads no weight: a check of E views here was the
        largest host cost of the GPU LoRA step (an unbind and 64 selects per call, 33 ms of a 0.17 s step on
        an H100). A copy of the module (``copy.deepcopy``, pickling) clones every parameter apart from the
        stack: the first expert's weight is then no longer the stack's first row, and the stack is let go of."""
        stack = self._stacks.get(p)
        if stack is not None and getattr(self, f"{p}_0").data_ptr() != stack.data_ptr():
            del self._stacks[p]
            return None
        return stack

    def __setattr__(self, name: str, value) -> None:
        """`nn.Module.__setattr__`; a ``{p}_{e}`` weight replaced by anything but its row of ``p``'s stack
        (`set_expert`, an assignment, ``load_state_dict(assign=True)``) drops the stack, so ``grouped_mm`` no
        longer multiplies by what the parameters no longer hold (the sorted path reads them one by one)."""
        p, _, e = name.rpartition("_")
        stack = self.__dict__.get("_stacks", {}).get(p)
        if stack is not None and e.isdigit() and not _row_of(value, stack, int(e)):
            del self._stacks[p]
        super().__setattr__(name, value)

    def _apply(self, fn, recurse: bool = True):
        """`nn.Module._apply` (``.to(device)``, ``.cuda()``, ``.bfloat16()``, ...), except that a projection whose
        weights it would copy (another device or dtype) is copied into one ``[E, O, I]`` stack there, expert by
        expert (no host-side stack), and each ``{p}_{e}`` becomes a view of it: the state dict and the per-expert
        paths are unchanged, and ``grouped_mm`` (`stack`) runs on the GPU as for `GroupedExperts`. The mapping
        itself is read once; a call that copies nothing (the same device and dtype) keeps the views of the file."""
        for p in self.projections:
            weights = self.weights(p)
            if weights[0].is_meta:
                continue
            target = fn(torch.empty(0, dtype=weights[0].dtype, device=weights[0].device))
            if (target.device, target.dtype) == (weights[0].device, weights[0].dtype) or target.is_meta:
                continue
            stack = torch.empty((self.num_experts, *self.shapes[p]), dtype=target.dtype, device=target.device)
            with torch.no_grad():
                for e, w_OI in enumerate(weights):
                    stack[e].copy_(w_OI)
                    setattr(self, f"{p}_{e}", nn.Parameter(stack[e], requires_grad=False))
            self._stacks[p] = stack
        return super()._apply(fn, recurse)

    def project(self, p: str, e: int, x_NI: torch.Tensor, weights: tuple) -> torch.Tensor:
        return frozen_linear(x_NI, weights[PROJECTIONS.index(p)][e])

    def stacks(self, dtype: torch.dtype | None = None) -> tuple:
        stacks = (torch.stack(w) if w is not None else None for w in self.unbound())  # a copy: see the class
        return tuple(w.to(dtype) if w is not None and dtype is not None else w for w in stacks)

    def densified(self) -> GroupedExperts:
        """A `GroupedExperts` of the same weights, stacked into ordinary memory (one copy of this layer), with
        this module's hooks."""
        O, I = self.shapes["up_proj"]
        D, F_ = (I, O)
        with torch.device("meta"):  # the constructor's stacks are replaced at once: allocate nothing
            dense = GroupedExperts(
                self.num_experts, D, F_, self.activation, self.impl, self.max_slots, **self.ffn_options()
            )
        for p in PROJECTIONS:
            w = self.weights(p)
            if w is None:
                setattr(dense, p, None)
                continue
            stack = self.stack(p)  # the device stack `_apply` made: no second copy
            setattr(dense, p, nn.Parameter(torch.stack(w) if stack is None else stack, requires_grad=False))
            if self.bias_stack(p) is not None:  # gpt-oss: the biases, the same tensors
                setattr(dense, f"{p}_bias", self.bias_stack(p))
        return share_hooks(self, dense)


def _row_of(w: object, stack_EOI: torch.Tensor, e: int) -> bool:
    """Whether ``w`` is ``stack_EOI[e]``'s memory: the same place, shape, dtype and device."""
    return (
        isinstance(w, torch.Tensor)
        and w.device == stack_EOI.device
        and w.dtype == stack_EOI.dtype
        and w.shape == stack_EOI.shape[1:]
        and w.data_ptr() == stack_EOI[e].data_ptr()
    )


def densify_experts(model: nn.Module) -> int:
    """Replace every `MappedExperts` of ``model`` (also under PEFT's wrappers) by its `densified` twin, in place,
    one layer at a time: what a merge (which adds into the stacks) and a save (which writes stacks) need.
    Returns how many were replaced."""
    replaced = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, MappedExperts):
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, module.densified())
            replaced += 1
    return replaced


def mapping_refusal(path: str | os.PathLike, dtype: torch.dtype | str | None = None) -> str | None:
    """Why the checkpoint directory at ``path`` cannot be memory-mapped in ``dtype`` (None when it can; ``dtype``
    None: its own), from its config, file names and safetensors headers alone: what to tell the user before any
    weight is read. A directory that is no model checkpoint at all raises `MappingError`."""
    return _refusal(open_streaming(path, dtype, MappingError, "memory-mapping"))


def _refusal(opened: StreamingLoad) -> str | None:
    files = sorted({f.name for f in opened.reader.file_of.values() if f.suffix != ".safetensors"})
    if files:
        return f"its weights are not safetensors ({', '.join(files[:3])}); only safetensors files are mapped"
    mxfp4 = opened.reader.dequantized_on_read()
    if mxfp4:  # gpt-oss as published: MXFP4 experts, dequantized as they are read
        return (
            f"its experts are stored as MXFP4 blocks ({mxfp4[0]}, ...), dequantized on read into ordinary memory, "
            "so nothing of them would stay mapped; QLoRA (quantize.base=nf4) holds them in 4 bits instead"
        )
    stored = source_dtype(opened.reader)
    if stored != opened.dtype:
        return (
            f"its weights are stored in {str(stored).removeprefix('torch.')}, the model would run in "
            f"{str(opened.dtype).removeprefix('torch.')}: a cast is a copy"
        )
    return None


def load_mapped(path: str | os.PathLike, dtype: torch.dtype | str | None = None) -> MoEForCausalLM:
    """Our model from the checkpoint at ``path`` (ours or a Hugging Face MoE, safetensors), its weights
    memory-mapped from the files (module docstring); ``dtype`` default: the checkpoint's own, and it must be.
    In eval mode, every mapped weight frozen (``requires_grad`` False)."""
    opened = open_streaming(path, dtype, MappingError, "memory-mapping")
    reason = _refusal(opened)
    if reason is not None:
        raise MappingError(
            f"{opened.directory}: cannot memory-map this checkpoint: {reason}. Load it with copying (moe_core.load "
            "without memory_map; in a fine-tuning config, model.mmap=false), or ask for its stored dtype"
        )
    model, dtype = opened.model, opened.dtype
    if opened.arch is not None:  # one tensor per expert in the files: kept as they are
        with torch.device("meta"):
            replace_experts(model, lambda dense: MappedExperts.shaped_like(dense, dtype))
    state = model.state_dict(keep_vars=True)  # meta placeholders: names, shapes and dtypes
    with torch.no_grad():
        for ours, e, name, source in stream_weights(opened.reader, opened.plan):
            module_name, _, leaf = ours.rpartition(".")
            module = model.get_submodule(module_name)
            if isinstance(module, MappedExperts) and leaf.endswith("_bias"):  # gpt-oss: small, copied
                E, O = getattr(module, leaf).shape
                check_shape(opened.directory, name, source, ours, (O,) if e is not None else (E, O))
                module.set_bias(leaf.removesuffix("_bias"), e, source)
                continue
            if isinstance(module, MappedExperts):
                check_shape(opened.directory, name, source, ours, module.shapes[leaf])
                module.set_expert(leaf, e, source if source.dtype == dtype else source.to(dtype))
                continue
            target = state[ours]
            check_shape(opened.directory, name, source, ours, target.shape)
            if leaf in dict(module.named_buffers(recurse=False)):  # small, some change in training: copied
                setattr(module, leaf, source.to(target.dtype, copy=True))
            elif ".mlp.router." in ours or source.dtype != target.dtype:  # may train, or a cast: copied
                setattr(module, leaf, nn.Parameter(source.to(target.dtype, copy=True)))
            else:
                setattr(module, leaf, nn.Parameter(source, requires_grad=False))
    model.tie_weights()
    _materialize_buffers(model)
    # the safetensors handles (and their mappings) live as long as the model
    model.mapped_from = opened.reader
    return opened.finish()


def _materialize_buffers(model: nn.Module) -> None:
    """What no checkpoint holds (non-persistent buffers: rotary frequencies, load counters), still on the meta
    device after the assignment: allocated and computed by the modules' ``reset_buffers`` (as
    `moe_core.model.materialize` does for a whole model)."""
    for module in model.modules():
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer.is_meta:
                setattr(module, name, torch.empty_like(buffer, device="cpu"))
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise MappingError(f"internal: {left[:3]} were not loaded; moe_core/mapped.py needs updating")


def is_file_backed(tensor: torch.Tensor, file: str | os.PathLike) -> bool:
    """Whether ``tensor``'s memory lies in this process's mapping of ``file`` (Linux ``/proc/self/maps``)."""
    target = os.path.realpath(file)
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    return any(
        low <= start and end <= high and os.path.realpath(path) == target
        for low, high, path in _file_mappings()
    )


def _file_mappings() -> list[tuple[int, int, str]]:
    """``[(start, end, path)]`` of this process's mappings of files, by start address (``/proc/self/maps``: the
    lines with an inode and a path; not the heap, stacks or anonymous memory)."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[4] != "0" and fields[5].startswith("/"):
                start, end = (int(a, 16) for a in fields[0].split("-"))
                ranges.append((start, end, fields[5].strip()))
    return sorted(ranges)


# what merging an adapter adds to each memory-mapped experts module, per projection: a function giving the
# ``[E, O, I]`` deltas PEFT's merge adds in turn (`moe_core.finetune.expert_lora.merge_deltas`), called when the
# projection is written (`stacked_tensors`)
ExpertDeltas = Mapping["MappedExperts", Mapping[str, Callable[[], list[torch.Tensor]]]]


def merged_slice(w_OI: torch.Tensor, deltas_EOI: Iterable[torch.Tensor], e: int) -> torch.Tensor:
    """Expert ``e``'s weight ``w_OI`` with its slice of each of a projection's deltas added, in the weight's dtype, in
    turn: what PEFT's merge (``param.data += delta``) leaves in row ``e`` of the stack, made for one slice."""
    for delta_EOI in deltas_EOI:
        w_OI = w_OI + delta_EOI[e].to(w_OI.dtype)
    return w_OI


class MergedSlices:
    """Expert slices of one experts module as an adapter's merge leaves them (`merged_slice`): ``(p, e)`` -> expert
    ``e``'s weight of projection ``p``, for a reader that needs every projection of an expert at once (GPTQ and
    AWQ quantize an expert from its gate, up and down weights). ``deltas``: the module's `ExpertDeltas` entry;
    each projection's are made at its first read, in the weights' dtype, and kept for the module (drop this
    object with it); none: the module's own slices (a stack's rows, or a memory-mapped module's tensors)."""

    def __init__(
        self, experts: StackedExperts, deltas: Mapping[str, Callable[[], list[torch.Tensor]]] | None = None
    ) -> None:
        self.unbound = dict(zip(PROJECTIONS, experts.unbound(), strict=True))
        self.deltas = deltas or {}
        self.made: dict[str, list[torch.Tensor]] = {}

    def __call__(self, p: str, e: int) -> torch.Tensor | None:
        slices = self.unbound[p]
        if slices is None:
            return None
        if p in self.deltas and p not in self.made:
            self.made[p] = [delta_EOI.to(slices[0].dtype) for delta_EOI in self.deltas[p]()]
        return merged_slice(slices[e], self.made.get(p, ()), e)


def stacked_tensors(model: MoEForCausalLM, deltas: ExpertDeltas | None = None) -> dict[str, Any]:
    """``model``'s weights by the names ``save_pretrained`` gives them (the stacked layout), with nothing stacked:
    each `MappedExperts` projection ``p`` as the list of its E per-expert tensors (views of the file). Where
    ``deltas`` has the module's ``p``, each is a `Deferred` instead: the expert's weight plus its slices of the
    deltas, in the weight's dtype (as PEFT's merge adds them into a stack), made as it is written. A projection's
    deltas are made once for its E experts, one projection's at a time, and the pages of the experts of the
    projection written before are released then (`release_pages`). What `save_streaming` and
    `moe_core.convert.to_hf` write a memory-mapped model from, an adapter merged as it goes."""
    tensors: dict[str, Any] = {}
    last: dict[tuple[MappedExperts, str], list[torch.Tensor]] = {}  # the deltas made (writers go in order)

    def expert(module: MappedExperts, p: str, e: int) -> torch.Tensor:
        w_OI = module.weights(p)[e]
        if (module, p) not in last:
            for read, q in last:  # read (the file's views, never written): their pages leave the resident set
                release_pages(read.weights(q))
            last.clear()
            last[module, p] = [delta_EOI.to(w_OI.dtype) for delta_EOI in deltas[module][p]()]
        return merged_slice(w_OI, last[module, p], e)

    for name, tensor in model.state_dict(keep_vars=True).items():
        prefix, _, leaf = name.rpartition(".")
        module = model.get_submodule(prefix) if prefix else model
        owned = module.expert_weight(leaf) if isinstance(module, MappedExperts) else None
        if owned is None:
            tensors[name] = tensor
            continue
        p, e = owned
        w_OI = module.weights(p)[e]
        if deltas is not None and p in deltas.get(module, {}):
            w_OI = Deferred(tuple(w_OI.shape), w_OI.dtype, functools.partial(expert, module, p, e))
        tensors.setdefault(f"{prefix}.{p}", []).append(w_OI)
    return tensors


def save_streaming(
    model: MoEForCausalLM,
    out_dir: str | os.PathLike,
    max_shard_bytes: int,
    deltas: ExpertDeltas | None = None,
) -> None:
    """``model.save_pretrained(out_dir, max_shard_size=max_shard_bytes)``'s files (config, generation config,
    safetensors shards and their index, the stacked layout) for a model whose experts are still `MappedExperts`,
    without stacking them all first: a projection's ``[E, O, I]`` stack is made while its shard is written and let
    go of after, so the copy in ordinary memory is one shard, not the model (`densify_experts` then
    ``save_pretrained`` held a copy of every expert: 13.1 GiB of anonymous memory for the full OLMoE-1B-7B).
    ``deltas``: an adapter merged into the experts as they are written (`stacked_tensors`). A tensor that shares
    another's memory (tied embeddings) is written once, under its first name."""
    from safetensors.torch import save_file  # lazy: only exports write

    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    # (name, shape, bytes, and the tensor or the per-expert entries to stack)
    plan: list[tuple[str, tuple, int, object]] = []
    seen: set[tuple[int, tuple]] = set()
    for name, tensor in stacked_tensors(model, deltas).items():
        if isinstance(tensor, list):  # the projection's stack, in place of its E per-expert tensors
            shape = (len(tensor), *tensor[0].shape)
            plan.append((name, shape, math.prod(shape) * tensor[0].element_size(), tensor))
            continue
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if tensor.numel() and key in seen:
            continue
        seen.add(key)
        plan.append((name, tuple(tensor.shape), tensor.element_size() * tensor.numel(), tensor))
    shards: list[list[tuple]] = [[]]
    size = 0
    for entry in plan:
        if shards[-1] and size + entry[2] > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry[2]
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map = {}
    for file_name, shard in zip(names, shards, strict=True):
        tensors = {}
        for name, _, _, source in shard:
            if isinstance(source, list):
                tensors[name] = torch.stack([made(w).detach() for w in source])
            else:
                tensors[name] = source.detach().contiguous()
            weight_map[name] = file_name
        save_file(tensors, os.path.join(out_dir, file_name), metadata={"format": "pt"})
        del tensors
    if len(shards) > 1:
        index = {
            "metadata": {
                "total_parameters": sum(math.prod(entry[1]) for entry in plan),
                "total_size": sum(entry[2] for entry in plan),
            },
            "weight_map": dict(sorted(weight_map.items())),
        }
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
            f.write("\n")
    model.config.architectures = [type(model).__name__]  # as save_pretrained records it
    model.config.save_pretrained(out_dir)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out_dir)


# ------------------------------------------------------------------------------------------------ releasing pages
MADV_DONTNEED = 4  # Linux's value (asm-generic/mman-common.h)


@functools.cache
def _madvise():
    """libc's ``madvise`` on Linux, else None."""
    if not os.uname().sysname == "Linux":
        return None
    try:
        madvise = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


def release_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Take the whole pages under each of ``tensors`` out of this process's resident set; returns the bytes
    released. For views of a checkpoint's file mapping read for the last time and never written: the pages stay
    in the page cache (the kernel reclaims them as any other), and a later read faults them in again from it.
    ``madvise(MADV_DONTNEED)`` on the pages a tensor alone covers (not one it shares with a neighbour in the file),
    and only inside a mapping of a file: on anonymous memory (a copy in another dtype) it would zero the memory,
    and a page of the mapping that was written (copy-on-write) would lose the write, so a tensor that may have
    been written must not be given. Linux only; elsewhere nothing is released."""
    madvise = _madvise()
    if madvise is None:
        return 0
    mappings = _file_mappings()
    starts = [start for start, _, _ in mappings]
    page, released = mmap.PAGESIZE, 0
    for t in tensors:
        if t.device.type != "cpu" or not t.is_contiguous():
            continue
        begin = t.data_ptr()
        end = begin + t.numel() * t.element_size()
        i = bisect.bisect_right(starts, begin) - 1
        if i < 0 or end > mappings[i][1]:  # not (wholly) in a file mapping
            continue
        lo, hi = -(-begin // page) * page, end // page * page
        if hi > lo and madvise(lo, hi - lo, MADV_DONTNEED) == 0:
            released += hi - lo
    return released
