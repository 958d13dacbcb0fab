"""Weight-only int8/int4 experts (RTN, GPTQ) against the fake-quant reference, coverage, and ORT dynamic int8."""

from __future__ import annotations

import copy

import pytest
import torch

from moe_core import MoEForCausalLM, get_config
from moe_core.inference.quantize import (
    PROJECTIONS,
    QuantConfig,
    QuantizationError,
    QuantizedExperts,
    check_experts_quantized,
    expert_modules,
    fake_quantize,
    load_quantized,
    pack_int4,
    quantize_experts,
    save_quantized,
    unpack_int4,
)
from tests.helpers import tiny_mixtral as tiny_model
from tests.helpers import token_ids as ids

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def fake_quant_reference(model, config):
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for _, module in expert_modules(ref):
            for p in PROJECTIONS:
                if getattr(module, p) is not None:
                    getattr(module, p).copy_(fake_quantize(getattr(module, p), config))
    return ref


def test_int4_packing_round_trips():
    q = torch.randint(-8, 8, (3, 5, 8), dtype=torch.int8)
    assert torch.equal(unpack_int4(pack_int4(q)), q)


@pytest.mark.parametrize("bits", [8, 4])
def test_rtn_matches_fake_quant_reference(bits):
    model = tiny_model()
    config = QuantConfig(bits=bits, group_size=16)
    ref = fake_quant_reference(model, config)
    full = copy.deepcopy(model)
    report = quantize_experts(model, config)
    x = ids()
    with torch.no_grad():
        for impl in ("sorted", "reference", "static"):
            torch.testing.assert_close(
                model(x, expert_impl=impl).logits, ref(x, expert_impl=impl).logits, atol=1e-5, rtol=1e-5
            )
        drift = (model(x).logits - full(x).logits).abs().max()
    assert drift > 0  # it did quantize
    assert report.experts_quantized == 2 * model.config.num_experts
    expert_params = sum(m.numel() for n, m in full.named_parameters() if ".experts." in n)
    assert report.params_quantized == expert_params
    assert report.fraction_quantized == pytest.approx(
        expert_params / sum(p.numel() for p in full.parameters())
    )
    assert report.bytes_after < report.bytes_before * (0.5 if bits == 8 else 0.4)


def test_router_norms_and_attention_stay_full_precision():
    model = tiny_model()
    before = {n: p.clone() for n, p in model.named_parameters() if ".experts." not in n}
    quantize_experts(model, QuantConfig(bits=4, group_size=16))
    after = dict(model.named_parameters())
    assert set(before) == set(after)
    for name, tensor in before.items():
        assert after[name].dtype == torch.float32 and torch.equal(after[name], tensor), name


def test_skipped_expert_weights_fail_the_check():
    model = tiny_model()
    quantize_experts(model, QuantConfig())
    check_experts_quantized(model)
    fresh = tiny_model()
    model.model.layers[1].mlp.experts = fresh.model.layers[1].mlp.experts  # one layer left in fp32
    with pytest.raises(QuantizationError, match="layers.1"):
        check_experts_quantized(model)


def test_gptq_beats_rtn_and_covers_every_expert():
    """GPTQ minimizes the layer output error on its calibration inputs: there it must beat round-to-nearest.
    (On held-out tokens of an untrained model the gain is small; the benchmark reports perplexity.)"""
    model = tiny_model(num_experts=8)
    calibration = [ids(8, 32, seed=s) for s in range(2)]
    with torch.no_grad():
        full = [model(x).logits for x in calibration]
    rtn, gptq = copy.deepcopy(model), copy.deepcopy(model)
    quantize_experts(rtn, QuantConfig(bits=4, group_size=16))
    report = quantize_experts(
        gptq, QuantConfig(bits=4, group_size=16, method="gptq", min_tokens=160), calibration
    )
    with torch.no_grad():
        err_rtn = sum((rtn(x).logits - f).pow(2).mean() for x, f in zip(calibration, full))
        err_gptq = sum((gptq(x).logits - f).pow(2).mean() for x, f in zip(calibration, full))
    assert err_gptq < 0.8 * err_rtn
    for name, counts in report.calibration_tokens.items():
        forced = report.forced_tokens[name]
        assert all(c + f >= 160 for c, f in zip(counts, forced)), name  # rare experts were topped up
        assert any(f > 0 for f in forced)
    assert not report.experts_rtn_fallback


