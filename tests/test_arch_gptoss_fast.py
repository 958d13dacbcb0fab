"""gpt-oss's experts (a bias per expert and projection, the clamped SwiGLU) on every path the lab runs experts on:
the grouped_mm, static and gather paths equal the reference loop in forward and backward, routed expert LoRA equals
PEFT's dense-delta LoRA, QLoRA's 4-bit experts and the memory-mapped base keep the biases (unquantized, in the
model's dtype) and the clamp, and the ONNX export holds them (with attention sinks and sliding windows).

Tiny configs throughout; the clamp limit is set low enough that it bites at these weight scales (checked).
"""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GptOssConfig, GptOssForCausalLM

from moe_core import MoEForCausalLM, get_config, load
from moe_core.convert import from_hf
from moe_core.experts import PROJECTIONS, GroupedExperts, replace_experts
from moe_core.finetune import FinetuneConfig
from moe_core.finetune.methods import apply_lora
from moe_core.inference.quantize import quantize_experts
from moe_core.mapped import MappedExperts, densify_experts, is_file_backed, load_mapped, mapping_refusal
from moe_core.model import MoEBlock
from moe_core.quantized import (
    QuantConfig,
    QuantizedExperts,
    load_quantized,
    load_quantizing_experts,
    save_quantized,
)
from tests.finetune_helpers import assert_same_lora_step, tiny_model
from tests.helpers import randomize_
from tests.test_arch_gptoss import HF_TINY
from tests.test_expert_lora import randomize_lora
from tests.test_mmap_base import same_lora

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

LIMIT = 0.5  # the clamped SwiGLU's limit: low, so that the clamp is active at the weight scales below
BLOCK = dict(
    num_experts=6, num_experts_per_tok=2, hidden_size=32, expert_intermediate_size=32, swiglu_limit=LIMIT
)
FAST_PATHS = ("sorted", "grouped_mm", "static", "gather")
LORA = {"lora": {"r": 4, "alpha": 8.0, "experts": "all", "attention": ["q_proj", "v_proj"]}}
NF4 = QuantConfig(bits=4, group_size=8, codebook="nf4")
INT4 = QuantConfig(bits=4, group_size=8)


# ------------------------------------------------------------------------------------------------ helpers
def seeded_block(dtype=torch.float32, **overrides) -> MoEBlock:
    torch.manual_seed(0)
    block = MoEBlock(get_config("gptoss-tiny", **{**BLOCK, **overrides}))
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.2)  # biases included
    return block.to(dtype)


def block_input(dtype=torch.float32) -> torch.Tensor:
    return torch.randn(3, 11, BLOCK["hidden_size"], generator=torch.Generator().manual_seed(1)).to(dtype)


def forward_backward(block: MoEBlock, x: torch.Tensor, impl: str):
    block.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    y, _ = block(x, impl)
    # a non-uniform upstream gradient, so that every weight's (and bias's) gradient is exercised
    (y * torch.linspace(-1, 1, y.numel()).view_as(y).to(y.dtype)).sum().backward()
    grads = {name: p.grad.clone() for name, p in block.named_parameters() if p.grad is not None}
    return y.detach(), x.grad, grads


def gptoss_model(**overrides) -> MoEForCausalLM:
    """A tiny gpt-oss (4 experts top-2, window 6 on layer 0) at logit scale O(1), biases non-zero."""
    model = tiny_model("gptoss-tiny", swiglu_limit=LIMIT, attention_window=6, **overrides)
    randomize_(model)
    return model


@pytest.fixture(scope="module")
def hf_gptoss(tmp_path_factory) -> dict:
    """transformers' own GptOssForCausalLM (fused experts, biases), saved in fp32 and in bf16."""
    torch.manual_seed(0)
    model = GptOssForCausalLM(GptOssConfig(**HF_TINY)).eval()
    randomize_(model)
    directories = {}
    for dtype in (torch.float32, torch.bfloat16):
        directories[dtype] = tmp_path_factory.mktemp(f"gptoss-{dtype}")
        copy.deepcopy(model).to(dtype).save_pretrained(directories[dtype])
    return directories


def input_ids(vocab: int = 128, batch: int = 2, seq: int = 14) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))


