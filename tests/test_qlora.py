"""QLoRA: NF4 codes, a checkpoint quantized while it streams in, LoRA on the 4-bit experts computed on the routed
tokens, and the adapter it saves applying to the full-precision base."""

import pytest
import torch

from moe_core.config import get_config
from moe_core.convert import from_hf
from moe_core.experts import PROJECTIONS
from moe_core.inference.quantize import quantize_experts
from moe_core.model import MoEForCausalLM, materialize
from moe_core.quantized import (
    NF4_LEVELS,
    QuantConfig,
    QuantizationError,
    QuantizedExperts,
    QuantizedLinear,
    _scaled_into,
    compute_scales,
    dequantize,
    dequantize_int4,
    dequantize_int4_scratch,
    fake_quantize,
    load_quantizing_experts,
    pack_int4,
    quantize_rtn,
    unpack_int4,
)
from tests.helpers import randomize_
from tests.test_convert import BASE, HF_CASES, make_inputs

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

NF4 = QuantConfig(bits=4, group_size=8, codebook="nf4")
INT4 = QuantConfig(bits=4, group_size=8)


def test_nf4_codes_are_the_nearest_level_of_the_group_absmax():
    torch.manual_seed(0)
    w = torch.randn(3, 16, 32)
    scale = compute_scales(w, NF4)
    q = quantize_rtn(w, scale, NF4)
    assert q.min() >= -8 and q.max() <= 7
    levels = torch.tensor(NF4_LEVELS)
    normalized = (w.reshape(3, 16, 4, 8) / scale[..., None]).reshape(w.shape)
    nearest = (normalized[..., None] - levels).abs().argmin(-1) - 8
    assert torch.equal(q.long(), nearest)
    torch.testing.assert_close(dequantize(q, scale, "nf4"), fake_quantize(w, NF4))
    # normally distributed weights: NF4 levels lose less than evenly spaced int4 ones at the same group size
    nf4_error = (fake_quantize(w, NF4) - w).square().mean()
    int4_error = (fake_quantize(w, INT4) - w).square().mean()
    assert nf4_error < int4_error


def test_nf4_codes_are_the_binary_search_reference_exactly():
    """`nf4_codes` (a cell table and one comparison) against `nf4_codes_reference` (bucketize over the midpoints):
    on the midpoints themselves and their fp32 neighbours (ties go to the lower level), on every cell edge and its
    neighbours, on -1, 0, 1, and on millions of uniform values."""
    from moe_core.quantized import NF4_CELLS, nf4_codes, nf4_codes_reference, nf4_midpoints

    mid = nf4_midpoints()
    edges = torch.arange(NF4_CELLS + 1) / (NF4_CELLS / 2) - 1
    up, down = torch.tensor(2.0), torch.tensor(-2.0)
    probes = [mid, edges, torch.tensor([-1.0, -0.0, 0.0, 1.0]), torch.linspace(-1, 1, 100_001)]
    probes += [torch.nextafter(t, d) for t in (mid, edges) for d in (up, down)]
    torch.manual_seed(0)
    probes.append(torch.rand(2_000_000) * 2 - 1)
    y = torch.cat(probes).clamp(-1, 1)
    codes = nf4_codes(y)
    assert codes.dtype == torch.int8 and torch.equal(codes.long(), nf4_codes_reference(y))
    assert torch.equal(nf4_codes(mid), torch.arange(15, dtype=torch.int8))  # a tie: the lower level


