"""``torch.compile`` of the prefill and decode steps, and ``torch.export`` of the forward, from outside.

    from moe_core.inference import compile_steps, export_program
    steps = compile_steps(model)                 # two fullgraph graphs: prefill and decode
    logits, cache = steps.prefill(input_ids)     # (optional attention mask and position ids, as the model)
    logits, cache = steps.decode(next_ids, cache)
    program = export_program(model, example_ids) # torch.export.ExportedProgram of the cache-free forward

Both steps are captured whole (``fullgraph=True``), each with the expert path that suits it:

- prefill, many tokens: the ``static`` path (every expert on every token as one wide FFN gated by a dense
  [T, E] combine matrix, so no data-dependent shapes). The prompt length is symbolic: one graph serves
  every length.
- decode, one token per sequence: the ``gather`` path. Each token gathers its K experts' weights and each
  projection is the reduction ``sum_d x_d w_fd``; inductor fuses the gather into that loop, so a step streams
  only the chosen experts' bytes, with no host sync. Batch-1 decoding is memory-bound, and on a CPU MKL's
  single-row GEMV streams weights at about half the bandwidth of inductor's vectorized reduction
  (benchmarks/README.md), so `reduction_gemv` also rewrites every ``nn.Linear`` (attention, dense FFN, LM
  head) the same way whenever it sees a single row under compilation: dense baselines compiled with
  `compile_steps` get the same kernel, and comparisons stay fair. The KV-cache length is symbolic from the
  first compile, so the growing cache does not recompile every step.

Only the lengths are symbolic (`_mark_lengths`: the prompt and the dynamic cache, marked on every call); every
other shape and every Python number the model reads is a constant of the graph. ``dynamic=True`` would make
the norms' ``eps`` (and every other float attribute) a graph input, boxed into a tensor and read back with
``.item()`` on every call, and the batch-1 decode a symbolic-shape kernel: 18 boxed floats and 0.3-0.5 ms of a
2.5-3 ms olmoe-small decode step (benchmarks/README.md). A new batch size compiles once more, then the batch
goes symbolic too (automatic dynamic shapes), so batch 1 keeps its static graph.

``cache="static"`` decodes into transformers' ``StaticCache`` instead (``compile_steps(model,
cache="static", max_cache_len=L)``): keys and values preallocated at [B, G, L, Hd] once per batch shape and
written in place at the cache's own length (transformers 5: a tensor each layer advances in place, so the
graph does not guard on it), the
attention mask spans all L slots (those past the current position are masked out), and the compiled decode
returns only the logits: no cache object is unpacked or rebuilt per step. The steps then hold one cache,
reset by each prefill, so one generation at a time per `compile_steps` result; the state a step returns is a
`StaticDecodeState`.

By default every step is plain ``torch.compile`` with dynamo's guards (as gpt-fast does). Opt-in,
``direct_dispatch=True`` compiles a static graph per decode input signature (batch size, padded or not) and
runs it without dynamo's frame evaluation and guard checks on every step (`_StaticCacheSteps` says why that
is safe), then inductor's graph itself on an input list built once (`GraphCall`): 73% -> 94% of the
memory bound on an olmoe-small batch-1 step on a 2-core CPU (benchmarks/README.md). It reads torch
internals, kept in `moe_core.torch_seam` with the upstream files named and a test that fails when
they move.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim, export
from transformers import PretrainedConfig
from transformers.cache_utils import StaticCache

from moe_core.errors import MoELabError
from moe_core.frozen_linear import FrozenLinear, share_hooks
from moe_core.torch_seam import (
    SIDE_EFFECT_OPS,
    GraphCall,
    bytecode_of,
    compile_direct,
    global_reads,
    signature,
)


class CompileError(MoELabError):
    """torch.compile / torch.export could not handle the model; the message says what to try."""


class ReductionLinear(nn.Linear):
    """`nn.Linear` that, under compilation and for a single row, is written as the reduction it is.

    Eager calls (and any call with more than one row) are plain ``F.linear``; outputs equal nn.Linear's
    up to float summation order. Installed in place by `reduction_gemv` (the state dict is unchanged)."""

    @classmethod
    def sharing(cls, linear: nn.Linear) -> ReductionLinear:
        """A `ReductionLinear` holding ``linear``'s very parameters (no copy; tied weights stay tied) and
        hooks."""
        with torch.device("meta"):  # the constructor's own weights are replaced at once: allocate nothing
            new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None)
        new.weight, new.bias = linear.weight, linear.bias
        return share_hooks(linear, new)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() and x.shape[:-1].numel() == 1:
            y = (x[..., None, :] * self.weight).sum(-1)
            return y + self.bias if self.bias is not None else y
        return F.linear(x, self.weight, self.bias)


def reduction_gemv(model: nn.Module) -> nn.Module:
    """Swap every plain ``nn.Linear`` of ``model`` for a `ReductionLinear` sharing its parameters (same state
    dict); in place, and only in ``model``: other models and the ``nn.Linear`` class are untouched."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) in (nn.Linear, FrozenLinear):  # FrozenLinear: a fine-tuned model's, in memory
                setattr(parent, name, ReductionLinear.sharing(child))
    return model