# ------------------------------------------------------------------------------------------------ expert paths
@pytest.mark.parametrize("impl", FAST_PATHS)
def test_every_expert_path_equals_the_reference_forward_and_backward(impl):
    block = seeded_block()
    x = block_input()
    y_ref, dx_ref, grads_ref = forward_backward(block, x, "reference")
    y, dx, grads = forward_backward(block, x, impl)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dx, dx_ref, atol=1e-5, rtol=1e-5)
    assert grads.keys() == grads_ref.keys()
    assert {f"experts.{p}_bias" for p in PROJECTIONS} <= grads.keys()
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], atol=1e-5, rtol=1e-5, msg=name)


def test_the_decode_path_equals_the_reference():
    block = seeded_block().eval()
    x = block_input()
    with torch.no_grad():
        y_ref, _ = block(x, "reference")
        block.experts.max_slots = 10_000  # the few-slot loop over the distinct chosen experts
        y, _ = block(x, "sorted")
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["grouped_mm", "static"])
def test_bf16_paths_stay_close_to_the_reference(impl):
    block = seeded_block(torch.bfloat16)
    x = block_input(torch.bfloat16)
    y_ref, dx_ref, grads_ref = forward_backward(block, x, "reference")
    y, dx, grads = forward_backward(block, x, impl)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, y_ref, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(dx, dx_ref, atol=3e-2, rtol=3e-2)
    for p in PROJECTIONS:
        name = f"experts.{p}_bias"
        torch.testing.assert_close(grads[name], grads_ref[name], atol=5e-2, rtol=5e-2, msg=name)


def test_the_comparisons_can_fail_the_biases_and_the_clamp_matter():
    block = seeded_block()
    x = block_input()
    with torch.no_grad():
        reference = block(x, "grouped_mm")[0]
        block.experts.swiglu_limit = None  # the plain SwiGLU
        assert (block(x, "grouped_mm")[0] - reference).abs().max() > 1e-2
        block.experts.swiglu_limit = LIMIT
        block.experts.down_proj_bias.zero_()
        assert (block(x, "static")[0] - reference).abs().max() > 1e-2


def test_a_replacement_that_would_drop_the_biases_is_refused():
    model = gptoss_model()
    with pytest.raises(ValueError, match="ffn_options"):
        replace_experts(
            model,
            lambda dense: QuantizedExperts(
                dense.num_experts, dense.activation, dense.projection_shapes(), NF4
            ),  # no bias, no clamp
        )


# ------------------------------------------------------------------------------------------------ expert LoRA
@pytest.mark.parametrize("impl", ["reference", *FAST_PATHS])
def test_routed_expert_lora_equals_peft_with_biased_clamped_experts(impl):
    """LoRA inside the expert computation (the base's frozen biases, LoRA added to the product) against PEFT's
    own forward, which adapts the dense stacks: equal logits and LoRA gradients."""
    config = FinetuneConfig.build(LORA)
    selection = {layer: list(range(4)) for layer in gptoss_model().config.moe_layer_ids}
    ours, _ = apply_lora(gptoss_model(expert_impl=impl), config, selection)
    peft, _ = apply_lora(gptoss_model(expert_impl=impl), config, selection, routed=False)
    randomize_lora(ours)
    randomize_lora(peft)
    x = input_ids(300, 3, 10)
    for model in (ours, peft):
        model(input_ids=x, labels=x).loss.backward()
    with torch.no_grad():
        logits = ours(input_ids=x).logits
        assert logits.std() > 0.3
        torch.testing.assert_close(logits, peft(input_ids=x).logits, atol=1e-5, rtol=1e-5)
    grads = {n: p.grad for n, p in ours.named_parameters() if p.requires_grad}
    expected = {n: p.grad for n, p in peft.named_parameters() if p.requires_grad}
    assert grads.keys() == expected.keys() and any(".experts." in n for n in grads)
    assert not any(n.endswith("_bias") for n in grads)  # the experts' biases are frozen base weights
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], atol=1e-5, rtol=1e-5, msg=name)


# ------------------------------------------------------------------------------------------------ QLoRA
def dequantized_twin(base: MoEForCausalLM, quantized: MoEForCausalLM) -> MoEForCausalLM:
    """``base`` with ``quantized``'s 4-bit expert stacks dequantized in place of its own (biases untouched)."""
    dense = copy.deepcopy(base)
    with torch.no_grad():
        for layer, q_layer in zip(dense.model.layers, quantized.model.layers):
            for p in PROJECTIONS:
                getattr(layer.mlp.experts, p).copy_(q_layer.mlp.experts.dequantized_stack(p))
    return dense


