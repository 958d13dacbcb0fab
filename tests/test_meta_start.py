"""The meta-device start (`moe_core.train.build`), in this process: each rank's materialized slice equals the
one-process weights bitwise (ranks of 1, 2 and 4 process layouts, laid out here without a process group), the
initial values follow the model's own rules, and the dry run counts what each rank owns of a Mixtral-8x7B-sized
model without allocating it. The multi-process checks (real groups, FSDP2, measured allocation) are in
tests/test_checkpoint_reshard.py."""

from __future__ import annotations

import math
import resource

import pytest
import torch

from moe_core.cli import main
from moe_core.model import MoEForCausalLM
from moe_core.train import parallel as par
from moe_core.train.build import build_meta_model, materialize_owned, rank_parameter_bytes
from moe_core.train.config import TrainConfig

pytestmark = pytest.mark.usefixtures("one_thread")

# Mixtral-8x7B (Jiang et al. 2024): 32 layers, hidden 4096, 32 heads / 8 KV heads, 8 experts of width 14336,
# 32k vocabulary, untied embeddings: 46.7 B parameters
MIXTRAL_8X7B = [
    "model.overrides.hidden_size=4096",
    "model.overrides.num_hidden_layers=32",
    "model.overrides.num_attention_heads=32",
    "model.overrides.num_key_value_heads=8",
    "model.overrides.expert_intermediate_size=14336",
    "model.overrides.vocab_size=32000",
]


def rank_model(model_config, world: int, rank: int, ep: int, seed: int = 7):
    """Rank ``rank``'s model of a ``world``-process layout with ``ep_size=ep``, as the trainer builds it."""
    state = par.ParallelState(world, rank, rank, ep, world // ep, rank % ep, rank // ep)
    model = par.apply_expert_parallel(build_meta_model(model_config), state)
    return materialize_owned(model, torch.device("cpu"), seed)


@pytest.mark.parametrize("preset", ["mixtral-tiny", "shared-tiny"])
def test_each_rank_materializes_exactly_its_slice_of_the_one_process_weights(preset):
    model_config = TrainConfig.from_preset(preset).model.build_config()
    whole = rank_model(model_config, 1, 0, 1).state_dict()
    for world, ep in ((2, 2), (2, 1), (4, 2), (4, 4)):
        for rank in range(world):
            model = rank_model(model_config, world, rank, ep)
            assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
            for name, tensor in model.state_dict().items():
                full_name = par.full_model_name(name)
                if full_name != name:  # an expert shard: global experts first .. first + n - 1
                    n = tensor.shape[0]
                    expected = whole[full_name][(rank % ep) * n : (rank % ep + 1) * n]
                else:
                    expected = whole[name]
                assert torch.equal(tensor, expected), (world, ep, rank, name)
    assert not torch.equal(whole["lm_head.weight"], rank_model(model_config, 1, 0, 1, seed=8).lm_head.weight)


def test_initial_values_follow_the_models_own_rules():
    """Against the classic full build (`MoEForCausalLM` on the host): the same buffers, the same distributions."""
    model_config = TrainConfig.from_preset("mixtral-tiny").model.build_config()
    torch.manual_seed(0)
    classic = MoEForCausalLM(model_config)
    ours = rank_model(model_config, 1, 0, 1)
    for (name, a), (_, b) in zip(classic.named_buffers(), ours.named_buffers(), strict=True):
        assert torch.equal(a, b), name
    ours_params = dict(ours.named_parameters())
    for name, a in classic.named_parameters():
        b = ours_params[name]
        assert a.shape == b.shape, name
        if name.endswith("norm.weight"):
            assert torch.equal(b, torch.ones_like(b)), name
        else:
            assert b.std().item() == pytest.approx(a.std().item(), rel=0.15), name
    gate = ours.model.layers[0].mlp.router.gate.weight  # Switch's truncated normal: within 2 std
    assert gate.abs().max() <= 2 * math.sqrt(0.1 / gate.shape[1])


def test_the_dry_run_counts_what_each_rank_owns_of_mixtral_8x7b_and_allocates_nothing(capsys):
    config = TrainConfig.from_preset("mixtral-tiny").with_overrides(MIXTRAL_8X7B + ["parallel.ep_size=2"])
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rows = rank_parameter_bytes(config.model.build_config(), world_size=2, ep_size=2)
    expert_bytes = 32 * 8 * 3 * 14336 * 4096 * 4  # layers x experts x (gate, up, down) x fp32
    assert rows[0]["whole_model"] / 4 == pytest.approx(46.7e9, rel=0.01)
    for rank, row in enumerate(rows):
        assert row["ep_rank"] == rank and row["expert_params"] == expert_bytes // 2
        assert row["dense_params"] == row["whole_model"] - expert_bytes
        assert row["optimizer"] == 2 * row["params"]
    (alone,) = rank_parameter_bytes(config.model.build_config(), world_size=1, ep_size=1)
    assert alone["expert_params"] == expert_bytes and alone["whole_model"] == rows[0]["whole_model"]
    sharded = rank_parameter_bytes(config.model.build_config(), world_size=2, ep_size=2, dp_mode="fsdp2")
    assert sum(r["dense_params"] for r in sharded) == rows[0]["dense_params"]
    sets = [a for s in MIXTRAL_8X7B for a in ("--set", s)]
    args = ["train", "--dry-run", "--out", "unused", "--preset", "mixtral-tiny", "--nproc", "2", *sets]
    assert main([*args, "--set", "parallel.ep_size=2"]) == 0
    out = capsys.readouterr().out
    assert "nothing allocated" in out and f" {rows[1]['params']}\n" in out + "\n"
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before
    assert grown_kib < 512 * 1024  # 187 GB of weights counted, not allocated


def test_a_layout_that_cannot_split_the_experts_is_refused_before_anything_is_built(capsys):
    model_config = TrainConfig.from_preset("mixtral-tiny").model.build_config()  # 8 experts
    with pytest.raises(par.ParallelError, match="ep_size=3 must divide"):
        rank_parameter_bytes(model_config, world_size=6, ep_size=3)
    args = ["train", "--dry-run", "--out", "unused", "--preset", "mixtral-tiny", "--nproc", "4"]
    assert main([*args, "--set", "parallel.ep_size=3"]) != 0
    assert "ep_size=3 must divide the world size 4" in capsys.readouterr().err
