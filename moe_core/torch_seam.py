"""What the lab reaches inside torch for, in one place (torch 2.13.0): dynamo and inductor for
`moe_core.inference.compile`, and DDP's parameter-ignore list for the expert-parallel trainers.

Upstream files this reads (torch 2.13.0): ``torch/nn/parallel/distributed.py``
(``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``: DDP has no public argument for
parameters it must neither broadcast nor all-reduce; expert-parallel shards are rank-local), ``torch/_dynamo/convert_frame.py`` (``register_bytecode_hook``: the
bytecode dynamo produces for a frame), ``torch/_dynamo/config.py`` (``automatic_dynamic_shapes``), the
``__compiled_fn_*`` / ``__resume_at_*`` globals dynamo installs beside a compiled function's bytecode, and
``torch/_inductor/output_code.py`` (``CompiledFxGraph.current_callable`` and ``mutated_input_idxs``: the
compiled graph under AOT autograd's runtime wrapper), and ``torch/compiler/__init__.py``
(``_is_exporting_flag``). ``tests/test_torch_seam.py`` fails when any of them moves. Everything else in the
lab uses torch's public API.

Four uses:
- `ddp_ignore` keeps DDP off the rank-local expert shards (`moe_core.train.parallel.wrap_data_parallel`, the
  fine-tune's `moe_core.finetune.parallel.leave_experts_to_us`): their gradients are reduced by the lab itself.
- `bytecode_of` and `global_reads` let `compile_steps` read what dynamo compiled, to refuse a step that would
  replay a Python side effect (every compiled step, the default path included).
- `compile_direct` and `GraphCall` are the opt-in direct dispatch of the static-cache decode
  (``compile_steps(direct_dispatch=True)``, off by default): each decode signature's compiled code run
  without dynamo's per-call guard checks, then inductor's graph on a prebuilt input list. On a 2-core CPU
  they took an olmoe-small batch-1 decode step from 73% to 94% of the memory bound
  (``benchmarks/decode_dispatch.py``, benchmarks/README.md); a torch upgrade can break them, which is why they
  are not the default.
- `is_exporting` tells torch.export from torch.compile inside a traced forward (`moe_core.experts.
  impl_under_capture`): ``torch.compiler.is_exporting()`` does not in torch 2.11.
"""

from __future__ import annotations

import contextlib
import dis
import types

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from transformers.cache_utils import StaticCache

# opcodes that write Python state: in a step dynamo compiled, a side effect it would replay
SIDE_EFFECT_OPS = frozenset(
    {"STORE_ATTR", "STORE_SUBSCR", "STORE_GLOBAL", "STORE_DEREF"}
    | {"DELETE_ATTR", "DELETE_SUBSCR", "DELETE_GLOBAL", "DELETE_DEREF"}
)


@contextlib.contextmanager
def bytecode_of(fn):
    """Collect, into the list it yields, each bytecode dynamo produces for ``fn``'s code inside the block."""
    produced = []

    def hook(code, transformed):
        if code is fn.__code__:
            produced.append(transformed)

    handle = torch._dynamo.convert_frame.register_bytecode_hook(hook)
    try:
        yield produced
    finally:
        handle.remove()


def global_reads(code) -> tuple[set[str], set[str]]:
    """The global names ``code`` (and any code nested in it) loads, and its opcodes."""
    names, ops, stack = set(), set(), [code]
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        ops.update(i.opname for i in dis.get_instructions(c))
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return names, ops