def test_the_byte_table_dequantization_is_the_reference_bitwise():
    """QLoRA's per-expert dequantization (`dequantize_int4`, one [256, 2] lookup per byte) against the reference
    (unpack to int8 codes, then `dequantize`): every byte value, both codebooks, with and without a stack dim."""
    g = torch.Generator().manual_seed(0)
    every_byte = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    for packed, G in (
        (every_byte, 4),
        (torch.randint(0, 256, (3, 16, 32), dtype=torch.uint8, generator=g), 8),
        (torch.randint(0, 256, (5, 8), dtype=torch.uint8, generator=g), 1),
    ):
        # scales of every size and sign of exponent: the rounding of the product shows
        scale = torch.rand(*packed.shape[:-1], G, generator=g).exp() * 10.0 ** torch.randint(
            -4, 2, (G,), generator=g
        )
        for codebook in ("int", "nf4"):
            fast = dequantize_int4(packed, scale, codebook)
            reference = dequantize(unpack_int4(packed), scale, codebook)
            assert torch.equal(fast, reference), (packed.shape, codebook)
            # straight into a compute dtype (QLoRA's stacks on a GPU): the fp32 values' cast, bit for bit,
            # with fp32 and bf16 (QLoRA's) scales
            for scale_dtype in (torch.float32, torch.bfloat16):
                s = scale.to(scale_dtype)
                reference = dequantize(unpack_int4(packed), s, codebook)
                for dtype in (torch.bfloat16, torch.float16, torch.float64):
                    fast = dequantize_int4(packed, s, codebook, dtype)
                    where = (codebook, s.dtype, dtype)
                    assert fast.dtype == dtype and torch.equal(fast, reference.to(dtype)), where
                    # a GPU's one pass, the product stored in ``dtype`` as it is computed: the same bits
                    *lead, O, H = packed.shape
                    values = dequantize_int4(packed, torch.ones_like(s, dtype=torch.float32), codebook)
                    one_pass = _scaled_into(values.view(*lead, O, G, -1), s, dtype, one_pass=True)
                    assert torch.equal(one_pass.view(*lead, O, 2 * H), reference.to(dtype)), where
    # QLoRA's CPU slices in a 16-bit dtype, integer codes two bytes at a time: every pair of bytes
    every_pair = torch.arange(65536, dtype=torch.int32).view(torch.uint8).view(-1, 4)[:, :2].reshape(256, 512)
    scale = torch.rand(256, 16, generator=g).exp().bfloat16()
    reference = dequantize(unpack_int4(every_pair), scale, "int")
    for dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(dequantize_int4_scratch(every_pair, scale, "int", dtype), reference.to(dtype)), (
            dtype
        )
    # and the codes round-trip: what quantizing wrote, dequantizing reads
    w = torch.randn(4, 16, 32, generator=g)
    scale = compute_scales(w, NF4)
    packed = pack_int4(quantize_rtn(w, scale, NF4))
    torch.testing.assert_close(dequantize_int4(packed, scale, "nf4"), fake_quantize(w, NF4), rtol=0, atol=0)


def test_nf4_is_refused_where_it_means_nothing():
    with pytest.raises(QuantizationError, match="codebook='nf4'"):
        QuantConfig(bits=8, codebook="nf4")
    with pytest.raises(QuantizationError, match="codebook='nf4'"):
        QuantConfig(bits=4, codebook="nf4", method="gptq")


def test_a_model_built_on_meta_and_materialized_has_the_buffers_of_one_built_normally():
    config = get_config("mixtral-tiny", router="aux_free", router_bias_update_rate=0.1)
    normal = MoEForCausalLM(config)
    with torch.device("meta"):
        skeleton = MoEForCausalLM(config)
    materialize(skeleton)
    skeleton.load_state_dict(normal.state_dict())
    for (name, ours), (_, theirs) in zip(skeleton.named_buffers(), normal.named_buffers(), strict=True):
        assert torch.equal(ours, theirs), name  # non-persistent ones (rotary frequencies, pending load) too


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    built = {}
    for name in ("mixtral", "olmoe", "qwen2_moe"):
        config_cls, model_cls, overrides = HF_CASES[name]
        torch.manual_seed(0)
        model = model_cls(config_cls(**{**BASE, **overrides}))
        randomize_(model)
        directory = tmp_path_factory.mktemp(name)
        model.save_pretrained(directory)
        built[name] = directory
    ours = tmp_path_factory.mktemp("ours")
    torch.manual_seed(0)
    native = MoEForCausalLM(get_config("mixtral-tiny", expert_intermediate_size=32, hidden_size=32))
    randomize_(native)
    native.save_pretrained(ours)
    built["ours"] = ours
    return built