@pytest.mark.parametrize("bits, group_size, damp", [(4, 16, 0.01), (8, 128, 0.01), (4, 16, 0.0)])
def test_gptq_of_several_matrices_at_once_is_gptq_of_each(bits, group_size, damp):
    """`gptq_quantize_batch` (a module's experts quantized together: the column loop's operators once for all of
    them) gives each matrix `gptq_quantize`'s codes and scales bit for bit: with a dead input column (a zero
    Hessian row), and undampened with fewer tokens than inputs (a Hessian that may not factorize: round to
    nearest)."""
    from moe_core.inference.quantize.calibrated import GPTQHessians, gptq_quantize, gptq_quantize_batch

    config = QuantConfig(
        bits=bits, group_size=group_size, method="gptq", block_size=32 if bits == 4 else 128, damp=damp
    )
    torch.manual_seed(0)
    w_BOI = torch.randn(5, 24, 128).bfloat16()
    xs = [torch.randn(n, 128) for n in (300, 40, 300, 7, 200)]
    xs[2][:, 7] = 0.0  # a dead input column
    H_BII = torch.stack([x.T @ x for x in xs])
    hessians = GPTQHessians.of(H_BII, config)
    assert hessians.singular == ([1, 3] if damp == 0 else [])  # fewer tokens than inputs, undampened
    Q, scale = gptq_quantize_batch(w_BOI, hessians, config)
    for b in range(5):
        q_ref, scale_ref = gptq_quantize(w_BOI[b], H_BII[b], config)
        assert torch.equal(Q[b], q_ref) and torch.equal(scale[b], scale_ref), b


def test_gptq_falls_back_to_rtn_with_too_little_calibration():
    model = tiny_model()
    report = quantize_experts(model, QuantConfig(method="gptq", min_tokens=1000), [ids(1, 8)])
    assert len(report.experts_rtn_fallback) == 2 * model.config.num_experts
    assert report.notes and "min_tokens" in report.notes[0]


def test_save_and_load_quantized(tmp_path):
    model = tiny_model()
    config = QuantConfig(bits=4, group_size=16)
    report = quantize_experts(model, config)
    save_quantized(model, tmp_path, config, report)
    loaded = load_quantized(tmp_path)
    assert isinstance(loaded.model.layers[0].mlp.experts, QuantizedExperts)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids()).logits, model(ids()).logits)