def compile_direct(fn, compile, args, inspect):
    """Compile ``fn`` (``compile(fn)``, never called before) on its first call, ``args``, and return that
    call's output with a function that runs the bytecode dynamo produced for ``fn``, the graph call included,
    directly: without dynamo's frame evaluation and guard checks on every later call (as vLLM dispatches its
    compiled models). It reads the globals it loads (dynamo's compiled graph among them) from a copy of its
    own, so it outlives dynamo's caches (``torch._dynamo.reset``) and keeps no other step's graph alive.
    The caller must give it only inputs that the guards would have accepted. Unless dynamo compiled exactly
    one graph for ``fn``, the guarded ``compile(fn)`` comes back in its place (the third value says which);
    ``inspect`` is called with each bytecode dynamo produced (`compile_steps` refuses a step that replays a
    Python side effect there)."""
    compiled = compile(fn)
    with bytecode_of(fn) as produced:
        # static shapes, whatever dynamo remembers of earlier compiles of this function's source (its
        # automatic dynamic shapes are kept per file and line, so another signature's batch size, or
        # another model's, would make this graph symbolic in the batch)
        with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
            out = compiled(*args)
    for code in produced:
        inspect(code)
    if len(produced) != 1:
        return out, compiled, False
    code = produced[0]
    names, _ = global_reads(code)
    g = fn.__globals__
    scope = {"__builtins__": g["__builtins__"], **{n: g[n] for n in names if n in g}}
    return out, types.FunctionType(code, scope, fn.__name__, fn.__defaults__, fn.__closure__), True


