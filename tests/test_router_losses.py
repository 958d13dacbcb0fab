"""The router losses' one home (`moe_core.router_losses`): every trainer weighs them alike, padding does not
count, the scope is one setting, and the record a router returns is a fact nothing writes into."""

import dataclasses
import math
import typing

import pytest
import torch

from moe_core import MoEForCausalLM, get_config
from moe_core.finetune import FinetuneConfig, finetune
from moe_core.router_losses import (
    BALANCE_SCOPES,
    LoadBalance,
    layer_losses,
    load_balancing_loss,
    router_loss,
    router_z_loss,
)
from moe_core.routing import build_router
from moe_core.train import TrainConfig
from tests.finetune_helpers import instruction_records, preference_records, tiny_model, tiny_tokenizer

AUX, Z = 0.05, 0.01


def _switch(**overrides) -> MoEForCausalLM:
    torch.manual_seed(0)
    model = MoEForCausalLM(get_config("switch-tiny", router_jitter=0.0, **overrides))
    for router in model.routers():  # decisive routing: an unbalanced load, so the loss is well above 1
        torch.nn.init.normal_(router.gate.weight, std=0.5)
    return model.train()


# ------------------------------------------------------------------------------------------------ one weighing
def test_switch_sums_the_router_losses_over_layers_in_pretraining():
    model = _switch(router_aux_loss_coef=AUX, router_z_loss_coef=Z)
    assert model.config.router_loss_reduction == "sum"
    L = len(model.routers())
    x = torch.randint(0, model.config.vocab_size, (2, 16))
    out = model(x, labels=x)
    expected = L * (AUX * out.aux_loss + Z * out.z_loss)
    torch.testing.assert_close(out.loss - out.lm_loss, expected)
    torch.testing.assert_close(out.router_loss, router_loss(model.config, out.router_losses))


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def _first_logged(result, key):
    return next(r for r in result.metrics if key in r)


def test_sft_and_dpo_weigh_the_router_losses_as_pretraining_does(tmp_path, tokenizer, one_thread):
    """switch-tiny sums its router losses over the L layers (``router_loss_reduction="sum"``); DPO used to add
    the layer mean, L times less than pretraining and SFT."""
    L = len(get_config("switch-tiny").moe_layer_ids)
    assert L > 1  # else the test could not tell the two weighings apart
    common = {"method": "full", "steps": 1, "batch_size": 4, "export": {"merged": False}}

    sft = finetune(
        FinetuneConfig.build(common),
        tmp_path / "sft",
        model=tiny_model(
            "switch-tiny", num_experts_per_tok=1, router_aux_loss_coef=AUX, router_z_loss_coef=Z
        ),
        tokenizer=tokenizer,
        records=instruction_records(8),
    )
    row = _first_logged(sft, "aux_loss")
    assert row["loss"] == pytest.approx(
        row["lm_loss"] + L * (AUX * row["aux_loss"] + Z * row["z_loss"]), abs=2e-4
    )

    dpo = finetune(
        FinetuneConfig.build({**common, "objective": "dpo"}),
        tmp_path / "dpo",
        model=tiny_model(
            "switch-tiny", num_experts_per_tok=1, router_aux_loss_coef=AUX, router_z_loss_coef=Z
        ),
        tokenizer=tokenizer,
        records=preference_records(8),
    )
    row = _first_logged(dpo, "aux_loss")  # step 1: policy == reference, the DPO term is log 2
    assert row["loss"] == pytest.approx(
        math.log(2) + L * (AUX * row["aux_loss"] + Z * row["z_loss"]), abs=2e-4
    )


# ------------------------------------------------------------------------------------------------ padding
def test_padding_does_not_move_the_fractions_or_the_losses():
    """Right padding leaves the real tokens' routing as it was (causal attention); masked out, the padded
    tokens must not change f_e, P_e or the z-loss."""
    model = _switch(capacity_factor=None)  # dropless: capacity would depend on the padded length
    x = torch.randint(0, model.config.vocab_size, (2, 12))
    plain = model(x[:, :8], labels=x[:, :8])
    mask = torch.zeros(2, 12, dtype=torch.long)
    mask[:, :8] = 1
    padded = model(x, attention_mask=mask, labels=x)
    torch.testing.assert_close(padded.router_losses.aux_L, plain.router_losses.aux_L)
    torch.testing.assert_close(padded.router_losses.z_L, plain.router_losses.z_L)
    unmasked = model(x, labels=x)  # the same padded batch with its padding counted: the losses move
    assert not torch.allclose(unmasked.router_losses.aux_L, plain.router_losses.aux_L)