def _own_code(fn):
    """``fn`` with a code object of its own: dynamo keeps graphs and its recompile budget per code object,
    so every step of every `compile_steps` call gets its own."""
    return types.FunctionType(
        fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )


def _step_fn(model: nn.Module, expert_impl: str | None):
    """The model call a step runs (`_own_code`)."""

    def step(input_ids_BS, cache=None, attention_mask_BL=None, position_ids_BS=None):
        out = model(
            input_ids=input_ids_BS,
            cache=cache,
            attention_mask=attention_mask_BL,
            position_ids=position_ids_BS,
            use_cache=True,
            logits_to_keep=1,
            expert_impl=expert_impl,
        )
        return out.logits[:, -1], out.cache

    return _own_code(step)


def _mark_lengths(*tensors_and_dims) -> None:
    """Mark each ``(tensor, dim)`` length as symbolic for dynamo (None tensors are skipped). Called on every
    call of a step, so the marks (which dynamo guards on) are the same each time: one graph serves every
    length from the first compile, while everything unmarked stays a constant (module doc)."""
    for tensor, dim in tensors_and_dims:
        if tensor is not None:
            torch._dynamo.maybe_mark_dynamic(tensor, dim)


def _contiguous_cache(cache):
    # prefill leaves transposed (strided) keys and values in the cache, decode steps contiguous ones: one
    # layout for every decode call, or dynamo recompiles on the stride change; the length is symbolic
    for layer in getattr(cache, "layers", ()):
        if getattr(layer, "keys", None) is not None:
            layer.keys, layer.values = layer.keys.contiguous(), layer.values.contiguous()
            _mark_lengths((layer.keys, 2), (layer.values, 2))
    return cache


@dataclass
class CompiledSteps:
    prefill: object
    decode: object


@dataclass
class StaticDecodeState:
    """What a static-cache step passes to the next: the preallocated cache, the tokens written so far, and
    the full-length [B, L] attention mask (None when nothing is padded)."""

    cache: StaticCache
    length: int
    attention_mask_BL: torch.Tensor | None = None


def _static_step_fn(model: nn.Module, expert_impl: str | None):
    """A step on a `StaticCache` that returns only the last logits (the cache is updated in place;
    `_own_code`)."""

    def step(input_ids_BS, cache, attention_mask_BL=None, position_ids_BS=None):
        # where the tokens land: transformers 5's StaticCache layers count what they hold (a tensor,
        # ``cumulative_length``, advanced in place by each update), and the model reads it
        out = model(
            input_ids=input_ids_BS,
            cache=cache,
            attention_mask=attention_mask_BL,
            position_ids=position_ids_BS,
            use_cache=True,
            logits_to_keep=1,
            expert_impl=expert_impl,
        )
        return out.logits[:, -1]

    return _own_code(step)


