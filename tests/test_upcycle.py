"""Sparse upcycling (`moe_core.upcycle`) from a tiny random dense Llama written by transformers: with identical
experts and renormalized top-k weights the MoE computes the dense model's logits at step 0; training moves the
experts apart; fine-grained experts are slices of the dense FFN; a rank holding experts 2..3 reads only those; a
dense config the lab cannot express is refused, naming the field, before any weight is read."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from moe_core.data.tokenizer import load_tokenizer, train_tokenizer
from moe_core.init_from import InitFromError
from moe_core.train import parallel as par
from moe_core.train.build import build_meta_model, materialize_owned
from moe_core.train.checkpoint import gather_state_dict
from moe_core.train.config import TrainConfig
from moe_core.train.loop import Trainer
from moe_core.upcycle import UpcycleError, load_upcycled, upcycle, upcycled_config
from tests.dist_helpers import run_reshard_worker

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rope_theta=5000.0,
    rms_norm_eps=1e-5,
)
# dropless softmax top-k with renormalized weights: identical experts then sum to the dense FFN
MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    router="topk",
    norm_topk_prob=True,
    capacity_factor=None,
    eval_capacity_factor=None,
)


def write_dense(path, cls=LlamaForCausalLM, config_cls=LlamaConfig, **fields):
    torch.manual_seed(0)
    dense = cls(config_cls(**{**TINY, **fields})).eval()
    with torch.no_grad():  # RMSNorm weights start at one: make them matter
        for name, param in dense.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    dense.save_pretrained(path)
    return dense


@pytest.mark.parametrize(
    ("cls", "config_cls", "fields"),
    [
        (LlamaForCausalLM, LlamaConfig, {}),
        (LlamaForCausalLM, LlamaConfig, {"tie_word_embeddings": True}),
        (Qwen2ForCausalLM, Qwen2Config, {}),  # q/k/v biases
        (MistralForCausalLM, MistralConfig, {"sliding_window": 64}),  # a window as long as the context
    ],
)
def test_step_zero_logits_equal_the_dense_model(tmp_path, cls, config_cls, fields):
    dense = write_dense(tmp_path, cls, config_cls, **fields)
    moe = upcycle(tmp_path, "switch-tiny", **MOE).eval()
    assert moe.config.num_experts == 4 and moe.config.hidden_size == 32
    assert (moe.config.bos_token_id, moe.config.eos_token_id) == (
        dense.config.bos_token_id,
        dense.config.eos_token_id,
    )
    stack = moe.model.layers[1].mlp.experts.up_proj
    assert torch.equal(stack[0], dense.model.layers[1].mlp.up_proj.weight)
    assert all(torch.equal(stack[0], stack[e]) for e in range(4))
    ids = torch.randint(0, TINY["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = dense(ids).logits
        got = moe(ids).logits
        # the router is new, small and random: it routes, and the routing does not change the output
        assert moe.model.layers[0].mlp.router.gate.weight.abs().max() > 0
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_without_renormalized_weights_the_logits_differ(tmp_path):
    """The equality above is the renormalization's doing, not a model that ignores its experts."""
    dense = write_dense(tmp_path)
    moe = upcycle(tmp_path, "switch-tiny", **{**MOE, "norm_topk_prob": False}).eval()
    ids = torch.randint(0, TINY["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert not torch.allclose(moe(ids).logits, dense(ids).logits, atol=1e-3)


def test_fine_grained_experts_are_slices_of_the_dense_ffn(tmp_path):
    dense = write_dense(tmp_path)
    moe = upcycle(tmp_path, "switch-tiny", **{**MOE, "expert_intermediate_size": 32})  # m = 64 / 32 = 2
    experts, ffn = moe.model.layers[0].mlp.experts, dense.model.layers[0].mlp
    for g in range(4):  # expert g holds segment g mod 2
        s = slice((g % 2) * 32, (g % 2 + 1) * 32)
        assert torch.equal(experts.gate_proj[g], ffn.gate_proj.weight[s])
        assert torch.equal(experts.up_proj[g], ffn.up_proj.weight[s])
        assert torch.equal(experts.down_proj[g], ffn.down_proj.weight[:, s])


def test_each_rank_holds_only_its_experts(tmp_path):
    """ep_size=2 laid out in this process (no process group): rank 1 holds global experts 2 and 3 of the
    fine-grained stack (segments 0 and 1), the same values the one-process model holds there."""
    write_dense(tmp_path)
    config = upcycled_config(tmp_path, "switch-tiny", {**MOE, "expert_intermediate_size": 32})
    whole = upcycle(tmp_path, "switch-tiny", **{**MOE, "expert_intermediate_size": 32})
    for rank in (0, 1):
        state = par.ParallelState(2, rank, rank, 2, 1, rank, 0)
        model = par.apply_expert_parallel(build_meta_model(config), state)
        model = load_upcycled(materialize_owned(model, torch.device("cpu"), 0), tmp_path)
        shard = model.model.layers[1].mlp.experts
        assert shard.first_expert == 2 * rank and shard.local.down_proj.shape[0] == 2
        for name in ("gate_proj", "up_proj", "down_proj"):
            expected = getattr(whole.model.layers[1].mlp.experts, name)[2 * rank : 2 * rank + 2]
            assert torch.equal(getattr(shard.local, name), expected)
        router = model.model.layers[1].mlp.router.gate.weight  # seeded per unit: the same at every layout
        assert torch.equal(router, whole.model.layers[1].mlp.router.gate.weight)


def test_training_moves_the_experts_apart(tmp_path):
    write_dense(tmp_path / "dense")
    config = TrainConfig.build(
        {
            "model": {"preset": "switch-tiny", "overrides": MOE, "upcycle_from": str(tmp_path / "dense")},
            "data": {"source": "synthetic", "seq_len": 16, "synthetic_blocks": 32},
            "optim": {"lr": 1e-2, "warmup_steps": 0},
            "checkpoint": {"export": False, "every": 1000},
            "log": {"progress": "off"},
            "steps": 3,
            "batch_size": 4,
        }
    )
    trainer = Trainer(config, tmp_path / "run")
    try:
        experts = trainer.model.model.layers[0].mlp.experts.up_proj
        assert all(torch.equal(experts[0], experts[e]) for e in range(4))  # the upcycled start
        trainer.run()
        after = experts.detach()
        assert not any(torch.equal(after[0], after[e]) for e in range(1, 4))
    finally:
        trainer.close()


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"attention_bias": True}, "attention_bias=True"),
        ({"mlp_bias": True}, "mlp_bias=True"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_parameters="),
        ({"model_type": "mistral", "sliding_window": 16}, "sliding_window=16"),
        ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window=True"),
    ],
)
def test_inexpressible_dense_config_is_refused_before_weights(tmp_path, fields, named):
    write_dense(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, **fields}))
    (tmp_path / "model.safetensors").write_bytes(b"not read")  # reading a weight would fail differently
    with pytest.raises(UpcycleError, match=named):
        upcycle(tmp_path, "switch-tiny", **MOE)


