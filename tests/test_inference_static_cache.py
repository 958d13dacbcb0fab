"""Static KV cache: the model on transformers' StaticCache equals the DynamicCache, and compiled static-cache
decoding gives the eager greedy tokens with one decode graph for every cache length."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers.cache_utils import DynamicCache, StaticCache

from moe_core import MoEForCausalLM, get_config
from moe_core.inference.compile import CompileError, compile_steps, eager_steps

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def tiny(**overrides) -> MoEForCausalLM:
    torch.manual_seed(0)
    return MoEForCausalLM(get_config("mixtral-tiny", vocab_size=128, **overrides)).eval()


def greedy(steps, prompt, new_tokens):
    logits, state = steps.prefill(prompt)
    out = []
    for _ in range(new_tokens):
        nxt = logits.argmax(-1, keepdim=True)
        out.append(nxt)
        logits, state = steps.decode(nxt, state)
    return torch.cat(out, dim=1)


@torch.no_grad()
def test_static_cache_equals_dynamic_cache_with_left_padding():
    model = tiny()
    B, S, L = 2, 7, 16
    x = torch.randint(0, 128, (B, S))
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, :3] = 0  # left padding on the second row
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    static = StaticCache(config=model.config, max_cache_len=L)
    full_mask = torch.cat([mask, torch.ones(B, L - S, dtype=torch.long)], dim=1)
    out_s = model(
        x,
        attention_mask=full_mask,
        position_ids=positions,
        cache=static,  # (writes after what it holds: transformers 5's StaticCache counts its own length)
        use_cache=True,
    )
    out_d = model(
        x,
        attention_mask=mask,
        position_ids=positions,
        cache=DynamicCache(config=model.config),
        use_cache=True,
    )
    keep = mask.bool()
    torch.testing.assert_close(out_s.logits[keep], out_d.logits[keep], atol=1e-5, rtol=1e-5)
    dyn = out_d.cache
    for t in range(3):
        nxt = out_s.logits[:, -1:].argmax(-1)
        pos = positions[:, -1:] + 1 + t
        out_s = model(
            nxt,
            attention_mask=full_mask,
            position_ids=pos,
            cache=static,
            use_cache=True,
        )
        mask = torch.cat([mask, torch.ones(B, 1, dtype=torch.long)], dim=1)
        out_d = model(nxt, attention_mask=mask, position_ids=pos, cache=dyn, use_cache=True)
        dyn = out_d.cache
        torch.testing.assert_close(out_s.logits, out_d.logits, atol=1e-5, rtol=1e-5)
    assert static.layers[0].keys.shape[2] == L  # preallocated, never grown


def test_compiled_static_decode_gives_the_eager_greedy_tokens_with_one_graph():
    """Decoding into the static cache: the same tokens as eager decoding on a DynamicCache, and no new graph as
    the cache fills (its length is a tensor input, not a guard). aot_eager: the graph, without the C++ build."""
    from torch._dynamo.utils import counters

    model = tiny(num_hidden_layers=1)
    prompt = torch.randint(0, 128, (2, 6))
    expected = greedy(eager_steps(model), prompt, 8)
    steps = compile_steps(model, backend="aot_eager", cache="static", max_cache_len=16, compile_prefill=False)
    logits, state = steps.prefill(prompt)
    nxt = logits.argmax(-1, keepdim=True)
    logits, state = steps.decode(nxt, state)  # the first decode compiles
    graphs = counters["stats"]["unique_graphs"]
    for _ in range(5):
        logits, state = steps.decode(logits.argmax(-1, keepdim=True), state)
    assert counters["stats"]["unique_graphs"] == graphs
    assert torch.equal(greedy(steps, prompt, 8), expected)  # a second generation reuses (resets) the cache
    assert torch.equal(greedy(steps, prompt[:1], 8), expected[:1])  # another batch size: a new cache
    with pytest.raises(CompileError, match="max_cache_len"):
        greedy(steps, prompt, 12)
    with pytest.raises(CompileError, match="max_cache_len"):
        steps.prefill(torch.randint(0, 128, (1, 16)))


def recording_backend(graphs: list):
    """A dynamo backend that keeps each captured graph's inputs as traced (fake tensors with their symbolic
    shapes, symbolic numbers) and runs the graph as captured."""

    def backend(gm, example_inputs):
        graphs.append([node.meta["example_value"] for node in gm.graph.find_nodes(op="placeholder")])
        return gm.forward

    return backend


def boxed_numbers(inputs) -> list:
    """Graph inputs that are Python numbers boxed per call (0-d float64 tensors, symbolic floats)."""
    return [
        x
        for x in inputs
        if isinstance(x, torch.SymFloat)
        or (isinstance(x, torch.Tensor) and x.dim() == 0 and x.dtype == torch.float64)
    ]


def symbolic_dims(inputs) -> list:
    return [n for x in inputs if isinstance(x, torch.Tensor) for n in x.shape if isinstance(n, torch.SymInt)]


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@torch.no_grad()
def test_compiled_steps_take_only_tensors_one_graph_per_step_whatever_the_lengths(cache):
    """The class of per-call overhead `compile_steps` avoids: no Python number of the model (norm eps, ...)
    becomes a graph input boxed on every call, the lengths are symbolic from the first compile (one prefill
    and one decode graph for prompts of 5 and 7 tokens), and batch-1 decode has only static shapes."""
    model = tiny(num_hidden_layers=1)
    graphs = []
    steps = compile_steps(model, backend=recording_backend(graphs), cache=cache, max_cache_len=16)
    for length in (5, 7):
        prompt = torch.randint(0, 128, (1, length))
        assert torch.equal(greedy(steps, prompt, 4), greedy(eager_steps(model), prompt, 4))
    assert len(graphs) == 2  # prefill and decode, each compiled once
    assert all(not boxed_numbers(inputs) for inputs in graphs)
    assert symbolic_dims(graphs[0])  # the prompt length
    # the batch-1 decode graph on a static cache: every shape a constant; on a dynamic one: the cache length
    assert bool(symbolic_dims(graphs[1])) == (cache == "dynamic")


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@torch.no_grad()
def test_compiled_steps_refuse_a_model_changed_after_compiling(cache):
    """The compiled kernels neither guard on the model nor assert their input sizes: a model whose parameters
    were replaced (a cast, a pruned stack) is refused at the next prefill, before any kernel reads it."""
    model = tiny(num_hidden_layers=1)
    steps = compile_steps(model, backend="eager", cache=cache, max_cache_len=16, compile_prefill=False)
    prompt = torch.randint(0, 128, (1, 5))
    greedy(steps, prompt, 2)
    model.lm_head.weight.mul_(1.0)  # updated in place: the same layout, still accepted
    greedy(steps, prompt, 2)
    model.config.num_experts_per_tok = 1  # the router the graphs were traced with reads K
    with pytest.raises(CompileError, match=r"config.num_experts_per_tok: 2 when .* 1 now"):
        steps.prefill(prompt)
    model.config.num_experts_per_tok = 2
    head = model.lm_head
    model.lm_head = torch.nn.Linear(head.in_features, head.out_features, bias=False)  # another module class
    with pytest.raises(CompileError, match=r"lm_head \(module\): ReductionLinear .* Linear now"):
        steps.prefill(prompt)
    model.lm_head = head
    greedy(steps, prompt, 2)
    experts = model.model.layers[0].mlp.experts
    experts.up_proj = torch.nn.Parameter(experts.up_proj[:4].clone())  # four of the experts kept
    with pytest.raises(CompileError, match=r"up_proj: \(8, .*\(4, .*compile_steps again"):
        steps.prefill(prompt)
    model.to(torch.bfloat16)
    with pytest.raises(CompileError, match="bfloat16"):
        steps.prefill(prompt)


@contextlib.contextmanager
def compilations():
    """Every bytecode dynamo produces inside the block (one per graph it compiles)."""
    produced = []
    handle = torch._dynamo.convert_frame.register_bytecode_hook(
        lambda _original, transformed: produced.append(transformed)
    )
    try:
        yield produced
    finally:
        handle.remove()


@torch.no_grad()
def test_direct_dispatch_runs_each_signature_compiled_once_without_dynamo():
    """After its first call, each decode signature (batch size, mask or none) runs its compiled code directly:
    the same logits as the guarded steps, no new compilation even once dynamo's caches are cleared
    (``torch._dynamo.reset``: a guarded step would compile again), and a new batch size compiles its own."""
    model = tiny(num_hidden_layers=1)
    options = dict(backend="aot_eager", cache="static", max_cache_len=16, compile_prefill=False)
    direct = compile_steps(model, **options, direct_dispatch=True)
    guarded = compile_steps(model, **options, direct_dispatch=False)
    prompt = torch.randint(2, 128, (2, 6))
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0  # a left-padded row: the signature with a mask
    positions = (mask.cumsum(-1) - 1).clamp_min(0)

    def logits_of(steps, prompt, mask=None, positions=None, new_tokens=5):
        logits, state = steps.prefill(prompt, mask, positions)
        out = [logits]
        next_positions = None if positions is None else positions[:, -1:] + 1
        for _ in range(new_tokens):
            logits, state = steps.decode(logits.argmax(-1, keepdim=True), state, None, next_positions)
            out.append(logits)
            next_positions = None if next_positions is None else next_positions + 1
        return torch.stack(out)

    for args in [(prompt,), (prompt, mask, positions), (prompt[:1],)]:
        assert torch.equal(logits_of(direct, *args), logits_of(guarded, *args))
    steps = direct.decode.__self__
    assert len(steps.decoders) == 3  # batch 2, batch 2 with a mask, batch 1
    assert all(call is not None for call in steps.graph_calls.values())  # each on its prebuilt inputs
    bytecode = compile_steps(
        model, **options, direct_dispatch=True, graph_call=False
    )  # dynamo's bytecode on every call
    assert torch.equal(logits_of(bytecode, prompt), logits_of(guarded, prompt))
    assert list(bytecode.decode.__self__.graph_calls.values()) == [None]
    torch._dynamo.reset()
    with compilations() as produced:
        again = logits_of(direct, prompt, mask, positions)
    assert not produced  # the direct steps outlive dynamo's caches
    with compilations() as produced:
        assert torch.equal(again, logits_of(guarded, prompt, mask, positions))
    assert len(produced) == 1  # while the guarded decode compiles again


@torch.no_grad()
def test_batch_one_decode_stays_static_after_other_shapes_compiled():
    """Dynamo remembers dynamic dimensions per source line, across code objects: once any steps decoded
    another batch size or cache length, a later batch-1 graph would come out symbolic in them (slower
    kernels). Direct dispatch compiles each signature with static shapes regardless."""
    model = tiny(num_hidden_layers=1)
    options = dict(cache="static", compile_prefill=False, direct_dispatch=True)
    first = compile_steps(model, backend="aot_eager", max_cache_len=32, **options)
    for batch in (2, 3):
        greedy(first, torch.randint(2, 128, (batch, 5)), 3)
    graphs = []
    later = compile_steps(model, backend=recording_backend(graphs), max_cache_len=16, **options)
    greedy(later, torch.randint(2, 128, (1, 5)), 3)
    assert len(graphs) == 1 and not symbolic_dims(graphs[0])


@torch.no_grad()
def test_graph_call_on_prebuilt_inputs_follows_replaced_parameters_and_caches():
    """From its third call a direct step calls inductor's compiled graph on a prebuilt input list: the same
    logits as dynamo's guarded steps, through a batch change and back (another cache, rebound) and after a
    parameter was replaced by another of the same shape (the list held the old one: recorded again)."""
    model = tiny(num_hidden_layers=1)
    options = dict(cache="static", max_cache_len=16, compile_prefill=False)
    direct = compile_steps(model, **options, direct_dispatch=True)
    guarded = compile_steps(model, **options, direct_dispatch=False)
    steps = direct.decode.__self__

    def logits_of(steps, prompt, new_tokens=4):
        logits, state = steps.prefill(prompt)
        out = [logits]
        for _ in range(new_tokens):
            logits, state = steps.decode(logits.argmax(-1, keepdim=True), state)
            out.append(logits)
        return torch.stack(out)

    prompt = torch.randint(2, 128, (1, 6))
    assert torch.equal(logits_of(direct, prompt), logits_of(guarded, prompt))
    (call,) = steps.graph_calls.values()
    assert call.boxed  # inductor's graph itself, without AOT autograd's runtime wrapper
    for batch in (prompt.repeat(2, 1), prompt):
        before = logits_of(direct, batch)
        assert torch.equal(before, logits_of(guarded, batch))
    head = model.lm_head.weight
    model.lm_head.weight = torch.nn.Parameter(head.flip(0))  # the same layout: accepted, and read
    replaced = logits_of(direct, prompt)
    assert torch.equal(replaced, logits_of(guarded, prompt))
    assert not torch.equal(replaced, before)
    with torch.enable_grad():  # a caller outside no_grad: the same logits, and nothing recorded
        again = logits_of(direct, prompt)
    assert torch.equal(again, replaced) and not again.requires_grad


@torch.no_grad()
def test_graph_call_runs_a_graph_that_writes_more_than_the_cache_exactly_once_per_step():
    """A graph that also writes a buffer of the model (a counter a forward hook keeps) keeps AOT autograd's
    runtime wrapper, and is never run twice for one step (recording checks the bare graph by running it
    again only where that rewrites nothing but the cache slots just written)."""
    model = tiny(num_hidden_layers=1)
    model.register_buffer("forwards", torch.zeros((), dtype=torch.long))

    def count(*_):
        model.forwards.add_(1)

    model.lm_head.register_forward_hook(count)
    steps = compile_steps(
        model, cache="static", max_cache_len=16, compile_prefill=False, direct_dispatch=True
    )
    greedy(steps, torch.randint(2, 128, (1, 6)), 5)
    (call,) = steps.decode.__self__.graph_calls.values()
    assert call is not None and not call.boxed
    assert model.forwards.item() == 1 + 5  # the prefill and five decode steps


@pytest.mark.parametrize(
    "options",
    [
        dict(cache="static", max_cache_len=16),
        dict(cache="static", max_cache_len=16, direct_dispatch=False),
        dict(cache="dynamic"),
        dict(cache="dynamic", compile_prefill=True),
    ],
    ids=["static-direct", "static-guarded", "dynamic", "dynamic-compiled-prefill"],
)
@torch.no_grad()
def test_a_python_side_effect_of_the_model_is_refused_by_the_compiled_steps(options):
    """Dynamo replays a model's Python side effects (here a hook appending to a list) as it saw them while
    tracing, and the steps keep no guards on the modules' hooks: every step would replay the first one's
    append (it did, guarded or not). Every compiled step refuses such a model, saying what to do."""
    model = tiny(num_hidden_layers=1)
    seen = []
    model.lm_head.register_forward_hook(lambda *_: seen.append(1))
    steps = compile_steps(model, backend="aot_eager", **{"compile_prefill": False, **options})
    with pytest.raises(CompileError, match=r"Python side effect .*STORE_SUBSCR.*decode eagerly"):
        greedy(steps, torch.randint(2, 128, (1, 6)), 3)