class ModelStructure:
    """The shapes, dtypes and devices of a model's parameters and buffers, its module classes and its config,
    when `compile_steps` compiled it.

    The compiled steps neither guard on the model (dynamo's guards on every module attribute would cost a
    tenth of a decode step) nor assert their input sizes (inductor's ``size_asserts``, another 4% of it); each
    prefill checks instead, once per generation, that nothing was replaced since (a pruned expert stack, a
    cast to bfloat16): a kernel compiled for the old layout would read the new tensor out of bounds."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.spec = model, self._spec(model)

    @staticmethod
    def _spec(model: nn.Module) -> dict:
        tensors = [*model.named_parameters(), *model.named_buffers()]
        spec = {
            name: f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} on {t.device}"
            for name, t in tensors
        }
        # a swapped module class (another expert path) or an edited config changes the code the graphs
        # were traced from; neither is guarded per call either
        spec.update(
            {f"{name or 'model'} (module)": type(m).__qualname__ for name, m in model.named_modules()}
        )
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "to_dict"):
            spec.update({f"config.{key}": repr(value) for key, value in config.to_dict().items()})
        return spec

    def matches(self) -> bool:
        """Whether the model still has the compiled layout."""
        return self._spec(self.model) == self.spec

    def check(self) -> None:
        now = self._spec(self.model)
        if now != self.spec:
            name = next(n for n in {**self.spec, **now} if self.spec.get(n) != now.get(n))
            raise CompileError(
                f"{name}: {self.spec.get(name, 'absent')} when compile_steps compiled the model, "
                f"{now.get(name, 'absent')} now; the compiled steps read the old layout: call "
                "compile_steps again after changing the model"
            )


# what the bytecode dynamo produced for a step may not do (`_refuse_replays`)
def _refuse_replays(code) -> None:
    """`CompileError` if the bytecode dynamo produced for a step replays a Python side effect of the model.

    Dynamo replays one as it saw it while tracing (a hook's list append becomes "the list is now [a, b]")
    and guards on the state it leaves, but the steps keep no guards on the modules (`compile_steps`), their
    hooks included, and direct dispatch none at all: every later step would replay the first one's. (With
    a graph break, fullgraph=False, the bytecode stores for its own bookkeeping: not checked.)"""
    names, ops = global_reads(code)
    if ops & SIDE_EFFECT_OPS and not any(n.startswith("__resume_at") for n in names):
        raise CompileError(
            "the model's forward has a Python side effect (a hook appending to a list, an attribute "
            f"write: {sorted(ops & SIDE_EFFECT_OPS)} in the step dynamo compiled), which a compiled "
            "step replays as it was traced; remove it, or decode eagerly (eager_steps, generate "
            "without compile)"
        )


def _checked(compile, fn):
    """``compile(fn)`` (guarded), whose first call also refuses a step that replays a Python side effect
    (`_refuse_replays`)."""
    compiled, call = compile(fn), None

    def run(*args):
        nonlocal call
        if call is not None:
            return call(*args)
        with bytecode_of(fn) as produced:
            out = compiled(*args)
        for code in produced:
            _refuse_replays(code)
        call = compiled
        return out

    return run


def full_attention_layout(config) -> PretrainedConfig:
    """What `StaticCache` reads from a config (``layer_types``), every layer full attention: a preallocated
    ``StaticLayer`` of ``max_cache_len`` slots even for a sliding-window layer, whose window the model's mask
    keeps (`moe_core.model.window_mask_for`).

    Deliberately not transformers' ``StaticSlidingWindowLayer`` (what ``StaticCache(config=config)`` gives a
    gpt-oss window layer, and what ``generate(cache_implementation="static")`` uses): it counts its length in a
    Python int and branches on it (full or not, one token or several) and returns a key offset that moves every
    step, which a compiled step would bake in (direct dispatch keeps no guards, `_StaticCacheSteps`) or
    recompile on; and `GraphCall` replays a step by resetting the tensor lengths only. The memory is bounded by
    ``max_cache_len`` either way."""
    n = config.num_hidden_layers
    return PretrainedConfig(num_hidden_layers=n, layer_types=["full_attention"] * n)


class _StaticCacheSteps:
    """Prefill and decode on one reusable `StaticCache` of ``max_cache_len`` slots.

    With ``direct`` dispatch, each decode input signature (batch size, mask or none, dtypes, ...) gets a step
    of its own, compiled on its first call with static shapes; its second call runs the compiled code
    without dynamo's per-call guard checks (`compile_direct`: 0.15 ms of a 2 ms olmoe-small decode step,
    benchmarks/README.md) and records which graph input is which, and every later call runs the compiled
    graph on its prebuilt input list (`GraphCall`: another 0.1-0.2 ms). What those guards checked holds
    by construction: the signature picks the graph,
    the cache and its positions are this object's own, the model is checked at each prefill (`ModelStructure`),
    and the steps always run without gradients. A new batch size compiles once more."""

    def __init__(
        self,
        model: nn.Module,
        prefill,
        make_decode,
        compile,
        max_cache_len: int,
        direct: bool,
        graph_call: bool = True,
    ) -> None:
        self.model, self.prefill_fn, self.make_decode, self.compile = model, prefill, make_decode, compile
        self.graph_call = graph_call
        self.max_cache_len = max_cache_len
        self.decoders: dict[tuple, object] = {}  # input signature -> compiled step (direct dispatch)
        self.graph_calls: dict[tuple, GraphCall | None] = {}  # ... -> its graph call (None: none fits)
        # without: one guarded step for every signature (dynamo recompiles when its guards fail)
        self.guarded = None if direct else _checked(compile, make_decode())
        self.structure = ModelStructure(model)
        self.cache: StaticCache | None = None

    def _cache_for(self, batch: int, like: torch.Tensor) -> StaticCache:
        config = self.model.config
        if self.cache is None or self.cache.layers[0].batch_size != batch:
            for call in self.graph_calls.values():
                if call is not None:
                    call.forget_cache()  # (the old cache is freed)
            self.cache = StaticCache(config=full_attention_layout(config), max_cache_len=self.max_cache_len)
            dtype = next(self.model.parameters()).dtype
            self.cache.early_initialization(
                batch, config.num_key_value_heads, config.head_dim, dtype, like.device
            )
        else:
            self.cache.reset()
        return self.cache

    def prefill(self, input_ids_BS, attention_mask_BS=None, position_ids_BS=None):
        B, S = input_ids_BS.shape
        if S >= self.max_cache_len:
            raise CompileError(
                f"prompt of {S} tokens does not fit a static cache of max_cache_len="
                f"{self.max_cache_len} (room for the decoded tokens too); raise max_cache_len"
            )
        self.structure.check()
        owned = {id(t) for t in (*self.model.parameters(), *self.model.buffers())}
        self.graph_calls = {
            key: call for key, call in self.graph_calls.items() if call is None or call.holds(owned)
        }  # one whose parameters were replaced since is recorded again at its next call
        cache = self._cache_for(B, input_ids_BS)
        mask_BL = None
        if attention_mask_BS is not None and not bool(attention_mask_BS.all()):
            mask_BL = torch.ones(B, self.max_cache_len, dtype=attention_mask_BS.dtype)
            mask_BL[:, :S] = attention_mask_BS
        _mark_lengths((input_ids_BS, 1), (position_ids_BS, 1))
        with torch.no_grad():
            logits = self.prefill_fn(input_ids_BS, cache, mask_BL, position_ids_BS)
        return logits, StaticDecodeState(cache, S, mask_BL)

    def decode(self, input_ids_BS, state: StaticDecodeState, attention_mask_BL=None, position_ids_BS=None):
        """``attention_mask_BL`` is ignored: the state holds the full-length mask (new tokens are never pads)."""
        # (everything here runs with the CPU's caches cold from the last step's weights: a few torch calls
        # cost 0.1 ms of an olmoe-small step, so the steady path makes as few as it can)
        length = state.length
        if length >= self.max_cache_len:
            raise CompileError(f"the static cache is full ({self.max_cache_len} tokens); raise max_cache_len")
        args = (input_ids_BS, state.cache, state.attention_mask_BL, position_ids_BS)
        key = signature(input_ids_BS, state.attention_mask_BL, position_ids_BS)
        call = self.graph_calls.get(key)
        if call is not None and not torch.is_grad_enabled():
            logits = call(args, state.cache)
        else:
            with torch.no_grad():
                logits = call(args, state.cache) if call is not None else self._first_calls(key, args)
        state.length = length + 1
        return logits, state

    def _first_calls(self, key, args):
        """A signature's first call compiles its step, the second records its graph call (`GraphCall`);
        or, without direct dispatch, every call runs the guarded step."""
        step = self.decoders.get(key, self.guarded)
        if step is None:
            logits, self.decoders[key], direct = compile_direct(
                self.make_decode(), self.compile, args, _refuse_replays
            )
            if not direct:
                self.graph_calls[key] = None
            return logits
        if key not in self.graph_calls and self.guarded is None:
            if not self.graph_call:
                self.graph_calls[key] = None
                return step(*args)
            logits, self.graph_calls[key] = GraphCall.record(step, args, args[1], self.model)
            return logits
        return step(*args)


def compile_steps(
    model: nn.Module,
    *,
    fullgraph: bool = True,
    mode: str | None = None,
    prefill_impl: str = "static",
    decode_impl: str = "gather",
    gemv: str = "reduction",
    backend: str = "inductor",
    compile_prefill: bool = True,
    cache: str = "dynamic",
    max_cache_len: int | None = None,
    cpp_wrapper: bool = True,
    direct_dispatch: bool = False,
    graph_call: bool = True,
) -> CompiledSteps:
    """Compiled ``prefill(input_ids) -> (logits, cache)`` and ``decode(next_ids, cache) -> (logits, cache)``.

    ``gemv="reduction"`` installs `reduction_gemv` on the model (in place); ``"mm"`` leaves its linears be.
    Both steps have symbolic lengths (prompt, cache): one graph each, whatever the lengths, per batch shape
    (batch 1 keeps a static graph; a second batch size compiles once more, symbolic in the batch). With
    inductor, ``cpp_wrapper`` (default) launches the kernels from C++ rather than a Python function: 4
    points of the memory bound on olmoe-small's decode, at the same compile time (benchmarks/README.md).
    The static prefill does E/K times the expert FLOPs, which on a CPU costs more than the eager
    ``sorted`` path once a prompt has a few dozen tokens (benchmarks/README.md): ``compile_prefill=False``
    runs prefill eagerly (without gradients) and compiles decode only. ``cache="static"`` decodes into a
    preallocated ``StaticCache`` of ``max_cache_len`` slots (prompt plus new tokens; see the module doc); by
    default its decode is guarded torch.compile with static shapes (a graph per batch size).
    Opt-in, ``direct_dispatch=True`` runs each compiled decode step without dynamo's per-call guard checks,
    then, with ``graph_call`` (default), as the compiled graph on a prebuilt input list (`_StaticCacheSteps`,
    `GraphCall`; False: dynamo's bytecode): torch internals (`moe_core.torch_seam`). A model whose step would replay a Python
    side effect (a hook appending to a list) is refused with `CompileError` at its first call
    (`_refuse_replays`): no step guards on the modules' hooks."""
    if gemv not in ("reduction", "mm"):
        raise ValueError(f"compile_steps: gemv={gemv!r}; choose 'reduction' or 'mm'")
    if cache not in ("dynamic", "static"):
        raise ValueError(f"compile_steps: cache={cache!r}; choose 'dynamic' or 'static'")
    if cache == "static" and (max_cache_len is None or max_cache_len < 2):
        raise ValueError("compile_steps(cache='static') needs max_cache_len >= 2 (prompt plus new tokens)")
    model.eval()
    if gemv == "reduction":
        reduction_gemv(model)
    # the steps hold one model, whose structure must not change after compile_steps (parameters may be
    # updated in place: they are graph inputs): no guards on the modules, no size asserts on the inputs,
    # each prefill checks the model instead (`ModelStructure`)
    options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    if backend == "inductor":
        options.update(size_asserts=False, cpp_wrapper=cpp_wrapper)

    def compiled(fn, dynamic=None):  # None: only the lengths `_mark_lengths` marks are symbolic (module doc)
        return torch.compile(
            fn, fullgraph=fullgraph, dynamic=dynamic, mode=mode, backend=backend, options=options
        )

    def compiled_static(fn):
        # the static-cache decode has no length to mark: every shape a constant, whatever dynamo remembers of
        # other compiles of the same source line (its automatic dynamic shapes would make a later batch-1
        # graph symbolic in the batch once another batch size compiled anywhere in the process)
        return compiled(fn, dynamic=False)

    if cache == "static":
        static_prefill = _static_step_fn(model, prefill_impl if compile_prefill else None)
        if compile_prefill:
            static_prefill = _checked(compiled, static_prefill)
        steps = _StaticCacheSteps(
            model,
            static_prefill,
            lambda: _static_step_fn(model, decode_impl),  # a code object of its own per signature
            compiled_static,
            max_cache_len,
            direct_dispatch,
            graph_call,
        )
        return CompiledSteps(steps.prefill, steps.decode)
    prefill = (
        _checked(compiled, _step_fn(model, prefill_impl)) if compile_prefill else eager_steps(model).prefill
    )
    decode = _checked(compiled, _step_fn(model, decode_impl))
    structure = ModelStructure(model)

    def run_prefill(input_ids_BS, attention_mask_BS=None, position_ids_BS=None):
        structure.check()
        if not compile_prefill:
            return prefill(input_ids_BS, attention_mask_BS, position_ids_BS)
        _mark_lengths((input_ids_BS, 1), (attention_mask_BS, 1), (position_ids_BS, 1))
        with torch.no_grad():
            return prefill(input_ids_BS, None, attention_mask_BS, position_ids_BS)

    def run_decode(input_ids_BS, cache, attention_mask_BL=None, position_ids_BS=None):
        _mark_lengths((attention_mask_BL, 1))
        with torch.no_grad():
            return decode(input_ids_BS, _contiguous_cache(cache), attention_mask_BL, position_ids_BS)

    return CompiledSteps(run_prefill, run_decode)


def eager_steps(model: nn.Module) -> CompiledSteps:
    """`compile_steps`'s interface, run eagerly on the model's own expert paths, without gradients."""
    step = _step_fn(model, None)

    @torch.no_grad()
    def prefill(input_ids_BS, attention_mask_BS=None, position_ids_BS=None):
        return step(input_ids_BS, None, attention_mask_BS, position_ids_BS)

    @torch.no_grad()
    def decode(input_ids_BS, cache, attention_mask_BL=None, position_ids_BS=None):
        return step(input_ids_BS, cache, attention_mask_BL, position_ids_BS)

    return CompiledSteps(prefill, decode)


class _Forward(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids_BS):
        return self.model(input_ids=input_ids_BS, use_cache=False, expert_impl="static").logits


def export_program(model: nn.Module, example_input_ids: torch.Tensor, *, dynamic_seq: bool = True):
    """``torch.export`` of the cache-free forward (logits) on the static expert path."""
    model.eval()
    dynamic_shapes = None
    if dynamic_seq:
        dynamic_shapes = {"input_ids_BS": {1: Dim("seq", min=2, max=4096)}}
    try:
        with torch.no_grad():
            return export(_Forward(model), (example_input_ids,), dynamic_shapes=dynamic_shapes)
    except Exception as err:  # surface the exporter's reason with what to try
        raise CompileError(
            f"torch.export failed on the static expert path: {type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}; try dynamic_seq=False"
        ) from err
