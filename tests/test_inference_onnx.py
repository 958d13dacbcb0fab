"""ONNX export through torch.onnx (dynamo): every expert in the graph, logits within 1e-4, identical greedy
generations with the KV cache, and the ONNX Runtime wrapper's sampling and end-of-sequence handling.

Weights are re-drawn at a scale where logits are O(1) and routing is spread, and each test first checks that
its inputs reach every expert of every MoE layer, so a graph missing an expert (what a tracer on the sorted
path produces) would move the logits of the tokens routed there far beyond the tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
)

from moe_core import MoEForCausalLM, get_config
from moe_core.cli import main
from moe_core.convert import from_hf
from moe_core.inference.onnx_export import (
    OnnxExportError,
    OrtCausalLM,
    expected_expert_weights,
    expert_weights_in_graph,
    export_onnx,
    load_onnx,
)
from moe_core.inference.prune import PruneConfig, collect_usage, prune_experts
from tests.helpers import randomize_

ATOL = 1e-4


def inputs(vocab_size: int, batch: int = 4, seq: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, vocab_size, (batch, seq), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :5] = 0  # left padding, as batched generation pads
    return input_ids, attention_mask


def assert_every_expert_hit(model: MoEForCausalLM, input_ids, attention_mask) -> None:
    with torch.no_grad():
        routing = model(input_ids, attention_mask=attention_mask, output_routing=True).routing
    for layer, record in zip(model.config.moe_layer_ids, routing):
        idle = (record.tokens_per_expert_E == 0).nonzero().flatten().tolist()
        assert not idle, (
            f"test inputs never reach experts {idle} of layer {layer}: the check would be vacuous"
        )


def check_export(model: MoEForCausalLM, out_dir) -> None:
    model.eval()
    input_ids, attention_mask = inputs(model.config.vocab_size)
    assert_every_expert_hit(model, input_ids, attention_mask)
    export_onnx(model, out_dir)
    assert expert_weights_in_graph(out_dir / "model.onnx", model.config) == expected_expert_weights(
        model.config
    )

    ort = load_onnx(out_dir)
    with torch.no_grad():
        ref = model(input_ids, attention_mask=attention_mask).logits
    got = ort(input_ids=input_ids, attention_mask=attention_mask).logits
    keep = attention_mask.bool()  # padded positions are never read
    assert (ref - got)[keep].abs().max().item() < ATOL

    prompt = input_ids[:1, :8]
    ref_ids = model.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12)
    got_ids = ort.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12)
    assert torch.equal(ref_ids, got_ids)


@pytest.fixture(scope="module")
def gqa_export(tmp_path_factory):
    """One export of a grouped-query model (1 KV head) with 6 experts, shared by the tests that read it."""
    torch.manual_seed(0)
    model = MoEForCausalLM(get_config("mixtral-tiny", vocab_size=96, num_experts=6, num_key_value_heads=1))
    randomize_(model)
    out = tmp_path_factory.mktemp("gqa") / "onnx"
    check_export(model, out)
    return model, out


def test_export_moe_lab_gqa_every_expert(gqa_export):
    model, out = gqa_export
    assert isinstance(load_onnx(out), OrtCausalLM)
    assert "forward" not in model.__dict__  # the export leaves nothing on the model (torch.compile sees it)


def test_ort_generate_stops_at_eos_like_transformers(gqa_export):
    """A row that emits eos is padded until every row ends, eos is held back until min_new_tokens, and a
    left-padded batch decodes as model.generate does (positions from the mask)."""
    model, out = gqa_export
    ort = load_onnx(out)
    input_ids, attention_mask = inputs(96, batch=2, seq=6)
    greedy = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=8, do_sample=False)
    eos = int(greedy[0, 6 + 2])  # row 0's third new token ends it
    assert (greedy[1, 6:9] != eos).all(), "row 1 would end too: the padding check is vacuous"
    for kwargs in (dict(), dict(min_new_tokens=5)):
        ref = model.generate(
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=0,
            **kwargs,
        )
        got = ort.generate(
            input_ids, attention_mask, max_new_tokens=8, eos_token_id=eos, pad_token_id=0, **kwargs
        )
        assert torch.equal(got, ref), kwargs


def test_ort_sampling_repeats_with_a_seed_and_top_k_1_is_greedy(gqa_export):
    model, out = gqa_export
    ort = load_onnx(out)
    prompt = inputs(96)[0][:2, :5]
    greedy = ort.generate(prompt, max_new_tokens=6)
    assert torch.equal(ort.generate(prompt, max_new_tokens=6, do_sample=True, top_k=1), greedy)

    def draw(seed):
        generator = torch.Generator().manual_seed(seed)
        return ort.generate(
            prompt, max_new_tokens=6, do_sample=True, top_k=0, temperature=5.0, generator=generator
        )

    first = draw(0)
    assert torch.equal(first, draw(0))
    assert not torch.equal(first, greedy)  # at temperature 5 over the whole vocabulary, it does sample
    assert first.shape == (2, 11) and int(first.max()) < 96


@pytest.mark.slow
def test_export_pruned_olmoe_with_its_routers_pruned_softmax_mass(tmp_path):
    # OLMoE's graph: qk-norm, top-8 of 64 without renormalization, clipped q/k/v (OLMoE-1B-7B-0924's clip_qkv)
    model = MoEForCausalLM(get_config("olmoe-tiny", vocab_size=96, clip_qkv=2.0))
    randomize_(model)
    pruned, _ = prune_experts(model, collect_usage(model, [inputs(96)[0]]), PruneConfig(keep_experts=16))
    assert pruned.config.router_pruned_experts == 48  # the denominator rows are in the graph too
    check_export(pruned, tmp_path / "onnx")


def test_export_refuses_a_data_dependent_expert_path(tmp_path):
    model = MoEForCausalLM(get_config("mixtral-tiny", vocab_size=96, expert_impl="sorted"))
    with pytest.raises(OnnxExportError, match="static"):
        export_onnx(model, tmp_path / "onnx", validate=False)


def test_graph_count_sees_a_missing_expert(gqa_export, tmp_path):
    """The graph check can fail: a stack one expert short is not a complete export."""
    import onnx
    from onnx import numpy_helper

    model, out = gqa_export
    graph = onnx.load(str(out / "model.onnx"))
    E, F_, D = model.config.num_experts, model.config.expert_intermediate_size, model.config.hidden_size
    for init in graph.graph.initializer:
        if sorted(init.dims) == sorted((E, F_, D)):  # drop the last expert of a stack (or its transpose)
            axis = list(init.dims).index(E)
            cut = np.delete(numpy_helper.to_array(init), -1, axis=axis)
            init.CopyFrom(numpy_helper.from_array(cut, init.name))
            break
    else:
        pytest.fail("no expert stack in the exported graph")
    onnx.save(graph, str(tmp_path / "cut.onnx"))
    assert expert_weights_in_graph(tmp_path / "cut.onnx", model.config) != expected_expert_weights(
        model.config
    )


HF_CASES = {
    "mixtral": (
        MixtralConfig,
        MixtralForCausalLM,
        dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48, head_dim=16),
    ),
    "qwen2_moe": (
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        dict(
            num_hidden_layers=3,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            intermediate_size=56,
            mlp_only_layers=[1],
        ),
    ),
}
BASE = dict(
    vocab_size=96,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


# OLMoE's graph is exported above from the olmoe preset (test_export_pruned_olmoe_...)
@pytest.mark.parametrize("arch", ["mixtral", pytest.param("qwen2_moe", marks=pytest.mark.slow)])
def test_export_hf_checkpoint(tmp_path, arch):
    config_cls, model_cls, extra = HF_CASES[arch]
    torch.manual_seed(0)
    hf = model_cls(config_cls(**{**BASE, **extra}))
    randomize_(hf)
    hf.save_pretrained(tmp_path / "hf")
    check_export(from_hf(tmp_path / "hf"), tmp_path / "onnx")
    if arch == "mixtral":  # the directory route (what the CLI takes) converts on the fly: once is enough
        assert (
            main(["export", "onnx", str(tmp_path / "hf"), "--out", str(tmp_path / "cli"), "--no-validate"])
            == 0
        )
        assert (tmp_path / "cli" / "model.onnx").is_file()


def test_cli_export_errors_clearly(tmp_path, capsys):
    assert main(["export", "onnx", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
    assert "missing: not found" in capsys.readouterr().err  # at argument parsing, before any work
    (tmp_path / "empty").mkdir()
    assert main(["export", "onnx", str(tmp_path / "empty"), "--out", str(tmp_path / "o")]) == 2
    assert "config.json" in capsys.readouterr().err