@pytest.mark.parametrize("quant", [NF4, INT4], ids=["nf4", "int4"])
def test_qlora_on_4_bit_gptoss_experts_equals_peft_on_the_dequantized_weights(quant):
    base = gptoss_model()
    quantized = copy.deepcopy(base)
    quantize_experts(quantized, quant)
    experts = quantized.model.layers[0].mlp.experts
    assert isinstance(experts, QuantizedExperts) and experts.swiglu_limit == LIMIT
    for p in PROJECTIONS:  # the biases as they were: not quantized, in the model's dtype
        bias = getattr(experts, f"{p}_bias")
        assert bias.dtype == torch.float32 and not bias.requires_grad
        assert torch.equal(bias, getattr(base.model.layers[0].mlp.experts, f"{p}_bias"))
    dense = dequantized_twin(base, quantized)
    ft = FinetuneConfig.build({"lora": {"r": 4, "alpha": 8.0, "experts": "all", "attention": ["q_proj"]}})
    selection = {layer: list(range(4)) for layer in dense.config.moe_layer_ids}
    ours, _ = apply_lora(quantized, ft, selection)
    reference, _ = apply_lora(dense, ft, selection, routed=False)
    randomize_lora(ours)
    reference.load_state_dict(ours.state_dict(), strict=False)
    assert_same_lora_step(ours, reference, input_ids(300, 3, 10), ".experts.")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_quantizing_a_gptoss_checkpoint_while_it_streams_in(hf_gptoss, dtype):
    """The streaming QLoRA loader on transformers' fused gpt-oss layout equals quantizing the converted model;
    the biases arrive unquantized in the checkpoint's dtype."""
    directory = hf_gptoss[dtype]
    streamed = load_quantizing_experts(directory, NF4)
    reference = from_hf(directory)
    quantize_experts(reference, NF4)
    experts = streamed.model.layers[0].mlp.experts
    assert isinstance(experts, QuantizedExperts) and experts.swiglu_limit == HF_TINY["swiglu_limit"]
    assert experts.up_proj_bias.dtype == dtype and experts.up_proj_bias.abs().sum() > 0
    state, expected = streamed.state_dict(), reference.state_dict()
    assert state.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name
    ids = input_ids()
    with torch.no_grad():
        torch.testing.assert_close(streamed(ids).logits, reference.eval()(ids).logits)


def test_a_quantized_gptoss_checkpoint_saves_and_loads(tmp_path):
    model = gptoss_model().eval()
    quantize_experts(model, NF4)
    save_quantized(model, tmp_path / "q", NF4)
    loaded = load_quantized(tmp_path / "q")
    assert loaded.model.layers[0].mlp.experts.swiglu_limit == LIMIT
    ids = input_ids(300)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=0, rtol=0)


# ------------------------------------------------------------------------------------------------ memory-mapped
@pytest.mark.parametrize("impl", ["reference", "sorted", "grouped_mm", "static", "gather"])
def test_the_mapped_gptoss_base_equals_the_copied_one(hf_gptoss, impl):
    directory = hf_gptoss[torch.float32]
    mapped, copied = load_mapped(directory), from_hf(directory)
    experts = mapped.model.layers[0].mlp.experts
    assert isinstance(experts, MappedExperts) and experts.swiglu_limit == HF_TINY["swiglu_limit"]
    ids = input_ids()
    with torch.no_grad():
        torch.testing.assert_close(
            mapped(ids, expert_impl=impl).logits, copied(ids, expert_impl=impl).logits, atol=1e-5, rtol=1e-5
        )


