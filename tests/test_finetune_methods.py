"""Expert subsets, ESFT selection, frozen experts and the task router bias, driven by plain optimizer steps."""

import pytest
import torch

from moe_core.finetune import FinetuneConfig
from moe_core.finetune.export import merged_model
from moe_core.finetune.methods import (
    ExpertRowFreeze,
    RoutingUsage,
    TaskRouterBias,
    apply_method,
    routing_usage,
    select_esft_experts,
)
from tests.finetune_helpers import state, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def steps(model, n=3, lr=1e-2, weight_decay=0.1, seed=0):
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay
    )
    x = torch.randint(0, 300, (4, 12))
    for _ in range(n):
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    return x


def test_lora_on_an_expert_subset_changes_only_those_experts():
    model = tiny_model()
    before = state(model)
    config = FinetuneConfig.build(
        {"lora": {"r": 2, "experts": "list", "expert_ids": {0: [1], 1: [0, 3]}, "attention": []}}
    )
    peft_model, plan = apply_method(model, config)
    x = steps(peft_model, lr=5e-2)
    with torch.no_grad():
        adapted = peft_model(input_ids=x).logits
    merged = merged_model(peft_model, plan)
    torch.testing.assert_close(merged(input_ids=x).logits, adapted, atol=1e-5, rtol=1e-5)
    after = state(merged)
    chosen = {0: [1], 1: [0, 3]}
    for layer in (0, 1):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            name = f"model.layers.{layer}.mlp.experts.{proj}"
            for e in range(4):
                same = torch.equal(after[name][e], before[name][e])
                assert same != (e in chosen[layer]), (
                    name,
                    e,
                )  # chosen experts moved, the others are bitwise equal
    for name in before:
        if ".mlp.experts." not in name:
            assert torch.equal(after[name], before[name]), name


def test_esft_takes_the_most_used_experts_until_the_share_is_reached():
    slots = torch.tensor([[10.0, 50.0, 30.0, 10.0], [25.0, 25.0, 25.0, 25.0]], dtype=torch.float64)
    usage = RoutingUsage([0, 1], slots, slots.clone(), tokens=50)
    assert select_esft_experts(usage, share=0.5) == {0: [1], 1: [0, 1]}
    assert select_esft_experts(usage, share=0.8) == {0: [1, 2], 1: [0, 1, 2, 3]}
    assert select_esft_experts(usage, share=0.8, max_experts=2) == {0: [1, 2], 1: [0, 1]}
    assert select_esft_experts(usage, share=0.5, exclude={0: [1]}) == {0: [0, 2, 3], 1: [0, 1]}


def test_routing_usage_counts_real_tokens_only_and_moves_no_router_state():
    model = tiny_model(router="aux_free", router_bias_update_rate=0.1).train()
    ids = torch.randint(0, 300, (2, 6))
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    usage = routing_usage(model, [{"input_ids": ids, "attention_mask": mask}])
    assert usage.tokens == 9 and model.training
    assert torch.equal(usage.slots_LE.sum(-1), torch.full((2,), 9.0 * 2, dtype=torch.float64))  # T * K
    assert all(r.pending_load.sum() == 0 for r in model.routers())


def test_full_finetuning_keeps_frozen_experts_and_router_bitwise():
    model = tiny_model()
    before = state(model)
    config = FinetuneConfig.build({"method": "full", "freeze": {"router": True, "experts": [0, 2]}})
    model, plan = apply_method(model, config)
    assert isinstance(plan.expert_freeze, ExpertRowFreeze)
    torch.manual_seed(0)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    x = torch.randint(0, 300, (4, 12))
    for _ in range(3):
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        plan.expert_freeze.restore()  # what MoEStepCallback does after each optimizer step
        opt.zero_grad()
    after = state(model)
    for layer in (0, 1):
        assert torch.equal(
            after[f"model.layers.{layer}.mlp.router.gate.weight"],
            before[f"model.layers.{layer}.mlp.router.gate.weight"],
        )
        for proj in ("gate_proj", "up_proj", "down_proj"):
            name = f"model.layers.{layer}.mlp.experts.{proj}"
            for e in range(4):
                assert torch.equal(after[name][e], before[name][e]) == (e in (0, 2)), (name, e)
    assert not torch.equal(
        after["model.layers.0.self_attn.q_proj.weight"], before["model.layers.0.self_attn.q_proj.weight"]
    )


def test_task_router_bias_routes_each_task_by_its_own_bias():
    model = tiny_model().eval()
    x = torch.randint(0, 300, (2, 5))
    base = model(input_ids=x, output_routing=True)
    bias = TaskRouterBias(model.config.moe_layer_ids, ["a", "b"], 4).attach(model)
    with bias.tasks(torch.tensor([0, 1])):
        same = model(input_ids=x, output_routing=True)  # zero bias: the base routing and logits
    torch.testing.assert_close(same.logits, base.logits)
    with torch.no_grad():
        bias.bias_LNE[:, 1, 3] = 100.0  # task "b" sends every token to expert 3
    with bias.tasks(bias.task_ids(["a", "b"])):
        out = model(input_ids=x, output_routing=True)
    for record, base_record in zip(out.routing, base.routing):
        ids_BSK = record.expert_ids_TK.view(2, 5, -1)
        assert (ids_BSK[1] == 3).any(-1).all()
        assert torch.equal(ids_BSK[0], base_record.expert_ids_TK.view(2, 5, -1)[0])
    assert not torch.allclose(out.logits[1], base.logits[1])
    bias.detach(model)
    assert "task_router_bias" not in dict(model.named_modules())
