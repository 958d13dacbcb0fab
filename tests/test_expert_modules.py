"""Every expert module satisfies the one declared interface (`moe_core.experts.ExpertModule`) and computes the
same layer through it; the one sort-by-expert dispatch; constructors that share weights without copies and
``stacks(dtype)`` that honours its dtype."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from moe_core import MoEForCausalLM, get_config
from moe_core.experts import (
    ExpertDispatch,
    ExpertModule,
    GroupedExperts,
    StackedExperts,
    sort_by_expert,
)
from moe_core.inference.expert_cache import ExpertCache, OffloadedExperts, expert_file
from moe_core.inference.fast_decode import DecodeExperts
from moe_core.inference.quantize import PROJECTIONS, QuantConfig, QuantizedExperts, fake_quantize
from moe_core.routing import build_router
from moe_core.train.parallel import ExpertParallelExperts, ParallelState

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

CONFIG = get_config("mixtral-tiny", capacity_factor=None, eval_capacity_factor=None)
E, D, F_ = CONFIG.num_experts, CONFIG.hidden_size, CONFIG.expert_intermediate_size


def layer(T: int = 6, seed: int = 0):
    """A GroupedExperts with random weights, T tokens and their routing (one slot dropped)."""
    torch.manual_seed(seed)
    experts = GroupedExperts(E, D, F_, CONFIG.ffn_activation)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x_TD = torch.randn(T, D)
    with torch.no_grad():  # routing is an input here, not something to differentiate
        record = build_router(CONFIG).eval()(x_TD)
    if T > 1:
        record.dropped_TK[1, 0] = True
        record = dataclasses.replace(record, weights_TK=record.weights_TK.masked_fill(record.dropped_TK, 0.0))
    return experts, x_TD, record


def check(module, x_TD, record, reference_TD, atol=1e-6, rtol=1e-5):
    assert isinstance(module, ExpertModule) and module.num_experts == E
    with torch.no_grad():
        torch.testing.assert_close(module(x_TD, record), reference_TD, atol=atol, rtol=rtol)
        torch.testing.assert_close(module(x_TD, record, None), reference_TD, atol=atol, rtol=rtol)


@pytest.mark.parametrize("T", [1, 6])
def test_stacked_implementations_share_the_interface_and_the_layer(T):
    experts, x, record = layer(T)
    reference = experts.forward_reference(x, record)
    assert isinstance(experts, StackedExperts)
    check(experts, x, record, reference)
    decode = DecodeExperts.wrap(experts)
    assert isinstance(decode, StackedExperts) and decode.uses_decode_path(x, record, "sorted")
    check(decode, x, record, reference)
    # quantized: equal to the plain layer on its fake-quantized weights (quantize, dequantize)
    config = QuantConfig(bits=8)
    quantized = QuantizedExperts.from_experts(experts, config)
    assert isinstance(quantized, StackedExperts) and quantized.max_slots == 64
    fake = copy.deepcopy(experts)
    with torch.no_grad():
        for p in PROJECTIONS:
            getattr(fake, p).copy_(fake_quantize(getattr(fake, p), config))
    check(quantized, x, record, fake.forward_reference(x, record), atol=1e-5)
    with pytest.raises(TypeError, match="abstract"):
        StackedExperts(E, "swiglu")


def test_offloaded_experts_share_the_interface_and_the_layer(tmp_path):
    experts, x, record = layer()
    for e in range(E):
        tensors = {p: getattr(experts, p)[e].detach().contiguous() for p in PROJECTIONS}
        save_file(tensors, str(expert_file(tmp_path, 0, e)))
    offloaded = OffloadedExperts(0, E, CONFIG.ffn_activation, ExpertCache(tmp_path, capacity=E))
    check(offloaded, x, record, experts.forward_reference(x, record))


@pytest.mark.parametrize("impl", ["sorted", "grouped_mm"])
def test_expert_parallel_experts_share_the_interface_and_the_layer(tmp_path, impl):
    # a one-process gloo group: the module's own path (ep_size 1) and its all-to-all dispatch (the local experts
    # one by one, or as one grouped matmul per projection: what a GPU runs), forward and backward, against the
    # reference loop; the multi-process runs are in test_train_parallel.py
    experts, x, record = layer()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        parallel = ExpertParallelExperts(experts, ParallelState())
        check(parallel, x, record, experts.forward_reference(x, record))
        x_ref = x.clone().requires_grad_()
        experts.forward_reference(x_ref, record).square().sum().backward()
        x_a2a = x.clone().requires_grad_()
        y = parallel.forward_all_to_all(x_a2a, record, impl=impl)
        torch.testing.assert_close(y, experts.forward_reference(x, record), atol=1e-6, rtol=1e-5)
        y.square().sum().backward()
        torch.testing.assert_close(x_a2a.grad, x_ref.grad, atol=1e-6, rtol=1e-5)
        for p in PROJECTIONS:
            torch.testing.assert_close(getattr(parallel.local, p).grad, getattr(experts, p).grad)
    finally:
        dist.destroy_process_group()


def test_peft_lora_wrapper_on_the_experts_is_an_expert_module():
    # finetune's LoRA on the expert stacks (PEFT target_parameters) wraps the module; the wrapper's forward
    # must equal the plain layer on the merged weights W + B A
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = MoEForCausalLM(CONFIG).eval()
    x = torch.randn(5, CONFIG.hidden_size)
    with torch.no_grad():
        record = model.model.layers[0].mlp.router(x)
        base = model.model.layers[0].mlp.experts.forward_reference(x, record)
    lora = LoraConfig(r=2, target_parameters=[f"layers.0.mlp.experts.{p}" for p in PROJECTIONS])
    peft_model = get_peft_model(model, lora)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.2)
    wrapper = peft_model.base_model.model.model.layers[0].mlp.experts
    assert not isinstance(wrapper, GroupedExperts)  # PEFT's ParamWrapper, not our class
    assert isinstance(wrapper, ExpertModule) and wrapper.num_experts == E
    with torch.no_grad():
        y = wrapper(x, record)
    assert not torch.allclose(y, base, atol=1e-3)  # the adapter is live: the comparison below means something
    merged = peft_model.merge_and_unload().model.layers[0].mlp.experts
    assert type(merged) is GroupedExperts
    with torch.no_grad():
        torch.testing.assert_close(y, merged.forward_reference(x, record), atol=1e-5, rtol=1e-5)


def test_constructors_share_weights_and_stacks_honour_dtype():
    experts, x, record = layer()
    decode = DecodeExperts.wrap(experts, max_slots=4)
    plain = GroupedExperts.sharing(decode, max_slots=0)
    for module in (decode, plain):
        assert all(getattr(module, p) is getattr(experts, p) for p in PROJECTIONS)
        assert list(module.state_dict()) == list(experts.state_dict())
        assert module.training and module.impl == experts.impl
    assert (decode.max_slots, plain.max_slots, type(plain)) == (4, 0, GroupedExperts)
    assert experts.stacks()[1] is experts.up_proj  # as stored: no copy
    quantized = QuantizedExperts.from_experts(experts, QuantConfig(bits=4, group_size=16))
    for module in (experts, decode, quantized):
        assert [w.dtype for w in module.stacks(torch.bfloat16)] == [torch.bfloat16] * 3
        assert [w.dtype for w in module.stacks(torch.float64)] == [torch.float64] * 3
    # the static and gather paths read the stacks in the input's dtype
    with torch.no_grad():
        y64 = experts(x.double(), record, "static")
    assert y64.dtype == torch.float64
    torch.testing.assert_close(y64.float(), experts.forward_reference(x, record), atol=1e-5, rtol=1e-5)


def test_dispatch_sorts_kept_slots_by_expert_and_inverts():
    torch.manual_seed(0)
    ids_A = torch.randint(0, E, (40,))
    by_expert = sort_by_expert(ids_A, E)
    assert torch.equal(by_expert.expert_ids_A, ids_A[by_expert.order_A])
    assert bool((by_expert.expert_ids_A[1:] >= by_expert.expert_ids_A[:-1]).all())
    assert torch.equal(by_expert.counts_E, torch.bincount(ids_A, minlength=E))
    for e in range(E):  # stable: one expert's rows keep their order
        rows = by_expert.order_A[by_expert.expert_ids_A == e]
        assert bool((rows[1:] > rows[:-1]).all())
    assert torch.equal(by_expert.expert_ids_A[by_expert.inverse()], ids_A)

    _, x, record = layer(T=7)
    dispatch = ExpertDispatch.of(record, E)
    kept = int((~record.dropped_TK).sum())
    assert dispatch.token_idx_A.numel() == kept == int(dispatch.counts_E.sum())
    assert torch.equal(dispatch.gather(x), x[dispatch.token_idx_A])
    # combining ones gives each token the sum of its kept combine weights
    summed_T = dispatch.combine(torch.ones(kept, D), x)[:, 0]
    torch.testing.assert_close(summed_T, record.weights_TK.masked_fill(record.dropped_TK, 0).sum(1))