def assert_same_quantized_model(streamed, reference) -> None:
    """A checkpoint quantized while it streamed in against the loaded model quantized in memory: the same state
    dict, bitwise, and the same logits."""
    state, expected = streamed.state_dict(), reference.state_dict()
    assert state.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name
    input_ids, mask = make_inputs(streamed.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(
            streamed(input_ids, attention_mask=mask).logits,
            reference.eval()(input_ids, attention_mask=mask).logits,
        )


@pytest.mark.parametrize("case", ["mixtral", "olmoe", "qwen2_moe", "ours"])
@pytest.mark.parametrize("config", [NF4, INT4], ids=["nf4", "int4"])
def test_quantizing_while_loading_equals_quantizing_the_loaded_model(checkpoints, case, config):
    directory = checkpoints[case]
    streamed = load_quantizing_experts(directory, config)
    reference = from_hf(directory) if case != "ours" else MoEForCausalLM.from_pretrained(directory)
    quantize_experts(reference, config)
    assert any(isinstance(m, QuantizedExperts) for m in streamed.modules())
    assert_same_quantized_model(streamed, reference)


def test_quantizing_while_loading_refuses_what_it_cannot_read(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(QuantizationError, match="llama"):
        load_quantizing_experts(tmp_path, NF4)


def test_stack_shape_names_the_dense_stack():
    experts = QuantizedExperts(
        4, "swiglu", {p: (16, 32) if p != "down_proj" else (32, 16) for p in PROJECTIONS}, NF4
    )
    assert experts.stack_shape("gate_proj") == (4, 16, 32) and experts.stack_shape("down_proj") == (4, 32, 16)


# ------------------------------------------------------------------------------------------------ LoRA on 4 bits
def dequantized_twin(quantized, **overrides):
    """tiny_model(**overrides) (the same seed: the same non-expert weights) with ``quantized``'s experts as dense
    stacks and its 4-bit projections (`QuantizedLinear`: attention, shared experts) as dense weights."""
    from moe_core.quantized import QuantizedLinear
    from tests.finetune_helpers import tiny_model

    dense = tiny_model(**overrides)
    with torch.no_grad():
        for name, module in quantized.named_modules():
            if isinstance(module, QuantizedLinear):
                name = name.removesuffix(".base_layer")  # under LoRA
                name = name.removeprefix("base_model.model.")
                linear = dense.get_submodule(name)
                linear.weight.copy_(module.dequantized())
                if module.bias is not None:
                    linear.bias.copy_(module.bias)
        for layer, q_layer in zip(dense.model.layers, quantized.model.layers):
            experts = q_layer.mlp.experts
            experts = (
                experts.get_base_layer() if hasattr(experts, "get_base_layer") else experts
            )  # under LoRA
            for p in PROJECTIONS:
                getattr(layer.mlp.experts, p).copy_(experts.dequantized_stack(p))
    return dense


def qlora_pair(config=NF4, lora=None, attention=False, shared_experts=False, **overrides):
    """A tiny model (``tiny_model(**overrides)``) with 4-bit experts (and attention, ``attention``; shared experts,
    ``shared_experts``) + routed LoRA, and the same model with the dequantized weights as dense stacks and
    Linears + PEFT's own LoRA, with equal factors."""
    from moe_core.finetune import FinetuneConfig
    from moe_core.finetune.methods import apply_lora
    from moe_core.quantized import quantize_attention, quantize_shared_experts
    from tests.finetune_helpers import tiny_model
    from tests.test_expert_lora import randomize_lora

    ft = FinetuneConfig.build(
        lora or {"lora": {"r": 4, "alpha": 8.0, "experts": "all", "attention": ["q_proj"]}}
    )
    quantized = tiny_model(**overrides)
    quantize_experts(quantized, config)
    if attention:
        with torch.no_grad():  # biases (Qwen2-MoE's q/k/v) start at zero: give them values to keep
            for module in quantized.modules():
                if isinstance(module, torch.nn.Linear) and module.bias is not None:
                    module.bias.normal_(0.0, 0.1)
        quantize_attention(quantized, config)
    if shared_experts:
        quantize_shared_experts(quantized, config)
    dense = dequantized_twin(quantized, **overrides)
    selection = {layer: list(range(4)) for layer in dense.config.moe_layer_ids}
    ours, _ = apply_lora(quantized, ft, selection)
    reference, _ = apply_lora(dense, ft, selection, routed=False)
    randomize_lora(ours)
    reference.load_state_dict(ours.state_dict(), strict=False)
    return ours, reference


@pytest.mark.parametrize("impl", ["sorted", "grouped_mm"])
def test_lora_on_4_bit_experts_equals_peft_on_the_dequantized_weights(impl):
    """Slice by slice (the CPU's ``auto``) and a layer's stacks dequantized at once through grouped matmuls (a
    GPU's ``auto``)."""
    from tests.finetune_helpers import assert_same_lora_step

    ours, reference = qlora_pair()
    grads = assert_same_lora_step(
        ours, reference, torch.randint(0, 300, (3, 10)), ".experts.", expert_impl=impl
    )
    # only the adapters train: the 4-bit codes have no gradient and stay as they are
    assert not any(".experts." in n and "lora_" not in n for n in grads)


def test_lora_on_4_bit_attention_equals_peft_on_the_dequantized_linears():
    """``quantize.attention``: q/k/v/o as `QuantizedLinear` (Qwen2-MoE's q/k/v biases kept), PEFT's LoRA on them
    (`QuantizedLinearLoRA`) gives PEFT's LoRA on the dequantized nn.Linears: logits and every gradient."""
    from moe_core.finetune.expert_lora import QuantizedLinearLoRA
    from moe_core.quantized import QuantizedLinear
    from tests.finetune_helpers import assert_same_lora_step

    lora = {"lora": {"r": 4, "alpha": 8.0, "experts": "all", "attention": ["q_proj", "v_proj", "o_proj"]}}
    ours, reference = qlora_pair(lora=lora, attention=True, attention_bias=True)
    attention = ours.base_model.model.model.layers[0].self_attn
    assert isinstance(attention.q_proj, QuantizedLinearLoRA) and isinstance(attention.k_proj, QuantizedLinear)
    assert attention.q_proj.base_layer.bias is not None and attention.q_proj.base_layer.bias.abs().sum() > 0
    assert_same_lora_step(ours, reference, torch.randint(0, 300, (3, 10)), ".self_attn.o_proj.lora_A")
    with pytest.raises(ValueError, match="4-bit projection .* full-precision base"):
        attention.q_proj.merge()


def test_lora_on_4_bit_shared_experts_equals_peft_on_the_dequantized_linears():
    """``lora.shared_expert`` under QLoRA: the shared experts' projections stay in 4 bits (`QuantizedLinear`)
    with PEFT's LoRA over them (`QuantizedLinearLoRA`), as PEFT's LoRA on the dequantized nn.Linears."""
    from moe_core.finetune.expert_lora import QuantizedLinearLoRA
    from tests.finetune_helpers import assert_same_lora_step

    lora = {"lora": {"r": 4, "alpha": 8.0, "experts": "all", "shared_expert": True}}
    ours, reference = qlora_pair(lora=lora, shared_experts=True, preset="shared-tiny")
    shared = ours.base_model.model.model.layers[0].mlp.shared_expert
    assert all(isinstance(getattr(shared, p), QuantizedLinearLoRA) for p in PROJECTIONS)
    assert_same_lora_step(ours, reference, torch.randint(0, 300, (3, 10)), ".shared_expert.down_proj.lora_A")


def test_a_qlora_adapter_is_a_peft_adapter_of_the_full_precision_model(tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    ours, reference = qlora_pair(lora={"lora": {"r": 4, "alpha": 8.0, "experts": "all", "attention": []}})
    ours.save_pretrained(tmp_path / "qlora")
    reference.save_pretrained(tmp_path / "lora")
    saved = load_file(tmp_path / "qlora" / "adapter_model.safetensors")
    assert saved.keys() == load_file(tmp_path / "lora" / "adapter_model.safetensors").keys()
    # stock PEFT puts it on the dense model (here: the dequantized weights) and gives the QLoRA model's logits
    stock = PeftModel.from_pretrained(dequantized_twin(ours.base_model.model), tmp_path / "qlora")
    x = torch.randint(0, 300, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(stock(input_ids=x).logits, ours(input_ids=x).logits, atol=1e-5, rtol=1e-5)


def test_merging_into_4_bit_experts_is_refused_naming_what_to_do():
    ours, _ = qlora_pair()
    with pytest.raises(ValueError, match="full-precision base"):
        ours.merge_and_unload()


# ------------------------------------------------------------------------------------------------ moe-lab finetune
@pytest.mark.parametrize("attention", [False, None], ids=["experts", "default: experts+attention"])
def test_qlora_fine_tunes_a_hugging_face_checkpoint_and_its_adapter_applies_to_the_full_precision_base(
    tmp_path, attention
):
    """... and the output directory loads on the base it trained on (quantized again, the adapter unmerged):
    the trained model's logits and greedy tokens, where the full-precision merge differs. By default q/k/v/o are
    in 4 bits too (``quantize.attention``), their LoRA keys those of the full-precision model's; false: in the
    model's dtype."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from moe_core import load
    from moe_core.finetune import FinetuneConfig, finetune
    from moe_core.finetune.methods import unwrap
    from tests.finetune_helpers import SMALL_LORA_RUN, instruction_records
    from tests.test_finetune_hf import hf_checkpoint

    source = hf_checkpoint(tmp_path, "olmoe")
    config = FinetuneConfig.build(
        {
            **SMALL_LORA_RUN,
            "model": {"path": str(source)},
            "method": "qlora",
            "quantize": {"group_size": 16, "attention": attention},
        }
    )
    assert config.method == "lora" and config.quantize.base == "nf4"  # qlora: LoRA on an NF4 base
    result = finetune(config, tmp_path / "out", records=instruction_records(16))
    assert result.adapter_dir is not None and result.merged_dir is None and result.hf_dir is None
    assert not (tmp_path / "out" / "merged").exists()
    experts = [m for m in result.model.modules() if isinstance(m, QuantizedExperts)]
    assert experts and all(m.quant_config.codebook == "nf4" for m in experts)
    assert all(m.up_proj_scale.dtype == torch.bfloat16 for m in experts)  # QLoRA's scales: half the bytes
    four_bit_attention = [n for n, m in result.model.named_modules() if isinstance(m, QuantizedLinear)]
    assert len(four_bit_attention) == (0 if attention is False else 8)  # q, k, v, o of both layers
    trained_attention = [
        n for n, p in result.model.named_parameters() if p.requires_grad and "self_attn" in n
    ]
    assert len(trained_attention) == 16  # LoRA A and B on q, k, v, o (lora.attention's default) either way
    assert all(torch.isfinite(torch.tensor(row["loss"])) for row in result.metrics if "loss" in row)
    # the adapter is LoRA on the full-precision model: stock PEFT on the HF model, and our loader, apply it
    x = torch.randint(0, 300, (2, 10))
    with torch.no_grad():
        stock = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(source), str(result.adapter_dir)
        )
        merged = load(tmp_path / "out" / "adapter").model
        torch.testing.assert_close(
            merged(input_ids=x).logits, stock.eval()(input_ids=x).logits, atol=1e-5, rtol=1e-5
        )
        original = AutoModelForCausalLM.from_pretrained(source).eval()
        assert not torch.allclose(original(input_ids=x).logits, merged(input_ids=x).logits, atol=1e-4)
        # the output directory: the 4-bit base it trained on, with the adapter, as training left it
        loaded = load(tmp_path / "out")
        trained = unwrap(result.model).eval()
        assert loaded.kind == "finetuned" and any(
            isinstance(m, QuantizedExperts) for m in loaded.model.modules()
        )
        assert (attention is not False) == any(isinstance(m, QuantizedLinear) for m in loaded.model.modules())
        torch.testing.assert_close(loaded.model(input_ids=x).logits, trained(input_ids=x).logits)
        assert not torch.allclose(loaded.model(input_ids=x).logits, merged(input_ids=x).logits, atol=1e-4)
        prompt = loaded.tokenizer("hello", return_tensors="pt")
        tokens = loaded.model.generate(**prompt, max_new_tokens=6, do_sample=False)
        assert torch.equal(tokens, trained.generate(**prompt, max_new_tokens=6, do_sample=False))


def test_qlora_refusals_come_before_the_weights_load(tmp_path, monkeypatch):
    from moe_core.finetune import FinetuneConfig, FinetuneError, finetune
    from moe_core.finetune import run as run_module
    from tests.finetune_helpers import instruction_records
    from tests.test_finetune_hf import hf_checkpoint, tiny_tokenizer
    from tests.test_mmap_base import write_checkpoint

    with pytest.raises(FinetuneError, match="quantize.base=nf4 holds the frozen base"):
        FinetuneConfig.build({"method": "full", "quantize": {"base": "nf4"}})
    with pytest.raises(FinetuneError, match="export.merged / export.hf with quantize.base"):
        FinetuneConfig.build({"method": "qlora", "export": {"merged": True}})
    with pytest.raises(FinetuneError, match="quantize.attention=true holds the attention projections"):
        FinetuneConfig.build({"method": "lora", "quantize": {"attention": True}})
    with pytest.raises(FinetuneError, match="quantize.shared_experts=true holds the shared experts"):
        FinetuneConfig.build({"method": "lora", "quantize": {"shared_experts": True}})
    source = hf_checkpoint(tmp_path, "olmoe")

    def no_weights(*args, **kwargs):
        raise AssertionError("weights loaded before the checks")

    monkeypatch.setattr(run_module, "load_quantizing_experts", no_weights)
    config = FinetuneConfig.build(
        {
            "model": {"path": str(source)},
            "method": "qlora",
            "quantize": {"group_size": 24},
            "data": {"chat_template": "chatml"},
        }
    )
    with pytest.raises(
        FinetuneError, match="quantize.group_size=24 does not divide the model's hidden_size=32"
    ) as refused:
        finetune(config, tmp_path / "out", records=instruction_records(4))
    # a size that fits all widths, not a guess
    assert "--set quantize.group_size=32 divides them all" in str(refused.value)
    # the shared experts' fused width too (Qwen2-MoE: hidden 32, its shared expert 48 wide), adapted or not
    qwen = write_checkpoint(
        tmp_path / "qwen",
        "qwen2_moe",
        torch.float32,
        vocab_size=300,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    )
    tiny_tokenizer().save_pretrained(qwen)
    shared = config.with_overrides(
        [f"model.path={qwen}", "quantize.group_size=32", "lora.shared_expert=true"]
    )
    with pytest.raises(
        FinetuneError, match="32 does not divide the model's shared experts' intermediate width=48"
    ) as refused:
        finetune(shared, tmp_path / "out", records=instruction_records(4))
    assert "--set quantize.group_size=16 divides them all" in str(refused.value)


@pytest.mark.parametrize("impl", ["sorted", "grouped_mm"])
def test_a_qlora_step_keeps_no_dequantized_expert_for_backward(impl):
    """The 4-bit slices (or stacks, grouped_mm) are dequantized again in backward, not kept: what autograd holds
    for a QLoRA step is what it holds for LoRA on the dense model (whose frozen weights it keeps as views of
    themselves)."""

    def kept_bytes(model, impl="sorted") -> int:
        own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        kept: dict[int, int] = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in own:
                kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        x = torch.randint(0, 300, (2, 16))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=x, labels=x, expert_impl=impl).loss.backward()
        return sum(kept.values())

    lora = {"lora": {"r": 4, "alpha": 8.0, "experts": "all", "attention": []}}
    qlora, dense = qlora_pair(lora=lora)
    from moe_core.finetune import FinetuneConfig
    from moe_core.finetune.methods import apply_lora
    from tests.finetune_helpers import tiny_model

    routed_dense, _ = apply_lora(tiny_model(), FinetuneConfig.build(lora), {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]})
    F_, D = 32, 32  # tiny_model's experts; kept dequantized slices would add 2 layers x 3 x 4 experts x F x D
    assert kept_bytes(qlora, impl) <= kept_bytes(routed_dense, impl) + 3 * F_ * D * 4  # one expert's slack


def test_quantizing_while_loading_keeps_one_shard_mapped_at_a_time(tmp_path):
    """Every file the stream has moved past is unmapped (its pages stay page cache, out of the resident set, which
    otherwise grew to the checkpoint's size by the end of a 26.7 GiB load), and a file visited again reopens."""
    from transformers import OlmoeConfig, OlmoeForCausalLM

    from moe_core.convert import open_streaming, stream_weights

    torch.manual_seed(0)
    config = OlmoeConfig(**BASE, intermediate_size=32, num_experts=4, num_experts_per_tok=2)
    OlmoeForCausalLM(config).save_pretrained(tmp_path, max_shard_size="60KB")
    opened = open_streaming(tmp_path)
    files = set(opened.reader.file_of.values())
    assert len(files) > 2
    open_at_each, seen = [], 0
    for _ in stream_weights(opened.reader, opened.plan, release=True):
        open_at_each.append(len(opened.reader._open))
        seen += 1
    assert max(open_at_each) == 1 and opened.reader._open == {}
    assert seen == sum(len(names) for _, names in opened.plan)
    kept = [len(opened.reader._open) for _ in stream_weights(opened.reader, opened.plan)]
    assert max(kept) == len(files)  # without release every file stays mapped (the mapped loader needs them)


@pytest.mark.parametrize("scale_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("codebook", ["int", "nf4"])
def test_the_dequantization_qlora_runs_is_the_reference_in_reused_buffers(codebook, scale_dtype):
    """`scratch_weight` (what a QLoRA step dequantizes ~13k times) gives `weight`'s values bitwise, in buffers
    reused from slice to slice: allocating each slice left glibc's heap 1.8 GiB larger after 3 steps of a 2-layer
    Qwen1.5-MoE-A2.7B (benchmarks/README.md, "Fine-tuning at real size"). Integer codes take no table lookup
    (`dequantize_int4_scratch`), fp32 and bf16 scales (QLoRA's) alike; a shared expert's `QuantizedLinear` too."""
    from moe_core.quantized import _SCRATCH, QuantizedLinear

    config = QuantConfig(bits=4, group_size=16, block_size=16, codebook=codebook, scale_dtype=scale_dtype)
    quantized, _ = qlora_pair(config)
    experts = next(m for m in quantized.modules() if isinstance(m, QuantizedExperts))
    assert experts.gate_proj_scale.dtype == getattr(torch, scale_dtype)
    with torch.no_grad():  # scales of every size and sign of exponent: the rounding of the product shows
        for name, buffer in experts.named_buffers():
            if name.endswith("_scale"):
                buffer.copy_(torch.randn(buffer.shape).exp() * 10.0 ** torch.randint(-4, 2, buffer.shape))
    linear = QuantizedLinear(48, 32, config)
    linear.quantize_from(torch.randn(32, 48))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for p in experts.projections:
            for e in range(experts.num_experts):
                assert torch.equal(experts.scratch_weight(p, e, dtype), experts.weight(p, e, dtype))
            # a GPU's grouped path: the layer's stack dequantized at once, straight into the compute dtype
            assert torch.equal(experts.dequantized_stack(p, dtype), experts.dequantized_stack(p).to(dtype))
        assert torch.equal(linear._scratch_weight(dtype), linear.dequantized(dtype))
    buffers = len(_SCRATCH)
    x = torch.randint(0, 300, (2, 16))
    quantized(input_ids=x, labels=x).loss.backward()
    assert len(_SCRATCH) == buffers  # a step reuses them: no buffer per slice


@pytest.mark.parametrize("config", [NF4, INT4], ids=["nf4", "int4"])
def test_shared_experts_quantize_while_loading_as_in_memory(checkpoints, config):
    """QLoRA holds Qwen2-MoE's shared expert in the routed experts' bits too (`QuantizedLinear`): streamed in, it
    equals quantizing the loaded model; its forward is the dequantized weight's ``F.linear``, gradient included."""
    from moe_core.quantized import QuantizedLinear, quantize_shared_experts

    directory = checkpoints["qwen2_moe"]
    streamed = load_quantizing_experts(directory, config, shared_experts=True)
    reference = from_hf(directory)
    dense_shared = reference.model.layers[0].mlp.shared_expert.up_proj.weight.detach().clone()
    quantize_experts(reference, config)
    replaced = quantize_shared_experts(reference, config)
    assert len(replaced) == 3 * len(reference.config.moe_layer_ids)  # gate, up, down of each MoE layer
    assert any(k.endswith("shared_expert.up_proj.weight_q") for k in streamed.state_dict())
    assert_same_quantized_model(streamed, reference)
    up = streamed.model.layers[0].mlp.shared_expert.up_proj
    assert isinstance(up, QuantizedLinear)
    assert (up.dequantized() - dense_shared).abs().max() <= up.weight_scale.max() * 1.01  # within a step
    x = torch.randn(5, up.in_features, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    up(x).sum().backward()
    torch.nn.functional.linear(x_ref, up.dequantized()).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)


@pytest.mark.parametrize("case", ["qwen2_moe", "olmoe"])
def test_attention_quantizes_while_loading_as_in_memory(checkpoints, case):
    """``quantize.attention``: every attention projection streamed in as `QuantizedLinear` (Qwen2-MoE's q/k/v
    biases copied as they are) equals quantizing the loaded model's."""
    from moe_core.quantized import QuantizedLinear, quantize_attention, quantize_shared_experts

    directory = checkpoints[case]
    streamed = load_quantizing_experts(directory, INT4, shared_experts=True, attention=True)
    reference = from_hf(directory)
    dense_q = reference.model.layers[0].self_attn.q_proj
    dense_q_weight, dense_q_bias = dense_q.weight.detach().clone(), dense_q.bias
    quantize_experts(reference, INT4)
    quantize_shared_experts(reference, INT4)
    replaced = quantize_attention(reference, INT4)
    assert len(replaced) == 4 * reference.config.num_hidden_layers  # q, k, v, o of every layer
    assert_same_quantized_model(streamed, reference)
    q = streamed.model.layers[0].self_attn.q_proj
    assert isinstance(q, QuantizedLinear) and (q.bias is None) == (dense_q_bias is None)
    if dense_q_bias is not None:
        assert torch.equal(q.bias, dense_q_bias.detach()) and dense_q_bias.abs().sum() > 0
    assert (q.dequantized() - dense_q_weight).abs().max() <= q.weight_scale.max() * 1.01  # within a step


def test_method_qlora_from_the_command_line_is_lora_on_an_nf4_base():
    """``--set method=qlora`` (README), which `with_overrides` applies to a whole dumped config (its
    ``quantize.base`` present and null), is LoRA on an NF4 base as in a YAML file; a base given with it stays."""
    from moe_core.finetune import FinetuneConfig
    from moe_core.finetune.cli import resolve_config

    class Args:
        config, model, data = None, None, None
        overrides = ["method=qlora"]

    for config in (resolve_config(Args), FinetuneConfig.build({"method": "qlora"})):
        assert (config.method, config.quantize.base) == ("lora", "nf4")
    Args.overrides = ["method=qlora", "quantize.base=int4"]
    assert resolve_config(Args).quantize.base == "int4"
    assert FinetuneConfig().with_overrides(["quantize.base=int8", "method=qlora"]).quantize.base == "int8"


def test_qlora_holds_the_attention_in_4_bits_unless_told_and_a_version_1_config_reads_as_it_trained(tmp_path):
    """``quantize.attention`` unset follows ``quantize.base`` (on under QLoRA, off without); false keeps the
    attention in the model's dtype; a config saved before version 2 (no such field) reads as false, so its run
    reloads on the base it trained on; a saved and reloaded config keeps its choice."""
    from moe_core.finetune import FinetuneConfig
    from moe_core.finetune.qlora import quantizes_attention

    assert quantizes_attention(FinetuneConfig.build({"method": "qlora"}))
    assert not quantizes_attention(FinetuneConfig.build({"method": "lora"}))
    assert not quantizes_attention(
        FinetuneConfig.build({"method": "qlora", "quantize": {"attention": False}})
    )
    old = FinetuneConfig.build({"version": 1, "method": "qlora"})
    assert old.quantize.attention is False and not quantizes_attention(old)
    for config in (FinetuneConfig.build({"method": "qlora"}), old):
        config.save(tmp_path / "config.json")
        again = FinetuneConfig.load(tmp_path / "config.json")
        assert quantizes_attention(again) == quantizes_attention(config)


def test_qlora_holds_adapted_shared_experts_in_4_bits_and_a_version_2_config_reads_as_it_trained(tmp_path):
    """``quantize.shared_experts`` unset follows ``quantize.base``, with or without ``lora.shared_expert``; false
    keeps them in the model's dtype; a version-2 config (before the field) that adapted the shared expert held it
    in full precision and reads so, one that did not held it in 4 bits and reads so."""
    from moe_core.finetune import FinetuneConfig
    from moe_core.finetune.qlora import quantizes_shared_experts

    adapted = {"method": "qlora", "lora": {"shared_expert": True}}
    assert quantizes_shared_experts(FinetuneConfig.build(adapted))
    assert quantizes_shared_experts(FinetuneConfig.build({"method": "qlora"}))
    assert not quantizes_shared_experts(
        FinetuneConfig.build({"method": "lora", "lora": {"shared_expert": True}})
    )
    assert not quantizes_shared_experts(
        FinetuneConfig.build({**adapted, "quantize": {"shared_experts": False}})
    )
    old_adapted = FinetuneConfig.build({**adapted, "version": 2})
    assert old_adapted.quantize.shared_experts is False and not quantizes_shared_experts(old_adapted)
    assert quantizes_shared_experts(FinetuneConfig.build({"method": "qlora", "version": 2}))
    for config in (FinetuneConfig.build(adapted), old_adapted):
        config.save(tmp_path / "config.json")
        again = FinetuneConfig.load(tmp_path / "config.json")
        assert quantizes_shared_experts(again) == quantizes_shared_experts(config)