def test_moe_fields_that_contradict_the_dense_model_are_refused(tmp_path):
    write_dense(tmp_path)
    with pytest.raises(UpcycleError, match=r"model.overrides.hidden_size=64"):
        upcycled_config(tmp_path, "switch-tiny", {**MOE, "hidden_size": 64})
    with pytest.raises(UpcycleError, match="expert_intermediate_size=48"):
        upcycled_config(tmp_path, "switch-tiny", {**MOE, "expert_intermediate_size": 48})
    with pytest.raises(UpcycleError, match="num_experts=3"):
        upcycled_config(tmp_path, "switch-tiny", {**MOE, "num_experts": 3, "expert_intermediate_size": 32})
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(UpcycleError, match="model_type 'gpt2'"):
        upcycled_config(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout", [["parallel.ep_size=2"], ["parallel.ep_size=1", "parallel.dp_mode=fsdp2"]], ids=["ep2", "fsdp2"]
)
def test_two_process_start_is_the_one_process_upcycled_model(tmp_path, layout):
    """2 gloo processes: at ep_size=2 each rank copies in its own experts (4 distinct slices of the dense FFN:
    rank 1 holds slices 2 and 3) and writes its expert file; under FSDP2 each its rows of the dense weights. The
    step-0 checkpoint they write together is the one-process upcycled model, bitwise."""
    write_dense(tmp_path / "dense")
    moe = {**MOE, "expert_intermediate_size": 16}
    sets = [f"model.upcycle_from={tmp_path / 'dense'}"]
    sets += [f"model.overrides.{k}={json.dumps(v)}" for k, v in moe.items()]  # None as null
    run_reshard_worker(
        2, "--fresh", str(tmp_path / "run"), *(a for s in [*sets, *layout] for a in ("--set", s))
    )
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000000"
    assert (ckpt / "experts-ep1-of-2.safetensors").is_file() == ("parallel.ep_size=2" in layout)
    written = gather_state_dict(ckpt)
    expected = upcycle(tmp_path / "dense", "mixtral-tiny", **moe).state_dict()
    assert written.keys() == expected.keys()
    different = [name for name in written if not torch.equal(written[name], expected[name])]
    assert not different, different[:5]


def test_text_data_is_tokenized_with_the_dense_models_tokenizer(tmp_path):
    dense_dir = tmp_path / "dense"
    write_dense(dense_dir, vocab_size=300)
    base = {
        "model": {"preset": "switch-tiny", "overrides": MOE, "upcycle_from": str(dense_dir)},
        "data": {"max_documents": 12, "seq_len": 32, "cache_dir": str(tmp_path / "cache")},
        "checkpoint": {"export": False},
        "log": {"progress": "off"},
        "steps": 1,
        "batch_size": 2,
    }
    with pytest.raises(
        InitFromError, match="upcycle_from=.*no tokenizer files"
    ):  # before any data is prepared
        Trainer(TrainConfig.build(base), tmp_path / "refused")
    assert not (tmp_path / "cache").exists()
    tokenizer = train_tokenizer(["the dense model's own text, tokenized its own way"] * 20, vocab_size=300)
    tokenizer.save_pretrained(dense_dir)
    trainer = Trainer(TrainConfig.build(base), tmp_path / "run")
    try:
        prepared = load_tokenizer(trainer.data_dir)
        assert prepared.get_vocab() == tokenizer.get_vocab()
        assert trainer.model.config.vocab_size == 300
    finally:
        trainer.close()