def test_lora_on_the_mapped_gptoss_base_and_its_weights_are_views_of_the_file(hf_gptoss):
    directory = hf_gptoss[torch.float32]
    before = (directory / "model.safetensors").read_bytes()
    mapped, copied = load(directory, memory_map=True).model, load(directory).model
    experts = mapped.model.layers[0].mlp.experts
    file = directory / "model.safetensors"
    assert all(is_file_backed(w, file) for p in PROJECTIONS for w in experts.weights(p))  # strided views
    assert not is_file_backed(experts.up_proj_bias, file)  # the biases are copied (small)
    ours, reference = same_lora(mapped, copied)
    ids = input_ids()
    for model in (ours, reference):
        model(ids, labels=ids).loss.backward()
    grads = {n: p.grad for n, p in ours.named_parameters() if p.requires_grad}
    expected = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    assert grads.keys() == expected.keys() and any(".experts." in n for n in grads)
    for name, grad in expected.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)
    # stacked into ordinary memory for a merge or a save: the same state as the copying loader's
    fresh = load_mapped(directory)
    assert densify_experts(fresh) == len(fresh.config.moe_layer_ids)
    state, copied_state = fresh.state_dict(), from_hf(directory).state_dict()
    assert state.keys() == copied_state.keys()
    for name, tensor in copied_state.items():
        assert torch.equal(state[name], tensor), name
    assert file.read_bytes() == before


def test_mxfp4_experts_are_refused_for_memory_mapping(hf_gptoss, tmp_path):
    directory = hf_gptoss[torch.bfloat16]
    tensors = load_file(directory / "model.safetensors")
    generator = torch.Generator().manual_seed(3)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        E, I, O = tensors.pop(name).shape  # gpt-oss's [E, in, out]; MXFP4 blocks hold 32 inputs per row
        blocks = torch.randint(0, 256, (E, O, I // 32, 16), generator=generator, dtype=torch.uint8)
        tensors[name + "_blocks"] = blocks
        tensors[name + "_scales"] = torch.full(blocks.shape[:-1], 127, dtype=torch.uint8)
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    assert "MXFP4" in mapping_refusal(tmp_path)
    assert mapping_refusal(directory) is None
    # QLoRA reads them: dequantized expert by expert as they stream in, then quantized
    quantized = load_quantizing_experts(tmp_path, NF4)
    assert isinstance(quantized.model.layers[0].mlp.experts, QuantizedExperts)


def test_experts_replaced_for_every_kind_keep_the_ffn_options():
    model = gptoss_model()
    dense = model.model.layers[0].mlp.experts
    assert isinstance(dense, GroupedExperts)
    expected = dense.ffn_options()
    assert expected == {"bias": True, "swiglu_limit": LIMIT, "swiglu_alpha": 1.702}
    quantize_experts(model, INT4)
    assert model.model.layers[0].mlp.experts.ffn_options() == expected


# ------------------------------------------------------------------------------------------------ inference
def test_pruning_keeps_each_kept_experts_biases():
    from moe_core.inference.prune import PruneConfig, prune_experts

    model = gptoss_model().eval()
    usage = {layer: [5, 0, 3, 2] for layer in model.config.moe_layer_ids}
    pruned, _ = prune_experts(model, usage, PruneConfig(keep_experts=3))
    kept = torch.tensor([0, 2, 3])
    for layer, new_layer in zip(model.model.layers, pruned.model.layers):
        assert new_layer.mlp.experts.swiglu_limit == LIMIT
        for p in PROJECTIONS:
            before = getattr(layer.mlp.experts, f"{p}_bias").index_select(0, kept)
            assert torch.equal(getattr(new_layer.mlp.experts, f"{p}_bias"), before)


def test_the_expert_cache_refuses_biased_experts(tmp_path):
    from moe_core.inference.expert_cache import ExpertCacheError, offload_experts

    with pytest.raises(ExpertCacheError, match="swiglu_limit"):
        offload_experts(gptoss_model(), tmp_path / "cache", capacity=8)
    assert not (tmp_path / "cache").exists()


def test_onnx_export_holds_biased_clamped_experts_sinks_and_windows(tmp_path):
    """`export_onnx` validates the graph at several shapes (24 and 64 tokens: past the window of 6) and a cached
    step; here also a left-padded batch and greedy generation with the KV cache past the window. One layer (a
    sliding-window one, with sinks): each layer costs the exporter ~17 s here, and the full-attention layers' mask
    is every other model's."""
    from tests.test_inference_onnx import check_export

    model = gptoss_model(num_hidden_layers=1).eval()
    attention = model.model.layers[0].self_attn
    assert attention.window == 6 and attention.sinks is not None
    check_export(model, tmp_path / "onnx")
