"""Routing invariants: counts, capacity, expert choice, the losses' documented values, bias balancing, registry."""

import math
import re

import pytest
import torch

import moe_core.routing as routing
from moe_core import MoEConfig, MoEForCausalLM, get_config
from moe_core.router_losses import layer_losses, load_balancing_loss, router_z_loss
from moe_core.routing import (
    ROUTERS,
    build_router,
    drop_over_capacity,
    resolve_router,
)


def route(config, x_TD, train=True):
    router = build_router(config)
    torch.nn.init.normal_(router.gate.weight, std=0.5)
    router.train(train)
    return router, router(x_TD)


@pytest.mark.parametrize("preset,k", [("mixtral-tiny", 2), ("olmoe-tiny", 8), ("shared-tiny", 4)])
def test_dropless_counts_sum_to_T_times_K(preset, k):
    config = get_config(preset)
    _, record = route(config, torch.randn(50, config.hidden_size))
    assert record.tokens_per_expert_E.sum().item() == 50 * k
    assert not record.dropped_TK.any()
    assert record.expert_ids_TK.shape == (50, k)
    torch.testing.assert_close(record.probs_TE.sum(-1), torch.ones(50))
    assert record.probs_TE.dtype == torch.float32


def test_renormalized_topk_weights_sum_to_one_and_unnormalized_do_not():
    x = torch.randn(40, 64)
    _, mixtral = route(get_config("mixtral-tiny"), x)
    torch.testing.assert_close(mixtral.weights_TK.sum(-1), torch.ones(40))
    _, olmoe = route(get_config("olmoe-tiny"), torch.randn(40, 64))
    assert (olmoe.weights_TK.sum(-1) < 1).all()
    torch.testing.assert_close(olmoe.weights_TK, olmoe.probs_TE.gather(-1, olmoe.expert_ids_TK))


def test_topk_then_softmax_weights_are_softmax_over_chosen_logits():
    config = get_config("mixtral-tiny", router_topk_order="topk_then_softmax")
    _, record = route(config, torch.randn(30, 64))
    chosen_logits = record.logits_TE.gather(-1, record.expert_ids_TK)
    torch.testing.assert_close(record.weights_TK, chosen_logits.softmax(-1))


@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 1.25])
def test_capacity_is_respected_and_dropped_slots_have_zero_weight(capacity_factor):
    config = get_config("mixtral-tiny", capacity_factor=capacity_factor)
    T = 64
    # skew the router so that a few experts are oversubscribed
    router = build_router(config)
    with torch.no_grad():
        router.gate.weight.zero_()
        router.gate.weight[0] = 1.0
        router.gate.weight[1] = 0.5
    record = router(torch.rand(T, config.hidden_size))
    capacity = math.ceil(capacity_factor * T * 2 / 8)
    assert record.capacity == capacity
    assert record.tokens_per_expert_E.max().item() <= capacity
    assert record.dropped_TK.any()
    assert (record.weights_TK[record.dropped_TK] == 0).all()
    kept = (~record.dropped_TK).sum().item()
    assert record.tokens_per_expert_E.sum().item() == kept


def test_capacity_priority_is_first_choice_then_token_order():
    # 3 tokens all choosing expert 0 first; capacity 2: the third token's first choice is dropped,
    # and second choices queue behind every first choice.
    ids_TK = torch.tensor([[0, 1], [0, 1], [0, 1]])
    dropped = drop_over_capacity(ids_TK, num_experts=2, capacity=2)
    assert dropped.tolist() == [[False, False], [False, False], [True, True]]


def test_switch_router_top1_with_capacity_and_eval_capacity():
    config = get_config("switch-tiny")
    router, record = route(config, torch.randn(64, 64))
    assert record.expert_ids_TK.shape == (64, 1)
    assert record.capacity == math.ceil(1.25 * 64 / 8)
    router.eval()
    assert router(torch.randn(64, 64)).capacity == math.ceil(2.0 * 64 / 8)  # eval_capacity_factor
    torch.testing.assert_close(
        record.weights_TK[~record.dropped_TK],
        record.probs_TE.gather(-1, record.expert_ids_TK)[~record.dropped_TK],
    )
    with pytest.raises(ValueError, match="routes each token to 1 expert"):
        get_config("switch-tiny", num_experts_per_tok=2)


@pytest.mark.parametrize("T,factor", [(64, 2.0), (37, 1.0), (10, 8.0)])
def test_expert_choice_each_expert_takes_exactly_its_capacity(T, factor):
    config = get_config("mixtral-tiny", router="expert_choice", capacity_factor=factor)
    _, record = route(config, torch.randn(T, 64))
    capacity = min(T, math.ceil(factor * T / 8))
    assert record.capacity == capacity
    assert record.tokens_per_expert_E.tolist() == [capacity] * 8
    chosen_ET = ~record.dropped_TK.t()
    # the chosen tokens are each expert's top-C by probability
    for e in range(8):
        top = record.probs_TE[:, e].topk(capacity).indices
        assert set(top.tolist()) == set(chosen_ET[e].nonzero().squeeze(-1).tolist())
    assert layer_losses([record], [build_router(config).balancing]).aux_L.item() == 0.0


def test_load_balancing_loss_is_one_under_perfectly_uniform_routing():
    T, E = 64, 8
    uniform_probs = torch.full((T, E), 1.0 / E)
    for k in (1, 2, 4):
        ids_TK = (torch.arange(T * k) % E).view(T, k)  # every expert gets exactly T*k/E slots
        assert load_balancing_loss(uniform_probs, ids_TK).item() == pytest.approx(1.0)
    # collapse: everything to expert 0 with probability 1 costs E
    collapsed = torch.zeros(T, E)
    collapsed[:, 0] = 1
    assert load_balancing_loss(collapsed, torch.zeros(T, 1, dtype=torch.long)).item() == pytest.approx(E)


