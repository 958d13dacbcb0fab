"""Continued pretraining from an MoE checkpoint (`moe_core.init_from`, ``model.init_from=DIR``): a tiny random HF
Mixtral and a model directory of ours start the trainer's model with exactly their weights (the HF one computes
HF's logits), a rank at ep_size=2 holds only its experts, the checkpoint's router biases come along, and
overrides that would change the architecture are refused before any weight is read."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM

from moe_core.convert import from_hf
from moe_core.init_from import InitFromError, initial_config, load_initial
from moe_core.train import parallel as par
from moe_core.train.build import build_meta_model, materialize_owned
from moe_core.train.checkpoint import gather_state_dict
from moe_core.train.config import TrainConfig, TrainConfigError
from moe_core.train.loop import Trainer
from tests.dist_helpers import run_reshard_worker

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=64,
)


def write_mixtral(path) -> MixtralForCausalLM:
    torch.manual_seed(0)
    hf = MixtralForCausalLM(MixtralConfig(**TINY)).eval()
    hf.save_pretrained(path)
    return hf


def started(path, world: int = 1, rank: int = 0, ep: int = 1, overrides=None):
    """Rank ``rank``'s model of a ``world``-process layout, as the trainer builds and starts it."""
    config = initial_config(path, overrides)
    state = par.ParallelState(world, rank, rank, ep, world // ep, rank % ep, rank // ep)
    model = par.apply_expert_parallel(build_meta_model(config), state)
    return load_initial(materialize_owned(model, torch.device("cpu"), seed=3), path)


def assert_same_state(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    different = [name for name in got if not torch.equal(got[name], expected[name])]
    assert not different, different[:5]


def test_a_hf_mixtral_starts_with_its_weights_and_logits(tmp_path):
    hf = write_mixtral(tmp_path)
    model = started(tmp_path).eval()
    assert_same_state(model.state_dict(), from_hf(tmp_path).state_dict())
    ids = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, atol=1e-5, rtol=0)


def test_a_rank_at_ep2_holds_only_its_experts(tmp_path):
    write_mixtral(tmp_path)
    whole = from_hf(tmp_path)
    model = started(tmp_path, world=2, rank=1, ep=2)
    shard = model.model.layers[0].mlp.experts
    assert shard.first_expert == 2 and shard.local.up_proj.shape[0] == 2
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert torch.equal(getattr(shard.local, name), getattr(whole.model.layers[0].mlp.experts, name)[2:4])
    assert torch.equal(
        model.model.layers[0].self_attn.q_proj.weight, whole.model.layers[0].self_attn.q_proj.weight
    )


def test_a_model_of_ours_starts_with_its_weights_and_router_biases(tmp_path):
    write_mixtral(tmp_path / "hf")
    ours = from_hf(tmp_path / "hf")
    ours.config.router = "aux_free"  # a router with a persistent bias buffer
    ours = type(ours)(ours.config)
    with torch.no_grad():
        for buffer in ours.buffers():
            if buffer.dtype.is_floating_point:
                buffer.uniform_(-1, 1)  # (inv_freq is recomputed, not stored)
    ours.save_pretrained(tmp_path / "ours")
    model = started(tmp_path / "ours", overrides={"router_aux_loss_coef": 0.05})
    assert model.config.router_aux_loss_coef == 0.05
    biases = [n for n in model.state_dict() if n.endswith("expert_bias")]
    assert biases and all(torch.equal(model.state_dict()[n], ours.state_dict()[n]) for n in biases)
    assert_same_state(model.state_dict(), ours.state_dict())


def test_overrides_that_change_the_architecture_are_refused(tmp_path):
    write_mixtral(tmp_path)
    with pytest.raises(InitFromError, match=r"model.overrides.num_experts=8"):
        initial_config(tmp_path, {"num_experts": 8})
    config = initial_config(tmp_path, {"num_experts": 4, "capacity_factor": 1.5})  # same, or a training field
    assert config.capacity_factor == 1.5
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(InitFromError, match="upcycle_from"):
        initial_config(tmp_path)


def test_the_trainer_starts_from_the_checkpoint_and_trains(tmp_path):
    write_mixtral(tmp_path / "hf")
    config = TrainConfig.build(
        {
            "model": {"preset": "switch-tiny", "init_from": str(tmp_path / "hf")},
            "data": {"source": "synthetic", "seq_len": 16, "synthetic_blocks": 32},
            "checkpoint": {"export": False, "every": 1000},
            "log": {"progress": "off"},
            "steps": 2,
            "batch_size": 4,
        }
    )
    trainer = Trainer(config, tmp_path / "run")
    try:
        expected = from_hf(tmp_path / "hf").state_dict()
        assert_same_state({k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, expected)
        trainer.run()
        assert not torch.equal(
            trainer.model.model.layers[0].mlp.experts.up_proj, expected["model.layers.0.mlp.experts.up_proj"]
        )
    finally:
        trainer.close()
    with pytest.raises(TrainConfigError, match="exclude each other"):
        Trainer(config.with_overrides([f"model.upcycle_from={tmp_path / 'hf'}"]), tmp_path / "both")


def test_a_training_step_checkpoint_starts_a_new_run_with_its_weights(tmp_path):
    write_mixtral(tmp_path / "hf")
    base = {
        "model": {"init_from": str(tmp_path / "hf")},
        "data": {"source": "synthetic", "seq_len": 16, "synthetic_blocks": 32},
        "checkpoint": {"export": False, "every": 1},
        "log": {"progress": "off"},
        "steps": 1,
        "batch_size": 4,
    }
    first = Trainer(TrainConfig.build(base), tmp_path / "first")
    try:
        first.run()
    finally:
        first.close()
    step = tmp_path / "first" / "checkpoints" / "step_00000001"
    second = Trainer(TrainConfig.build({**base, "model": {"init_from": str(step)}}), tmp_path / "second")
    try:
        assert second.step == 0
        assert_same_state(dict(second.model.state_dict()), gather_state_dict(step))
    finally:
        second.close()


@pytest.mark.slow
def test_two_processes_at_ep2_start_as_the_checkpoint(tmp_path):
    write_mixtral(tmp_path / "hf")
    sets = ("--set", f"model.init_from={tmp_path / 'hf'}", "--set", "parallel.ep_size=2")
    run_reshard_worker(2, "--fresh", str(tmp_path / "run"), *sets)
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000000"
    assert (ckpt / "experts-ep1-of-2.safetensors").is_file()
    assert_same_state(gather_state_dict(ckpt), from_hf(tmp_path / "hf").state_dict())