def test_a_large_checkpoint_is_quantized_and_loaded_in_its_own_dtype_without_a_float32_model(
    tmp_path, monkeypatch, capsys
):
    """``moe-lab quantize`` of the full OLMoE-1B-7B (12.9 GiB in bf16) read it in float32 (25.8 GiB) and was killed
    for memory, and loading its 4.7 GiB output built the whole model in float32 first (random weights, random
    experts quantized) and was killed too. Above 1 B parameters (here: above 1,000) the checkpoint is read in the
    dtype it holds, which gives the same codes; the output loads on the meta device, each tensor in its stored
    dtype, and nothing is quantized on the way in."""
    from moe_core.finetune import sizing
    from moe_core.inference.quantize.weight_only import quantize_checkpoint

    model = tiny_model().to(torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    config = QuantConfig(bits=4, group_size=16)
    quantize_checkpoint(tmp_path / "bf16", tmp_path / "small", config)  # a small model: read in float32
    monkeypatch.setattr(sizing, "LARGE_MODEL_PARAMS", 1000)
    quantize_checkpoint(tmp_path / "bf16", tmp_path / "large", config)
    assert "read in the dtype its checkpoint holds" in capsys.readouterr().err

    def never(*args, **kwargs):
        raise AssertionError("loading quantized experts again")

    monkeypatch.setattr(QuantizedExperts, "from_experts", never)
    small, large = load_quantized(tmp_path / "small"), load_quantized(tmp_path / "large")
    assert small.model.embed_tokens.weight.dtype == torch.float32
    assert large.model.embed_tokens.weight.dtype == torch.bfloat16  # as stored: no float32 copy
    for (name, a), (_, b) in zip(expert_modules(small), expert_modules(large), strict=True):
        for p in PROJECTIONS:  # the same codes and scales from the same stored values
            assert torch.equal(getattr(a, f"{p}_q"), getattr(b, f"{p}_q")), name
            assert torch.equal(getattr(a, f"{p}_scale"), getattr(b, f"{p}_scale")), name
    assert not any(t.is_meta for t in [*large.parameters(), *large.buffers()])
    from moe_core.mapped import is_file_backed

    weights = tmp_path / "large" / "model.safetensors"  # the file's own pages, not a copy
    assert is_file_backed(large.model.embed_tokens.weight, weights)
    assert is_file_backed(large.model.layers[0].mlp.experts.up_proj_q, weights)
    with torch.no_grad():
        assert torch.isfinite(large(ids()).logits).all()


def test_onnx_dynamic_int8_quantizes_every_expert_matmul(tmp_path):
    import onnx

    from moe_core.inference.onnx_export import expected_expert_weights, export_onnx, load_onnx
    from moe_core.inference.quantize import quantize_onnx_dynamic

    model = tiny_model()
    export_onnx(model, tmp_path / "fp32", validate=False)
    quantize_onnx_dynamic(tmp_path / "fp32", tmp_path / "int8")
    graph = onnx.load(str(tmp_path / "int8" / "model_quantized.onnx"))
    ops = [n.op_type for n in graph.graph.node]
    config = model.config
    moe_layers, E, F_, D = (
        len(config.moe_layer_ids),
        config.num_experts,
        config.expert_intermediate_size,
        config.hidden_size,
    )
    # one wide matmul per expert projection (all E experts), 4 attention projections per layer, the LM
    # head; the routers stay in float
    assert ops.count("MatMulInteger") == 3 * moe_layers + 4 * config.num_hidden_layers + 1
    int8 = [
        tuple(i.dims)
        for i in graph.graph.initializer
        if i.data_type in (onnx.TensorProto.INT8, onnx.TensorProto.UINT8)
    ]
    assert sum(E for dims in int8 if sorted(dims) == sorted((E * F_, D))) == expected_expert_weights(config)
    router_matmuls = [n for n in graph.graph.node if n.op_type == "MatMul" and "/router/" in n.name]
    assert len(router_matmuls) == moe_layers
    ort = load_onnx(tmp_path / "int8")
    x = ids()
    with torch.no_grad():
        ref = model(x).logits
    got = ort(input_ids=x, attention_mask=torch.ones_like(x)).logits
    # activations are quantized per tensor at run time and a flipped expert choice moves a token's logits
    # a lot, so hold the mean error, not the max (the trained-model perplexity drift is in the benchmark)
    assert (got - ref).abs().mean() < 0.1 * ref.abs().mean()
    assert (got - ref).abs().max() > 0  # it did quantize


def test_optimum_gptq_route(tmp_path, capsys):
    """optimum's GPTQ needs CUDA and gptqmodel: without them a clear error and nothing written; with them
    every expert projection of the HF architecture is quantized (the function refuses otherwise)."""
    from moe_core.cli import main
    from moe_core.inference.quantize import optimum_gptq_available, quantize_optimum_gptq

    model = MoEForCausalLM(get_config("mixtral-tiny", vocab_size=128))
    model.save_pretrained(tmp_path / "model")
    if not optimum_gptq_available():
        with pytest.raises(QuantizationError, match="CUDA GPU and the gptqmodel"):
            quantize_optimum_gptq(tmp_path / "model", tmp_path / "gptq", None)
        assert (
            main(
                [
                    "quantize",
                    str(tmp_path / "model"),
                    "--out",
                    str(tmp_path / "gptq"),
                    "--method",
                    "optimum-gptq",
                ]
            )
            == 2
        )
        assert "gptqmodel" in capsys.readouterr().err
        assert not (tmp_path / "gptq").exists()
        return
    out = quantize_optimum_gptq(tmp_path / "model", tmp_path / "gptq", [ids()], architecture="mixtral")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(out, device_map="cuda")
    assert not [n for n, m in hf.named_modules() if type(m) is torch.nn.Linear and ".experts." in n]


@pytest.mark.parametrize("case, large", [("ours", False), ("olmoe", False), ("olmoe", True)])
def test_round_to_nearest_quantizes_a_model_directory_while_it_streams_in(tmp_path, monkeypatch, case, large):
    """``moe-lab quantize`` (round to nearest) of a model directory quantizes each expert slice as it streams in,
    as QLoRA's base loads: it merged nothing and built the whole full-precision model first (19.3 GiB for the
    12.9 GiB OLMoE-1B-7B; a model larger than memory could not be quantized). The output is the one quantizing
    the loaded model gives: the same codes, scales, other weights, config and report."""
    from safetensors.torch import load_file

    from moe_core import load
    from moe_core.finetune import sizing
    from moe_core.inference.quantize import weight_only
    from tests.test_mmap_base import write_checkpoint

    source = write_checkpoint(tmp_path / "source", case, torch.bfloat16)
    config = QuantConfig(bits=4, group_size=16)
    if (
        large
    ):  # above 1 B parameters (here 1,000) the command reads the stored dtype: the report counts its bytes
        monkeypatch.setattr(sizing, "LARGE_MODEL_PARAMS", 1000)
    loaded = load(source, dtype=None if large else torch.float32)  # as the command reads the model
    reference = quantize_experts(loaded.model, config)
    save_quantized(loaded.model, tmp_path / "reference", config, reference, companions_from=source)

    def never(*args, **kwargs):
        raise AssertionError("the full-precision model was loaded")

    monkeypatch.setattr(weight_only, "load", never)
    report = weight_only.quantize_checkpoint(source, tmp_path / "streamed", config)
    assert report.to_dict() == reference.to_dict()
    ours, theirs = (load_file(tmp_path / d / "model.safetensors") for d in ("streamed", "reference"))
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    for file in ("config.json", "quantization.json"):
        assert (tmp_path / "streamed" / file).read_text() == (tmp_path / "reference" / file).read_text()


@pytest.mark.parametrize("case, method", [("ours", "gptq"), ("olmoe", "gptq"), ("olmoe", "awq")])
def test_calibrated_quantization_of_a_large_model_directory_reads_it_memory_mapped(
    tmp_path, monkeypatch, case, method
):
    """``moe-lab quantize --method gptq|awq`` of a large model directory runs its calibration pass on the
    memory-mapped model and reads each expert slice from the file as it quantizes it, one module at a time: it
    had loaded the whole model (26.7 GiB for Qwen1.5-MoE-A2.7B: more than the 24 GiB machine holds) and then held
    every module's int8 codes beside it. The output is the one quantizing the loaded model gives."""
    from safetensors.torch import load_file

    from moe_core import load
    from moe_core.finetune import sizing
    from moe_core.inference.quantize import weight_only
    from moe_core.mapped import MappedExperts
    from tests.test_mmap_base import write_checkpoint

    source = write_checkpoint(tmp_path / "source", case, torch.bfloat16)
    monkeypatch.setattr(sizing, "LARGE_MODEL_PARAMS", 1000)  # read in the stored dtype, as a 1 B+ model is
    config = QuantConfig(bits=4, group_size=16, method=method, min_tokens=8)
    torch.manual_seed(1)
    calibration = [ids(4, 16) for _ in range(2)]
    loaded = load(source)
    assert not any(isinstance(m, MappedExperts) for m in loaded.model.modules())
    reference = quantize_experts(loaded.model, config, calibration)
    save_quantized(loaded.model, tmp_path / "reference", config, reference, companions_from=source)

    loads, released = [], []

    def recording(*args, **kwargs):
        loads.append(kwargs.get("memory_map"))
        return load(*args, **kwargs)

    def never(*args, **kwargs):
        raise AssertionError("a memory-mapped module was stacked into memory")

    monkeypatch.setattr(weight_only, "load", recording)
    monkeypatch.setattr(weight_only, "release_pages", lambda tensors: released.append(len(list(tensors))))
    monkeypatch.setattr(MappedExperts, "stacks", never)
    monkeypatch.setattr(MappedExperts, "densified", never)
    report = weight_only.quantize_checkpoint(source, tmp_path / "mapped", config, calibration)
    monkeypatch.undo()
    assert loads == [True]
    if case != "ours":  # per-expert tensors of the file (ours are stacks, views of it): each expert's three
        # slices out of the resident set once quantized
        experts = loaded.model.config.num_experts * len(loaded.model.config.moe_layer_ids)
        assert released == [3] * experts
    assert report.to_dict() == reference.to_dict()
    ours, theirs = (load_file(tmp_path / d / "model.safetensors") for d in ("mapped", "reference"))
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