def test_a_token_mask_equals_dropping_the_tokens():
    config = get_config("mixtral-tiny")
    router = build_router(config).train()
    torch.nn.init.normal_(router.gate.weight, std=0.5)
    x_TD = torch.randn(20, config.hidden_size)
    keep_T = torch.rand(20) > 0.4
    full = router(x_TD)
    kept = router(x_TD[keep_T])
    masked = layer_losses([full], ["loss"], keep_T)
    dropped = layer_losses([kept], ["loss"])
    torch.testing.assert_close(masked.aux_L, dropped.aux_L)
    torch.testing.assert_close(masked.z_L, dropped.z_L)
    torch.testing.assert_close(
        masked.aux_L[0], load_balancing_loss(full.probs_TE, full.expert_ids_TK, None, keep_T)
    )
    torch.testing.assert_close(masked.z_L[0], router_z_loss(kept.logits_TE))


# ------------------------------------------------------------------------------------------------ balancing kinds
def test_each_router_says_how_its_layer_is_balanced():
    x = torch.randint(0, 300, (2, 16))
    for router, requires_grad, zero in (
        ("topk", True, False),
        ("aux_free", False, False),
        ("expert_choice", False, True),
    ):
        torch.manual_seed(0)
        model = MoEForCausalLM(get_config("mixtral-tiny", router=router, vocab_size=300)).train()
        out = model(x, labels=x)
        assert out.router_losses.aux_L.requires_grad == requires_grad, router
        assert bool((out.router_losses.aux_L == 0).all()) == zero, router
        assert out.router_losses.z_L.requires_grad  # the z-loss trains every router


def test_the_record_is_a_fact():
    config = get_config("mixtral-tiny")
    record = build_router(config)(torch.randn(6, config.hidden_size))
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.weights_TK = record.weights_TK * 2
    assert not hasattr(record, "aux_loss") and not hasattr(record, "z_loss")


# ------------------------------------------------------------------------------------------------ scope
def test_one_scope_setting_and_old_configs_keep_their_meaning():
    field = TrainConfig.model_fields["balance_scope"].annotation
    assert typing.get_args(field) == BALANCE_SCOPES  # the config offers exactly what the losses implement
    assert TrainConfig.build({}).balance_scope == "data_parallel"
    assert "global_aux_loss" not in TrainConfig.build({}).parallel.model_dump()
    saved = TrainConfig.build({}).model_dump()
    for all_ranks, scope, expected in (
        (True, "micro_batch", "data_parallel"),
        (False, "micro_batch", "micro_batch"),
        (True, "global_batch", "global_batch"),
    ):
        old = {
            **saved,
            "balance_scope": scope,
            "parallel": {**saved["parallel"], "global_aux_loss": all_ranks},
        }
        assert TrainConfig.build(old).balance_scope == expected


def test_global_batch_accumulates_over_micro_batches_and_micro_batch_does_not():
    model = _switch(capacity_factor=None)
    x = torch.randint(0, model.config.vocab_size, (2, 24))
    whole = model(x, labels=x, output_routing=True)
    model.load_balance = LoadBalance("global_batch")
    model.load_balance.reset()
    model(x[:1], labels=x[:1])
    second = model(x[1:], labels=x[1:], output_routing=True)
    # the second micro-batch's f is the whole batch's, its P its own
    E = model.config.num_experts
    for layer, (r_whole, r2) in enumerate(zip(whole.routing, second.routing, strict=True)):
        counts_E = torch.bincount(r_whole.expert_ids_TK.flatten(), minlength=E).double()
        expected = load_balancing_loss(r2.probs_TE, r2.expert_ids_TK, counts_E / counts_E.sum())
        torch.testing.assert_close(second.router_losses.aux_L[layer], expected)
    model.load_balance = LoadBalance("micro_batch")
    alone = model(x[1:], labels=x[1:], output_routing=True)
    for layer, r in enumerate(alone.routing):
        torch.testing.assert_close(
            alone.router_losses.aux_L[layer], load_balancing_loss(r.probs_TE, r.expert_ids_TK)
        )
