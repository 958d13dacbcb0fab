"""Pruning a router whose top-k weights are raw softmax probabilities (OLMoE): the dropped experts' softmax
mass stays in the pruned router's denominator, so every kept expert keeps the weight it was trained with; and
with ``pruned_choices="drop"`` a token's choice of a dropped expert leaves its slot empty."""

from __future__ import annotations

import json

import pytest
import torch

from moe_core import MoEConfig, MoEForCausalLM, get_config, load
from moe_core.cli import main
from moe_core.convert import get_architecture, refusals_to_hf
from moe_core.data.prepare import PrepareConfig, prepare
from moe_core.finetune.methods import TaskRouterBias
from moe_core.inference.prune import (
    PruneConfig,
    PruneError,
    collect_usage,
    prune_checkpoint,
    prune_experts,
)
from tests.helpers import randomize_
from tests.helpers import token_ids as ids

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def olmoe_tiny(**overrides) -> MoEForCausalLM:
    model = MoEForCausalLM(get_config("olmoe-tiny", vocab_size=128, **overrides)).eval()
    randomize_(model)
    return model


def usage_of(model) -> dict[int, torch.Tensor]:
    return collect_usage(model, [ids(4, 16, seed=s) for s in range(2)])


@torch.no_grad()
def assert_kept_weights_unchanged(full, pruned, kept: dict[int, list[int]]) -> None:
    """Each pruned router picks the K most probable kept experts and weights them by the probability the
    unpruned router gave them (not renormalized over the kept experts)."""
    K = full.config.num_experts_per_tok
    x_TD = torch.randn(64, full.config.hidden_size, generator=torch.Generator().manual_seed(3))
    for layer_id, ids_kept in kept.items():
        probs_TE = full.model.layers[layer_id].mlp.router(x_TD).probs_TE
        expected_TK, order_TK = probs_TE[:, ids_kept].topk(K, dim=-1)
        record = pruned.model.layers[layer_id].mlp.router(x_TD)
        weights_TK, slot_order_TK = record.weights_TK.sort(dim=-1, descending=True)
        torch.testing.assert_close(record.expert_ids_TK.gather(-1, slot_order_TK), order_TK)
        torch.testing.assert_close(weights_TK, expected_TK, rtol=1e-5, atol=1e-7)


def test_pruned_olmoe_router_keeps_each_kept_experts_weight_and_renormalize_does_not():
    model = olmoe_tiny()
    assert model.config.norm_topk_prob is False
    pruned, report = prune_experts(model, usage_of(model), PruneConfig(keep_experts=16))
    assert pruned.config.router_pruned_experts == 48 and report.router_pruned_experts == 48
    assert_kept_weights_unchanged(model, pruned, report.kept)

    renormalized, report = prune_experts(
        model, usage_of(model), PruneConfig(keep_experts=16, renormalize=True)
    )
    assert renormalized.config.router_pruned_experts == 0
    with pytest.raises(AssertionError):  # the kept experts' weights grow by the dropped mass
        assert_kept_weights_unchanged(model, renormalized, report.kept)


def test_dropping_never_routed_experts_leaves_an_olmoe_model_unchanged():
    model = olmoe_tiny()
    with torch.no_grad():  # of each pair (v, -v) among experts 0..15 one logit is above 0, so 8 = K experts
        for router in model.routers():  # always beat experts 48..63, whose logit is 0: they are never picked
            w = router.gate.weight
            w[1:16:2] = -w[0:16:2]
            w[48:] = 0.0
    usage = usage_of(model)
    assert all(int(u[48:].sum()) == 0 for u in usage.values())
    x = ids(2, 16, seed=5)
    with torch.no_grad():
        reference = model(x).logits
        kept_mass, _ = prune_experts(model, usage, PruneConfig())  # min_share 0: drop the never used
        assert kept_mass.config.num_experts == 48
        torch.testing.assert_close(kept_mass(x).logits, reference, atol=1e-5, rtol=1e-5)
        renormalized, _ = prune_experts(model, usage, PruneConfig(renormalize=True))
        assert (renormalized(x).logits - reference).abs().max() > 1e-3  # their mass of exp(0) each is gone


def test_pruning_twice_keeps_the_rows_of_both_prunings_and_the_checkpoint_round_trips(tmp_path):
    model = olmoe_tiny()
    model.save_pretrained(tmp_path / "full")
    calibration = [ids(4, 16, seed=s) for s in range(2)]
    prune_checkpoint(tmp_path / "full", None, tmp_path / "p32", PruneConfig(keep_experts=32), calibration)
    report = prune_checkpoint(
        tmp_path / "p32", None, tmp_path / "p16", PruneConfig(keep_experts=16), calibration
    )
    loaded = load(tmp_path / "p16")
    assert loaded.kind == "pruned" and loaded.config.num_experts == 16
    assert loaded.config.router_pruned_experts == 48
    assert json.loads((tmp_path / "p16" / "pruning.json").read_text())["router_pruned_experts"] == 48
    first = json.loads((tmp_path / "p32" / "pruning.json").read_text())["kept"]
    kept = {layer: [first[str(layer)][i] for i in ids16] for layer, ids16 in report.kept.items()}
    assert_kept_weights_unchanged(model, loaded.model, kept)  # against the ORIGINAL 64-expert router


