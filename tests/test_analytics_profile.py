"""Router profile: every number checked against values computed by hand on a 4-token batch whose routing
is fixed by the test (a registered router that returns the test's plan, whatever the hidden states)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from moe_core import MoEForCausalLM, get_config
from moe_core.analytics import stats
from moe_core.analytics.profile import (
    PROFILE_VERSION,
    ProfileCollector,
    ProfileConfig,
    ProfileError,
    RouterProfile,
    collect_profile,
)
from moe_core.routing import Router, register_router


@register_router("test_fixed_plan")
class FixedPlanRouter(Router):
    """Routes by the test's plan for its layer: (expert_ids_TK, probs_TE, dropped_TK)."""

    plans: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    plan_index = 0

    def route(self, logits_TE):
        ids_TK, probs_TE, dropped_TK = self.plans[self.plan_index]
        weights_TK = probs_TE.gather(1, ids_TK)
        return self.record(probs_TE.clamp_min(1e-9).log(), probs_TE, ids_TK, weights_TK, dropped_TK)


F_, T_ = False, True
# layer A: token 2's second slot is dropped; slot 0 always has the larger weight
IDS_A = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])
DROP_A = torch.tensor([[F_, F_], [F_, F_], [F_, T_], [F_, F_]])
PROBS_A = torch.tensor(
    [[0.5, 0.25, 0.25, 0.0], [0.7, 0.0, 0.3, 0.0], [1.0, 0.0, 0.0, 0.0], [0.2, 0.1, 0.1, 0.6]]
)
IDS_B = torch.tensor([[1, 0], [1, 2], [2, 3], [3, 1]])
DROP_B = torch.zeros(4, 2, dtype=torch.bool)
PROBS_B = torch.tensor(
    [[0.3, 0.4, 0.2, 0.1], [0.1, 0.5, 0.3, 0.1], [0.1, 0.1, 0.5, 0.3], [0.1, 0.3, 0.1, 0.5]]
)
TOKENS = torch.tensor([[5, 6, 7, 5]])
DOMAINS = torch.tensor([[0, 0, 1, 1]])
CLASSES_V = torch.zeros(512, dtype=torch.long)
CLASSES_V[6] = CLASSES_V[7] = 1


def fixed_model() -> MoEForCausalLM:
    torch.manual_seed(0)
    model = MoEForCausalLM(
        get_config("mixtral-tiny", num_experts=4, num_experts_per_tok=2, router="test_fixed_plan")
    )
    for i, router in enumerate(model.routers()):
        router.plan_index = i
    FixedPlanRouter.plans = {0: (IDS_A, PROBS_A, DROP_A), 1: (IDS_B, PROBS_B, DROP_B)}
    return model


@pytest.fixture(scope="module")
def profile() -> RouterProfile:
    return collect_profile(
        fixed_model(),
        [(TOKENS, DOMAINS)],
        ProfileConfig(top_tokens=3, rare_fraction=0.6),
        token_classes_V=CLASSES_V,
        class_names=("c0", "c1"),
        domain_names=("code", "prose"),
        dataset_labels={"split": "hand"},
    )


def h(*p: float) -> float:  # entropy in nats of one router distribution
    return -sum(x * math.log(x) for x in p if x > 0)


def test_counts_balance_and_drops(profile):
    a, b = profile.layers
    assert (a.layer_id, b.layer_id) == (0, 1)
    assert a.kept_E.tolist() == [4, 1, 1, 1]  # 8 slots, 1 dropped
    assert a.routed_E.tolist() == [4, 2, 1, 1]
    assert b.kept_E.tolist() == [1, 3, 2, 2]
    assert a.kept_E.sum() + a.dropped_slots == a.tokens * 2
    assert (a.dropped_slots, a.dropped_tokens, a.drop_rate) == (1, 0, 1 / 8)
    mean = 7 / 4
    assert a.cv == pytest.approx(math.sqrt(((4 - mean) ** 2 + 3 * (1 - mean) ** 2) / 4) / mean)
    assert a.max_over_mean == pytest.approx(4 / mean)
    assert b.cv == pytest.approx(math.sqrt(((1 - 2) ** 2 + (3 - 2) ** 2) / 4) / 2)
    assert a.dead_experts() == []
    assert a.rare_experts(0.6) == [1, 2, 3]  # 1 < 0.6 * 1.75
    assert b.rare_experts(0.6) == [0]  # 1 < 0.6 * 2 ... and 2 is not


def test_entropy_and_confidence(profile):
    a, b = profile.layers
    assert a.entropy == pytest.approx((h(0.5, 0.25, 0.25) + h(0.7, 0.3) + 0.0 + h(0.2, 0.1, 0.1, 0.6)) / 4)
    assert a.normalized_entropy == pytest.approx(a.entropy / math.log(4))
    assert a.confidence == pytest.approx((0.5 + 0.7 + 1.0 + 0.6) / 4)
    assert b.confidence == pytest.approx((0.4 + 0.5 + 0.5 + 0.5) / 4)


def test_coactivation_uses_kept_slots(profile):
    expected = np.zeros((4, 4), dtype=np.int64)
    np.fill_diagonal(expected, [4, 1, 1, 1])
    for i, j in [(0, 1), (0, 2), (0, 3)]:  # token 2's (0, 1) pair is gone with its dropped slot
        expected[i, j] = expected[j, i] = 1
    assert profile.layers[0].coactivation_EE.tolist() == expected.tolist()