class GraphCall:
    """A direct step's compiled graph, called with its input list prebuilt.

    The bytecode dynamo produced for a decode step does three things on every call: it fetches the graph's
    inputs (the step's arguments, the cache's key and value tensors, and every parameter and buffer, through
    the modules' attributes), calls the graph through AOT autograd's runtime wrapper, and returns the
    graph's output. `record` runs that bytecode once, sees which input is which, and, where the step allows
    it, keeps the list: later calls put the new arguments into a copy and call inductor's compiled graph
    (``CompiledFxGraph.current_callable``) on it directly. 0.1-0.2 ms of a 2-3 ms olmoe-small step
    (benchmarks/README.md).

    The list holds the parameters themselves, so `holds` tells whether the model still has them (one
    replaced since, even with the same shape, drops the call at the next prefill and the bytecode fetches
    afresh); the cache tensors are rebound whenever the steps' cache is another object. Skipped with the
    runtime wrapper: bumping the cache tensors' version counters (only autograd reads them; the steps never
    record gradients) and turning autocast off around the graph (inductor's kernels do not read it). Taken
    only where every graph input is an argument, a cache tensor or one of the model's parameters and
    buffers (and the bytecode stores nothing: `compile_direct`); inductor's graph is called without the
    runtime wrapper only where it writes nothing but the cache and returns what the wrapper does (so the
    cache writes happen inside it), else through the wrapper."""

    def __init__(self, call, boxed, inputs, arg_slots, cache_slots, out_index, cache) -> None:
        self.call, self.boxed, self.out_index = call, boxed, out_index
        self.template = list(inputs)
        self.arg_slots = arg_slots  # (input index, argument index)
        self.cache_slots = cache_slots  # (input index, layer, "keys" or "values")
        self.cache_specs = [signature(inputs[j]) for j, _, _ in cache_slots]
        per_call = {j for j, *_ in arg_slots + cache_slots}
        self.constants = [x for j, x in enumerate(inputs) if j not in per_call]  # the model's tensors
        self.cache = cache

    @classmethod
    def record(cls, step, args, cache: StaticCache, model: nn.Module):
        """Run ``step(*args)`` (a `compile_direct` step) once, recording its graph call; returns the
        output and a `_GraphCall` for the later calls, or None where the bytecode must stay."""
        scope = step.__globals__
        names = [n for n in scope if n.startswith("__compiled_fn")]
        if len(names) != 1 or any(n.startswith("__resume_at") for n in scope):  # one graph, no break
            return step(*args), None
        graph, seen = scope[names[0]], []

        def recording(*inputs):
            seen.append((inputs, graph(*inputs)))
            return seen[0][1]

        scope[names[0]] = recording
        # transformers 5's StaticCache layers count their length in a tensor each update advances in place
        # (``StaticLayer.cumulative_length``): a cache slot like the keys and values, put back before the check
        lengths = [layer.cumulative_length for layer in cache.layers]
        before = [length.clone() for length in lengths]
        try:
            out = step(*args)
        finally:
            scope[names[0]] = graph
        inputs, outputs = seen[0]
        argument = {id(a): i for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
        in_cache = {}
        for layer, kv in enumerate(cache.layers):
            in_cache.update({id(kv.keys): (layer, "keys"), id(kv.values): (layer, "values")})
            in_cache[id(kv.cumulative_length)] = (layer, "cumulative_length")
        owned = {id(t) for t in (*model.parameters(), *model.buffers())}
        arg_slots, cache_slots = [], []
        for j, x in enumerate(inputs):
            if not isinstance(x, torch.Tensor):
                return out, None
            if id(x) in argument:
                arg_slots.append((j, argument[id(x)]))
            elif id(x) in in_cache:
                cache_slots.append((j, *in_cache[id(x)]))
            elif id(x) not in owned:
                return out, None
        out_index = next((k for k, o in enumerate(outputs) if o is out), None)
        if out_index is None:
            return out, None
        inner = graph
        while hasattr(inner, "__wrapped__"):
            inner = inner.__wrapped__
        call, boxed = getattr(inner, "current_callable", None), True
        # checked by running it once more, which only rewrites the cache slots just written (the same
        # keys and values): not where the graph writes anything else
        rewrites = set(getattr(inner, "mutated_input_idxs", {-1}))
        if (
            call is None
            or not rewrites <= {j for j, *_ in cache_slots}
            or not cls._same(cls._replay(call, inputs, lengths, before), outputs)
        ):
            call, boxed = graph, False  # not inductor's (or not all its work inside): keep the wrapper
        return out, cls(call, boxed, inputs, arg_slots, cache_slots, out_index, cache)

    @staticmethod
    def _replay(call, inputs, lengths, before):
        """The graph's outputs once more, from the cache lengths the step started at (it writes the same slots
        again and leaves the lengths where the step left them)."""
        after = [length.clone() for length in lengths]
        for length, value in zip(lengths, before):
            length.copy_(value)
        try:
            return call(list(inputs))
        finally:
            for length, value in zip(lengths, after):
                length.copy_(value)

    @staticmethod
    def _same(outputs, expected) -> bool:
        return len(outputs) == len(expected) and all(
            isinstance(o, torch.Tensor) and torch.equal(o, e) for o, e in zip(outputs, expected)
        )

    def holds(self, tensor_ids: set[int]) -> bool:
        """Whether every parameter and buffer in the list is still one of the model's (``tensor_ids``)."""
        return all(id(t) in tensor_ids for t in self.constants)

    def forget_cache(self) -> None:
        """Let go of the cache tensors (the steps made another cache); rebound at the next call."""
        self.cache = None
        for j, _, _ in self.cache_slots:
            self.template[j] = None

    def _bind(self, cache: StaticCache) -> None:
        for (j, layer, name), spec in zip(self.cache_slots, self.cache_specs):
            tensor = getattr(cache.layers[layer], name)
            if signature(tensor) != spec:
                raise RuntimeError(
                    f"static cache layer {layer} {name}: {signature(tensor)}, compiled for {spec}"
                )
            self.template[j] = tensor
        self.cache = cache

    def __call__(self, args, cache: StaticCache):
        if cache is not self.cache:
            self._bind(cache)
        inputs = self.template.copy()  # a boxed call empties the list it is given
        for j, i in self.arg_slots:
            inputs[j] = args[i]
        outputs = self.call(inputs) if self.boxed else self.call(*inputs)
        return outputs[self.out_index]


def signature(*tensors) -> tuple:
    """What a static-shape graph is specialized to: each tensor's shape, strides, dtype and device."""
    return tuple(None if t is None else (tuple(t.shape), t.stride(), t.dtype, t.device) for t in tensors)


# ------------------------------------------------------------------------------------------------ DDP
def ddp_ignore(model: nn.Module, names: list[str]) -> None:
    """Make a `DistributedDataParallel` built around ``model`` afterwards skip the parameters and buffers named
    ``names`` (fully qualified): no broadcast at construction, no all-reduce in backward."""
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)


def is_exporting() -> bool:
    """Whether torch.export is tracing: the flag torch.export sets around its trace, read as a module global
    (under dynamo a guarded constant). Not ``torch.compiler.is_exporting()``: dynamo in torch 2.11 folds that
    call to True under every torch.compile (torch 2.13 reads this flag instead), which sent compiled training
    down the experts' static path on an H100's torch 2.11 (`tests/test_gpu.py`, 2026-11-28)."""
    return bool(torch.compiler._is_exporting_flag)