def test_renormalized_pruning_converts_to_hf_and_kept_mass_is_refused_with_the_way_out():
    model = olmoe_tiny()
    olmoe = get_architecture("olmoe")
    assert refusals_to_hf(model.config, olmoe) == []
    kept_mass, _ = prune_experts(model, usage_of(model), PruneConfig(keep_experts=32))
    reasons = refusals_to_hf(kept_mass.config, olmoe)
    assert len(reasons) == 1 and "router_pruned_experts=32" in reasons[0] and "--renormalize" in reasons[0]
    renormalized, _ = prune_experts(model, usage_of(model), PruneConfig(keep_experts=32, renormalize=True))
    assert refusals_to_hf(renormalized.config, olmoe) == []


def test_renormalizing_routers_get_no_denominator_rows_and_the_config_refuses_them():
    mixtral = MoEForCausalLM(get_config("mixtral-tiny", vocab_size=128)).eval()
    pruned, report = prune_experts(mixtral, usage_of(mixtral), PruneConfig(keep_experts=4))
    assert pruned.config.router_pruned_experts == 0 and report.router_pruned_experts == 0
    with pytest.raises(ValueError, match="router_pruned_experts"):
        MoEConfig(**{**get_config("mixtral-tiny").to_dict(), "router_pruned_experts": 2})


def test_dropping_pruned_choices_equals_the_unpruned_model_with_those_experts_silenced():
    model = olmoe_tiny()
    usage = usage_of(model)
    pruned, report = prune_experts(model, usage, PruneConfig(keep_experts=16, pruned_choices="drop"))
    assert pruned.config.router_pruned_choices == "drop"
    refilled, _ = prune_experts(model, usage, PruneConfig(keep_experts=16))
    silenced = olmoe_tiny()
    with torch.no_grad():  # the unpruned routing, the dropped experts' outputs zero
        for layer_id, kept in report.kept.items():
            down = silenced.model.layers[layer_id].mlp.experts.down_proj
            down[[e for e in range(64) if e not in kept]] = 0.0
        x = ids(2, 16, seed=9)
        reference = silenced(x).logits
        torch.testing.assert_close(pruned(x).logits, reference, atol=1e-5, rtol=1e-5)
        assert (refilled(x).logits - reference).abs().max() > 1e-3  # refilled slots add other experts
        record = pruned(x, output_routing=True).routing[0]
        assert int(record.dropped_TK.sum()) > 0  # the check above saw empty slots
        assert int(record.tokens_per_expert_E.sum()) == int((~record.dropped_TK).sum())


def test_dropping_pruned_choices_is_refused_where_it_cannot_be_exact():
    with pytest.raises(PruneError, match="renormalize"):
        PruneConfig(pruned_choices="drop", renormalize=True)
    for overrides in ({"router": "aux_free"}, {"capacity_factor": 2.0}):
        model = olmoe_tiny(**overrides)
        with pytest.raises(PruneError, match="router_pruned_choices"):
            prune_experts(model, usage_of(model), PruneConfig(keep_experts=16, pruned_choices="drop"))


@pytest.mark.parametrize("choices", ["refill", "drop"])
def test_task_router_bias_on_a_pruned_router_keeps_the_pruned_mass(choices):
    model = olmoe_tiny()
    pruned, report = prune_experts(
        model, usage_of(model), PruneConfig(keep_experts=16, pruned_choices=choices)
    )
    x = ids(2, 16, seed=7)
    with torch.no_grad():
        reference = pruned(x).logits
        bias = TaskRouterBias(pruned.config.moe_layer_ids, ["a"], 16).attach(pruned)
        with bias.tasks(torch.zeros(2, dtype=torch.long)):  # a zero bias: the very same routing
            torch.testing.assert_close(pruned(x).logits, reference, atol=1e-5, rtol=1e-5)


def test_cli_prune_keeps_the_mass_unless_told_to_renormalize_and_drops_choices_when_told(tmp_path):
    model = MoEForCausalLM(get_config("olmoe-tiny", vocab_size=300))
    model.save_pretrained(tmp_path / "model")
    data = prepare(
        PrepareConfig(max_documents=12, vocab_size=300, seq_len=32, num_proc=1, validate=False),
        tmp_path / "data",
    )
    common = ["prune", str(tmp_path / "model"), "--keep", "32", "--data", str(data), "--calib-batches", "2"]
    assert main([*common, "--out", str(tmp_path / "mass")]) == 0
    assert main([*common, "--renormalize", "--out", str(tmp_path / "renorm")]) == 0
    assert main([*common, "--pruned-choices", "drop", "--out", str(tmp_path / "drop")]) == 0
    assert load(tmp_path / "mass").config.router_pruned_experts == 32
    assert load(tmp_path / "renorm").config.router_pruned_experts == 0
    assert load(tmp_path / "drop").config.router_pruned_choices == "drop"