def test_z_loss_matches_hand_value():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    expected = (math.log(2.0) ** 2 + math.log(4.0) ** 2) / 2
    assert router_z_loss(logits).item() == pytest.approx(expected)


def test_aux_free_bias_moves_load_toward_uniform_and_never_in_eval():
    config = get_config(
        "mixtral-tiny",
        router="aux_free",
        router_score="sigmoid",
        router_bias_update_rate=0.02,
        router_aux_loss_coef=0.0,
    )
    torch.manual_seed(0)
    router = build_router(config)
    with torch.no_grad():  # a router that strongly prefers expert 0 and 1
        router.gate.weight.normal_(std=0.05)
        router.gate.weight[:2] += 0.3
    x = torch.randn(256, 64).abs()

    def imbalance():
        load = router(x).tokens_per_expert_E.float()
        return (load.max() / load.mean()).item()

    router.eval()
    start = imbalance()
    bias_before = router.expert_bias.clone()
    for _ in range(5):
        router(x)
        router.update_bias()
    assert torch.equal(router.expert_bias, bias_before), "eval forwards must not move the bias"

    router.train()
    for _ in range(60):
        record = router(x)
        router.observe(record)
        router.update_bias()
    router.eval()
    assert imbalance() < start * 0.7
    assert not torch.equal(router.expert_bias, bias_before)
    assert "expert_bias" in router.state_dict()


def test_aux_free_bias_is_updated_by_the_model_only_in_training():
    config = get_config("mixtral-tiny", router="aux_free", router_bias_update_rate=0.01)
    model = MoEForCausalLM(config)
    x = torch.randint(0, config.vocab_size, (2, 16))
    model.eval()
    model(x)
    model.update_router_biases()
    assert all(torch.count_nonzero(r.expert_bias) == 0 for r in model.routers())
    model.train()
    model(x)
    model.update_router_biases()
    assert all(torch.count_nonzero(r.expert_bias) > 0 for r in model.routers())


def test_jitter_only_in_training():
    config = get_config("switch-tiny", router_jitter=0.5)
    router = build_router(config)
    x = torch.randn(16, 64)
    router.eval()
    torch.testing.assert_close(router(x).logits_TE, router(x).logits_TE)
    router.train()
    assert not torch.allclose(router(x).logits_TE, router(x).logits_TE)


@pytest.mark.parametrize(
    "overrides,field",
    [
        (dict(num_experts_per_tok=9), "num_experts_per_tok"),
        (dict(router="no_such_router"), "router"),
        (dict(router="os.path.join"), "router"),
        (dict(capacity_factor=-1.0), "capacity_factor"),
        (dict(router_aux_loss_coef=-0.1), "router_aux_loss_coef"),
        (dict(num_key_value_heads=3), "num_key_value_heads"),
        (dict(ffn_activation="tanh"), "ffn_activation"),
        (dict(expert_impl="fastest"), "expert_impl"),
    ],
)
def test_bad_config_values_are_refused_with_the_field_named(overrides, field):
    with pytest.raises(ValueError, match=re.escape(f"MoEConfig.{field}=")):
        get_config("mixtral-tiny", **overrides)


def test_the_documented_custom_router_example_works():
    """The example in moe_core.routing's docstring is real: run it, then train a step with it."""
    example = routing.__doc__.split("Adding a router")[1].split("::", 1)[1]
    code = "\n".join(line[4:] for line in example.splitlines())
    assert len(code.strip().splitlines()) < 40
    namespace = {"torch": torch}
    exec(compile(code, "routing-docstring-example", "exec"), namespace)
    try:
        config = get_config("mixtral-tiny", router="hash", num_experts_per_tok=1)
        model = MoEForCausalLM(config)
        x = torch.randint(0, config.vocab_size, (2, 8))
        out = model(x, labels=x, output_routing=True)
        out.loss.backward()
        assert out.routing[0].expert_ids_TK[:, 0].tolist() == [t % 8 for t in range(16)]
    finally:
        ROUTERS.pop("hash", None)


def test_router_from_dotted_path():
    assert resolve_router("moe_core.routing.ExpertChoiceRouter") is ROUTERS["expert_choice"]
    assert resolve_router("moe_core.routing:SwitchRouter") is ROUTERS["switch"]
    config = MoEConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_experts=4,
        num_experts_per_tok=1,
        router="moe_core.routing.SwitchRouter",
    )
    assert type(build_router(config)).__name__ == "SwitchRouter"


def test_router_losses_are_skipped_only_for_gradient_free_eval():
    config = get_config("mixtral-tiny")
    model = MoEForCausalLM(config)
    x = torch.randint(0, config.vocab_size, (2, 8))
    model.eval()
    with torch.no_grad():
        out = model(x, labels=x, output_routing=True)
    assert out.aux_loss is None and out.z_loss is None and out.router_losses is None
    assert torch.equal(out.loss, out.lm_loss)
    assert out.routing[0].tokens_per_expert_E.sum() == 16 * 2  # analytics still get the counts
    assert model(x, labels=x).aux_loss is not None  # eval with gradients (e.g. a hook-based analysis)
    model.train()
    with torch.no_grad():
        assert model(x, labels=x).aux_loss is not None  # training telemetry under no_grad keeps them