def test_flow_between_layers(profile):
    (flow,) = profile.flows
    assert (flow.from_layer, flow.to_layer) == (0, 1)
    top1 = np.zeros((4, 4), dtype=np.int64)
    top1[0, 1], top1[0, 2], top1[3, 3] = 2, 1, 1  # primaries A: 0 0 0 3 -> B: 1 1 2 3
    assert flow.top1_EF.tolist() == top1.tolist()
    pairs = np.zeros((4, 4), dtype=np.int64)
    kept_a, kept_b = [{0, 1}, {0, 2}, {0}, {3, 0}], [{1, 0}, {1, 2}, {2, 3}, {3, 1}]
    for sa, sb in zip(kept_a, kept_b):
        for i in sa:
            for j in sb:
                pairs[i, j] += 1
    assert flow.pairs_EF.tolist() == pairs.tolist()
    assert flow.pairs_EF.sum() == 14


def test_specialization_tables_and_mutual_information(profile):
    a = profile.layers[0]
    # kept slots: t0 (class 0, code): e0 e1; t1 (c1, code): e0 e2; t2 (c1, prose): e0; t3 (c0, prose): e3 e0
    assert a.class_counts_EC.tolist() == [[2, 2], [1, 0], [0, 1], [1, 0]]
    assert a.domain_counts_EM.tolist() == [[2, 2], [1, 0], [1, 0], [0, 1]]
    n, pe, pc = 7, [4 / 7, 1 / 7, 1 / 7, 1 / 7], [4 / 7, 3 / 7]
    mi = sum(
        c / n * math.log2(c / n / (pe[e] * pc[k]))
        for e, row in enumerate(a.class_counts_EC.tolist())
        for k, c in enumerate(row)
        if c
    )
    assert a.mi_class_bits == pytest.approx(mi)
    assert a.mi_class_bits == pytest.approx(0.4138, abs=1e-4)  # -0.0550 + 0.0635 + 2 * 0.1153 + 0.1746


def test_top_tokens_per_expert(profile):
    a = profile.layers[0]
    assert [(t.token_id, t.count) for t in a.top_tokens[0]] == [(5, 2), (6, 1), (7, 1)]
    assert [(t.token_id, t.count) for t in a.top_tokens[3]] == [(5, 1)]
    assert a.top_tokens[0][0].token is None  # no tokenizer given


def test_statistics_by_hand():
    assert stats.mutual_information_bits([[2, 0], [0, 2]]) == pytest.approx(1.0)  # expert = class
    assert stats.mutual_information_bits([[1, 1], [1, 1]]) == pytest.approx(0.0)  # independent
    assert stats.entropy_bits([1, 1, 1, 1]) == pytest.approx(2.0)
    assert stats.coefficient_of_variation([2, 2, 2]) == 0.0
    assert stats.max_over_mean([3, 1, 0, 0]) == pytest.approx(3.0)
    assert stats.dead_experts([3, 0, 1, 0]) == [1, 3]


def test_accumulates_over_batches_and_fingerprints_data(profile):
    twice = collect_profile(
        fixed_model(), [TOKENS, TOKENS], token_classes_V=CLASSES_V, class_names=("c0", "c1")
    )
    assert twice.layers[0].kept_E.tolist() == [8, 2, 2, 2]
    assert twice.layers[0].coactivation_EE[0, 0] == 8
    assert twice.flows[0].top1_EF[0, 1] == 4
    assert twice.dataset["tokens"] == 8 and twice.dataset["sequences"] == 2
    assert twice.dataset["fingerprint"] != profile.dataset["fingerprint"]
    assert profile.dataset["split"] == "hand" and profile.model["moe_layer_ids"] == [0, 1]


def test_round_trip_through_files(profile, tmp_path):
    path = profile.to_dir(tmp_path / "profile")
    loaded = RouterProfile.from_dir(path)
    assert loaded == profile
    assert loaded.layers[0].mi_class_bits == profile.layers[0].mi_class_bits
    loaded.layers[1].kept_E[0] += 1  # equality looks at the counts
    assert loaded != profile
    profile.to_dir(path)  # rewriting replaces it in place, leaving no temporary directory
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profile"]
    assert RouterProfile.from_dir(path) == profile


def test_unreadable_profiles_are_reported(profile, tmp_path):
    path = profile.to_dir(tmp_path / "p")
    (path / "profile.json").write_text(
        (path / "profile.json")
        .read_text()
        .replace(f'"version": {PROFILE_VERSION}', f'"version": {PROFILE_VERSION + 1}', 1)
    )
    with pytest.raises(ProfileError, match="version"):
        RouterProfile.from_dir(path)
    with pytest.raises(ProfileError, match="missing"):
        RouterProfile.from_dir(tmp_path)


def test_record_count_must_match_layers():
    collector = ProfileCollector(fixed_model().config)
    with pytest.raises(ProfileError, match="2 MoE layers"):
        collector.update(TOKENS, [])
    with pytest.raises(ValueError, match="rare_fraction"):
        ProfileConfig(rare_fraction=2.0)


def test_profiling_does_not_move_router_state():
    torch.manual_seed(0)
    model = MoEForCausalLM(get_config("mixtral-tiny", router="aux_free", router_bias_update_rate=0.1))
    model.train()
    before = [(r.expert_bias.clone(), r.pending_load.clone()) for r in model.routers()]
    collect_profile(model, [torch.randint(0, 512, (2, 8))])
    assert model.training
    for (bias, load), router in zip(before, model.routers()):
        assert torch.equal(bias, router.expert_bias) and torch.equal(load, router.pending_load)
