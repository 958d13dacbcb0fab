"""The decode path (only the chosen experts' weights) equals the reference loop, and generation is unchanged."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_core import MoEForCausalLM, get_config
from moe_core.experts import GroupedExperts
from moe_core.inference.fast_decode import DecodeExperts, disable_fast_decode, enable_fast_decode
from moe_core.routing import build_router

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.mark.parametrize(
    "preset,T", [("mixtral-tiny", 1), ("mixtral-tiny", 5), ("olmoe-tiny", 1), ("switch-tiny", 3)]
)
def test_decode_path_matches_reference(preset, T):
    config = get_config(preset, eval_capacity_factor=None, capacity_factor=None)
    torch.manual_seed(0)
    router = build_router(config).eval()
    experts = GroupedExperts(
        config.num_experts, config.hidden_size, config.expert_intermediate_size, config.ffn_activation
    )
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.2)
    fast = DecodeExperts.wrap(experts)
    x_TD = torch.randn(T, config.hidden_size)
    record = router(x_TD)
    with torch.no_grad():
        assert fast.uses_decode_path(x_TD, record, fast.resolved_impl(x_TD))
        torch.testing.assert_close(
            fast(x_TD, record), experts.forward_reference(x_TD, record), atol=1e-6, rtol=1e-5
        )


def test_decode_path_respects_dropped_slots():
    config = get_config("mixtral-tiny")
    torch.manual_seed(0)
    experts = GroupedExperts(
        config.num_experts, config.hidden_size, config.expert_intermediate_size, "swiglu"
    )
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.2)
    record = build_router(config)(torch.randn(3, config.hidden_size))
    record.dropped_TK[0, 1] = True
    record = dataclasses.replace(record, weights_TK=record.weights_TK.masked_fill(record.dropped_TK, 0.0))
    x = torch.randn(3, config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(
            DecodeExperts.wrap(experts)(x, record), experts.forward_reference(x, record)
        )


def test_training_and_large_batches_use_the_library_paths():
    config = get_config("mixtral-tiny")
    experts = DecodeExperts.wrap(
        GroupedExperts(8, config.hidden_size, config.expert_intermediate_size, "swiglu"), 4
    )
    record = build_router(config)(torch.randn(8, config.hidden_size))
    assert not experts.uses_decode_path(torch.randn(8, config.hidden_size), record, "sorted")  # 16 slots > 4
    x = torch.randn(1, config.hidden_size, requires_grad=True)
    assert not experts.uses_decode_path(x, build_router(config)(x.detach()), "sorted")  # needs a gradient


def test_enable_shares_parameters_and_keeps_generation():
    torch.manual_seed(0)
    model = MoEForCausalLM(get_config("mixtral-tiny")).eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, 6))
    before = model.generate(prompt, max_new_tokens=10, do_sample=False)
    names = set(model.state_dict())
    enable_fast_decode(model)
    assert all(isinstance(layer.mlp.experts, DecodeExperts) for layer in model.model.layers if layer.is_moe)
    assert set(model.state_dict()) == names
    assert torch.equal(model.generate(prompt, max_new_tokens=10, do_sample=False), before)
    disable_fast_decode(model)
    assert not any(isinstance(m, DecodeExperts) for m in model.modules())


@torch.no_grad()
def test_swapped_modules_keep_the_hooks_registered_on_them():
    """`enable_fast_decode` and `reduction_gemv` swap modules in place (sharing the parameters): hooks a user
    registered on the originals keep firing on the swapped ones and back, and their handles still work."""
    from moe_core.inference.compile import ReductionLinear, reduction_gemv

    torch.manual_seed(0)
    model = MoEForCausalLM(get_config("mixtral-tiny", vocab_size=64)).eval()
    seen = []
    handles = [
        model.model.layers[0].mlp.experts.register_forward_hook(lambda *_: seen.append("experts")),
        model.lm_head.register_forward_hook(lambda *_: seen.append("lm_head")),
    ]
    enable_fast_decode(model)
    reduction_gemv(model)
    assert isinstance(model.lm_head, ReductionLinear)
    assert isinstance(model.model.layers[0].mlp.experts, DecodeExperts)
    model(torch.randint(0, 64, (1, 3)))
    assert seen == ["experts", "lm_head"]
    disable_fast_decode(model)
    model(torch.randint(0, 64, (1, 3)))
    assert seen == ["experts", "lm_head"] * 2
    for handle in handles:
        handle.remove()
    model(torch.randint(0, 64, (1, 3)))
    assert len(seen) == 4
