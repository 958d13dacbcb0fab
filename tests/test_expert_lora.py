"""LoRA on the expert stacks, computed on the routed tokens (`moe_core.finetune.expert_lora`), against PEFT's own
``ParamWrapper`` forward (a dense delta per stack): equal outputs and gradients, the same adapter on disk, PEFT's
switches honoured, and no [E, O, I] tensor formed in the forward."""

import contextlib

import pytest
import torch
from peft import LoraConfig, PeftModel
from peft.tuners.lora import layer as peft_lora
from safetensors.torch import load_file

from moe_core.experts import PROJECTIONS, ExpertLoRA, StackedExperts
from moe_core.finetune import FinetuneConfig, expert_lora
from moe_core.finetune.export import merged_model
from moe_core.finetune.methods import apply_lora, apply_method
from tests.finetune_helpers import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

LORA = {"lora": {"r": 4, "alpha": 8.0, "experts": "all", "attention": ["q_proj", "v_proj"]}}


def randomize_lora(model, seed: int = 1) -> None:
    """Non-zero factors everywhere (PEFT initializes B to zero, which would hide every difference)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)


def adapted_pair(preset: str = "mixtral-tiny", selection=None, **overrides):
    """The same base model and factors, wrapped with our forward and with PEFT's."""
    config = FinetuneConfig.build(LORA)
    selection = selection or {
        layer: list(range(4)) for layer in tiny_model(preset, **overrides).config.moe_layer_ids
    }
    ours, _ = apply_lora(tiny_model(preset, **overrides), config, selection)
    peft, _ = apply_lora(tiny_model(preset, **overrides), config, selection, routed=False)
    randomize_lora(ours)
    randomize_lora(peft)
    return ours, peft


def lora_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("preset", ["mixtral-tiny", "switch-tiny"])
@pytest.mark.parametrize("impl", ["reference", "sorted", "grouped_mm", "static", "gather"])
def test_routed_lora_equals_peft_in_forward_and_backward(preset, impl):
    top_k = {"num_experts_per_tok": 1, "router_jitter": 0.0} if preset == "switch-tiny" else {}
    ours, peft = adapted_pair(preset, expert_impl=impl, **top_k)
    assert isinstance(ours.base_model.model.model.layers[0].mlp.experts, expert_lora.ParamWrapper)
    assert type(peft.base_model.model.model.layers[0].mlp.experts) is peft_lora.ParamWrapper
    x = torch.randint(0, 300, (3, 10))
    for model in (ours, peft):
        model(input_ids=x, labels=x).loss.backward()
    torch.testing.assert_close(ours(input_ids=x).logits, peft(input_ids=x).logits, atol=1e-5, rtol=1e-5)
    ours_grads, peft_grads = lora_grads(ours), lora_grads(peft)
    assert ours_grads.keys() == peft_grads.keys()
    assert any(".experts." in n for n in ours_grads)
    for name, grad in ours_grads.items():
        torch.testing.assert_close(grad, peft_grads[name], atol=1e-5, rtol=1e-5, msg=name)


def test_the_adapter_on_disk_is_peft_s_and_stock_peft_loads_it(tmp_path):
    ours, peft = adapted_pair()
    ours.save_pretrained(tmp_path / "ours")
    peft.save_pretrained(tmp_path / "peft")
    saved = load_file(tmp_path / "ours" / "adapter_model.safetensors")
    reference = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert saved.keys() == reference.keys()
    for key in saved:
        assert saved[key].shape == reference[key].shape, key
    assert any("experts.base_layer.base_layer.lora_A" in k for k in saved)  # three nested projections
    # stock PEFT (its own ParamWrapper forward) on a fresh base gives our logits
    stock = PeftModel.from_pretrained(tiny_model(), tmp_path / "ours")
    assert type(stock.base_model.model.model.layers[0].mlp.experts) is peft_lora.ParamWrapper
    x = torch.randint(0, 300, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(stock(input_ids=x).logits, ours(input_ids=x).logits, atol=1e-5, rtol=1e-5)


def test_disable_adapter_runs_the_base_and_merging_applies_the_update_once():
    base = tiny_model()
    ours, _ = adapted_pair()
    x = torch.randint(0, 300, (2, 9))
    with torch.no_grad():
        plain = base(input_ids=x).logits
        adapted = ours(input_ids=x).logits
        assert not torch.allclose(adapted, plain, atol=1e-3)
        with ours.disable_adapter():  # the DPO reference forward
            torch.testing.assert_close(ours(input_ids=x).logits, plain, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(ours(input_ids=x).logits, adapted)
        ours.merge_adapter()  # merged: the wrappers must not add the update a second time
        torch.testing.assert_close(ours(input_ids=x).logits, adapted, atol=1e-5, rtol=1e-5)
        ours.unmerge_adapter()
        torch.testing.assert_close(ours(input_ids=x).logits, adapted, atol=1e-5, rtol=1e-5)
        merged = merged_model(ours)
        torch.testing.assert_close(merged(input_ids=x).logits, adapted, atol=1e-5, rtol=1e-5)


def test_two_active_adapters_add_up():
    ours, peft = adapted_pair()
    for model in (ours, peft):
        model.add_adapter("second", model.peft_config["default"])
    randomize_lora(ours, seed=7)
    peft.load_state_dict(ours.state_dict())
    x = torch.randint(0, 300, (2, 9))
    with torch.no_grad():
        for model in (ours, peft):
            model.base_model.set_adapter(["default", "second"])
        torch.testing.assert_close(ours(input_ids=x).logits, peft(input_ids=x).logits, atol=1e-5, rtol=1e-5)


def test_the_forward_forms_no_expert_sized_tensor():
    """What autograd keeps for backward, other than the weights themselves, is never held in storage the size
    of a whole [E, O, I] stack: PEFT's forward keeps one adapted stack per projection."""

    def largest_saved(model) -> int:
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        largest = 0

        def pack(t):
            nonlocal largest
            if t.untyped_storage().data_ptr() not in weights:
                largest = max(largest, t.untyped_storage().nbytes() // t.element_size())
            return t

        x = torch.randint(0, 300, (1, 6))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=x, labels=x).loss.backward()
        return largest

    overrides = dict(num_experts=16, expert_intermediate_size=64, hidden_size=64, expert_impl="sorted")
    selection = {layer: list(range(16)) for layer in (0, 1)}
    config = FinetuneConfig.build(LORA)
    ours, _ = apply_lora(tiny_model(**overrides), config, selection)
    peft, _ = apply_lora(tiny_model(**overrides), config, selection, routed=False)
    stack = 16 * 64 * 64
    assert largest_saved(peft) >= stack  # the dense delta (so the probe sees what it should)
    assert largest_saved(ours) < stack // 8


def test_esft_style_subset_keeps_other_experts_at_zero_on_the_routed_path():
    config = FinetuneConfig.build(
        {"lora": {"r": 2, "experts": "list", "expert_ids": {0: [1], 1: [0, 3]}, "attention": []}}
    )
    model, plan = apply_method(tiny_model(), config)
    assert isinstance(model.base_model.model.model.layers[0].mlp.experts, expert_lora.ParamWrapper)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-2)
    x = torch.randint(0, 300, (4, 12))
    for _ in range(3):
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    wrapper = model.base_model.model.model.layers[0].mlp.experts
    B_EOR, A_ERI, _ = wrapper.get_delta_factors("default")
    assert A_ERI[1].abs().sum() > 0 and B_EOR[1].abs().sum() > 0
    for e in (0, 2, 3):
        assert A_ERI[e].abs().sum() == 0 and B_EOR[e].abs().sum() == 0


def test_a_rank_grouped_mm_cannot_take_falls_back_to_the_sorted_path():
    experts = tiny_model(expert_impl="grouped_mm").model.layers[0].mlp.experts
    x_TD = torch.randn(8, 32)
    gen = torch.Generator().manual_seed(0)
    lora = ExpertLoRA(
        {
            p: ((torch.randn(4, 3, 32, generator=gen), torch.randn(4, 32, 3, generator=gen), 0.5),)
            for p in PROJECTIONS
        }
    )
    assert not experts.grouped_mm_ok(x_TD, lora)  # rank 3 in fp32: 12-byte rows
    record = tiny_model().model.layers[0].mlp.router(x_TD)
    torch.testing.assert_close(
        experts(x_TD, record, impl="grouped_mm", lora=lora),
        experts(x_TD, record, impl="reference", lora=lora),
        atol=1e-5,
        rtol=1e-5,
    )


def test_peft_seam():
    """What `moe_core.finetune.expert_lora` relies on in PEFT (0.21): fails loudly on an upgrade that moves it."""
    assert callable(getattr(LoraConfig, "_register_custom_module", None))
    for member in ("get_delta_factors", "get_delta_weight", "merge", "unmerge", "_check_forward_args"):
        assert callable(getattr(peft_lora.ParamWrapper, member, None)), member
    model, _ = apply_lora(tiny_model(), FinetuneConfig.build(LORA), {0: [0, 1], 1: [2]})
    wrapper = model.base_model.model.model.layers[0].mlp.experts
    nest = wrapper.nest()
    assert [w.parameter_name for w in nest] == ["down_proj", "up_proj", "gate_proj"]
    assert isinstance(nest[-1].base_layer, StackedExperts)
    assert all(w._did_swap_in_out_features for w in nest)  # [E, out, in] stacks read as such
    E, F_, D = nest[0].get_base_layer().down_proj.shape
    B_EOR, A_ERI, scale = nest[0].get_delta_factors("default")
    assert B_EOR.shape == (E, F_, 4) and A_ERI.shape == (E, 4, D) and scale == 2.0
    torch.testing.assert_close(nest[0].get_delta_weight("default"), scale * B_EOR @ A_ERI)
    # our own views of the factors (not cast to the stack's dtype) read PEFT's layout as it does
    ours_A, ours_B, ours_scale = nest[0].factors("default")
    assert torch.equal(ours_A, A_ERI) and torch.equal(ours_B, B_EOR) and ours_scale == scale
    # QuantizedLinearLoRA: PEFT's LoRA Linear over a layer it does not know, found by its in/out features and,
    # for the device, its ``qweight``; PEFT still takes no other layer type for it
    from peft.tuners.tuners_utils import _get_in_out_features

    from moe_core.finetune.expert_lora import QuantizedLinearLoRA
    from moe_core.quantized import QuantConfig, QuantizedLinear

    codes = QuantizedLinear(32, 16, QuantConfig(bits=4, group_size=8))
    with pytest.warns(UserWarning, match="Unsupported layer type"):
        assert _get_in_out_features(codes) == (32, 16)
    lora = QuantizedLinearLoRA(codes, "default", config=LoraConfig(r=4), r=4, lora_alpha=8)
    assert lora.lora_A["default"].weight.shape == (4, 32) and lora.lora_B["default"].weight.shape == (16, 4)
    assert callable(getattr(peft_lora.Linear, "get_delta_weight", None))


def test_an_added_adapter_reaches_the_injected_expert_wrappers():
    """PEFT 0.21's ``PeftModel.add_adapter`` looks for a target stack as an ``nn.Parameter`` and so misses the
    wrappers `expert_lora.inject` nests over 4-bit or memory-mapped experts (with a warning that nothing matched);
    TRL 1.16's DPO and KTO trainers add their reference that way (a frozen copy "ref" of the adapter).
    `expert_lora.add_adapter` gives every wrapper the adapter as PEFT gives one it found; the stock method still
    misses them (when it stops missing them, `adapters_reach_injected_experts` can go)."""
    import inspect

    from trl import DPOTrainer, KTOTrainer

    from moe_core.inference.quantize import quantize_experts
    from moe_core.quantized import QuantConfig

    def quantized_peft_model():
        model = tiny_model()
        quantize_experts(model, QuantConfig(bits=4, group_size=16))
        return apply_lora(model, FinetuneConfig.build(LORA), {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]})[0]

    def expert_wrappers(model):
        return [m for m in model.modules() if isinstance(m, expert_lora.ParamWrapper)]

    stock = quantized_peft_model()
    with pytest.warns(RuntimeWarning, match=expert_lora.UNMATCHED_WARNING):
        stock.add_adapter("ref", stock.peft_config["default"])
    assert all("ref" not in w.lora_A for w in expert_wrappers(stock))
    assert "ref" in stock.base_model.model.model.layers[0].self_attn.q_proj.lora_A

    ours = quantized_peft_model()
    with expert_lora.adapters_reach_injected_experts(ours) as model:
        model.add_adapter("ref", model.peft_config["default"])  # as TRL calls it
    assert "add_adapter" not in vars(ours)  # the class's method again
    wrappers = expert_wrappers(ours)
    assert len(wrappers) == 2 * 3
    for wrapper in wrappers:
        for factor in ("lora_A", "lora_B"):
            default, ref = getattr(wrapper, factor)["default"].weight, getattr(wrapper, factor)["ref"].weight
            assert ref.shape == default.shape and ref.dtype == default.dtype and not ref.requires_grad
        assert wrapper.scaling["ref"] == wrapper.scaling["default"]
    for trainer in (DPOTrainer, KTOTrainer):
        assert 'model.add_adapter("ref", default_config)' in inspect.getsource(trainer.__init__)


@pytest.fixture
def transposed_layout(monkeypatch):
    """The transposed input gradient (what `input_gradient_layout` measures as the fast one on AVX2 CPUs), on
    whatever CPU runs the test."""
    from moe_core import frozen_linear as module

    monkeypatch.setattr(
        module, "INPUT_GRADIENT_LAYOUT", {torch.bfloat16: "transposed", torch.float16: "transposed"}
    )


def test_the_low_precision_cpu_input_gradient_equals_autograd_s(transposed_layout):
    """`frozen_linear`'s backward (bf16 on CPU: dY W computed as linear(dY, W^T) on a transposed copy) gives
    autograd's input gradient; a weight that trains keeps autograd's own path."""
    from moe_core.experts import frozen_linear

    torch.manual_seed(0)
    w = torch.randn(48, 64)
    x = torch.randn(5, 64, requires_grad=True)
    grad = torch.randn(5, 48)
    torch.nn.functional.linear(x, w).backward(grad)
    expected = x.grad.clone()
    x_bf16 = x.detach().bfloat16().requires_grad_()
    out = frozen_linear(x_bf16, w.bfloat16())
    assert out.grad_fn is not None and "FrozenLinear" in type(out.grad_fn).__name__
    out.backward(grad.bfloat16())
    torch.testing.assert_close(x_bf16.grad.float(), expected, atol=0.1, rtol=0.02)
    trainable = w.bfloat16().requires_grad_()
    assert "FrozenLinear" not in type(frozen_linear(x_bf16, trainable).grad_fn).__name__


def test_where_the_cpu_s_own_product_is_fast_the_frozen_path_is_plain_autograd(monkeypatch):
    """On a CPU with native bf16 (AVX-512 BF16 / AMX) autograd's ``dY @ W`` beats making the transposed copy 7-11x
    (the copy had made a Qwen3-MoE LoRA step 3x slower than transformers + PEFT's): there `frozen_linear` is
    ``F.linear``, no Linear is swapped, and QLoRA's recomputed weight takes the direct product too."""
    from moe_core import frozen_linear as module

    monkeypatch.setattr(module, "INPUT_GRADIENT_LAYOUT", {torch.bfloat16: "direct"})
    torch.manual_seed(0)
    w, x = torch.randn(48, 64).bfloat16(), torch.randn(5, 64).bfloat16().requires_grad_()
    out = module.frozen_linear(x, w)
    assert "FrozenLinear" not in type(out.grad_fn).__name__
    assert module.use_frozen_linears(tiny_model().bfloat16()) == 0
    grad = torch.randn(5, 48).bfloat16()
    module.recomputed_linear(x, lambda: w).backward(grad)
    torch.testing.assert_close(x.grad, grad @ w)


def test_the_input_gradient_layout_is_measured_once_per_dtype(monkeypatch):
    from moe_core import frozen_linear as module

    monkeypatch.setattr(module, "INPUT_GRADIENT_LAYOUT", {})
    torch.manual_seed(0)
    layout = module.input_gradient_layout(torch.bfloat16)
    after = torch.rand(4)
    torch.manual_seed(0)
    assert torch.equal(after, torch.rand(4))  # the measurement draws nothing from the caller's random stream
    assert layout in ("direct", "transposed") and module.INPUT_GRADIENT_LAYOUT == {torch.bfloat16: layout}
    monkeypatch.setattr(module.time, "perf_counter", None)  # a second measurement would fail
    assert module.input_gradient_layout(torch.bfloat16) == layout


def test_bf16_lora_on_cpu_swaps_the_frozen_linears_and_trains_the_same(transposed_layout):
    """`use_frozen_linears` (applied by apply_lora to a bf16 model on CPU) changes no output and no adapter
    gradient beyond bf16 rounding; the state dict keeps its names."""
    from moe_core.frozen_linear import FrozenLinear, use_frozen_linears

    config = FinetuneConfig.build(LORA)
    selection = {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}
    swapped, _ = apply_lora(tiny_model().bfloat16(), config, selection)
    assert any(isinstance(m, FrozenLinear) for m in swapped.modules())
    plain = tiny_model().bfloat16()
    keys = set(plain.state_dict())
    assert use_frozen_linears(tiny_model()) == 0  # fp32: autograd's own kernels are fast
    randomize_lora(swapped)
    # the same adapter on a model left as it is: PEFT's wrapping of plain Linear layers
    from peft import get_peft_model

    reference = get_peft_model(plain, swapped.peft_config["default"])
    reference.load_state_dict(swapped.state_dict())
    assert not any(isinstance(m, FrozenLinear) for m in reference.modules())
    assert (
        set(swapped.base_model.model.state_dict()) - keys
        == set(reference.base_model.model.state_dict()) - keys
    )
    x = torch.randint(0, 300, (2, 9))
    for model in (swapped, reference):
        model(input_ids=x, labels=x).loss.backward()
    with torch.no_grad():
        torch.testing.assert_close(swapped(input_ids=x).logits, reference(input_ids=x).logits)
    grads = {n: p.grad.float() for n, p in swapped.named_parameters() if p.requires_grad}
    for name, param in reference.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(grads[name], param.grad.float(), atol=2e-2, rtol=5e-2, msg=name)


@contextlib.contextmanager
def kept_by_autograd(*inputs: torch.Tensor):
    """{storage: bytes} of what autograd saves for backward inside the block, apart from ``inputs``' storages."""
    own = {t.untyped_storage().data_ptr() for t in inputs}
    kept: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in own:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield kept


def test_the_low_rank_delta_equals_peft_s_products_and_keeps_no_up_cast_activations():
    """`low_rank_delta` (fp32 factors, bf16 activations: a fine-tune of a bf16 base) gives the outputs and
    gradients of PEFT's LoRA layer (``x`` cast to the factors' dtype, the result cast back) bitwise, and keeps for
    backward only ``u = x A^T`` beside its inputs: autograd on the same products keeps the fp32 copy of ``x``."""
    from moe_core.experts import low_rank_delta

    N, I, O, R, scale = 5, 64, 32, 8, 2.0

    def run(fn):
        x = torch.randn(N, I, generator=torch.Generator().manual_seed(1)).bfloat16().requires_grad_()
        A = torch.randn(R, I, generator=torch.Generator().manual_seed(2)).requires_grad_()
        B = torch.randn(O, R, generator=torch.Generator().manual_seed(3)).requires_grad_()
        with kept_by_autograd(x, A, B) as kept:
            y = fn(x, A, B)
        y.float().square().sum().backward()
        return y, x.grad, A.grad, B.grad, sum(kept.values())

    linear = torch.nn.functional.linear
    *ours, ours_kept = run(lambda x, A, B: low_rank_delta(x, A, B, scale))
    *peft, peft_kept = run(lambda x, A, B: (linear(linear(x.float(), A), B) * scale).bfloat16())
    for got, want in zip(ours, peft):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert ours_kept == N * R * 4  # u, in fp32
    assert peft_kept >= ours_kept + N * I * 4  # the test can fail: autograd keeps x in fp32


def test_the_per_expert_loop_keeps_no_copy_of_b_for_backward():
    """`ExpertLoRA.unbound` copies each B stack contiguous for the forward's per-expert reads; autograd used to
    keep that copy from every layer's forward to its backward (0.22 GiB at Qwen1.5-MoE-A2.7B's full size).
    Now only views of the parameters are kept, and the gradients are those of plain autograd on the parameter (to
    the last bits of fp32: the BLAS may sum the same products in another order)."""
    from moe_core.experts import ExpertLoRA

    E, N, I, O, R, scale = 6, 4, 32, 48, 8, 2.0
    g = torch.Generator().manual_seed(0)
    A_param = torch.randn(E * R, I, generator=g).requires_grad_()  # PEFT's ParamWrapper layouts
    B_param = torch.randn(O, E * R, generator=g).requires_grad_()
    xs = [torch.randn(N, I, generator=g).bfloat16() for _ in range(E)]

    def factors():
        return ExpertLoRA(
            {"up_proj": ((A_param.view(E, R, I), B_param.view(O, R, E).permute(2, 0, 1), scale),)}
        )

    with kept_by_autograd(A_param, B_param, *xs) as kept:
        views = factors().unbound()
        deltas = [ExpertLoRA.delta(views, "up_proj", e, x) for e, x in enumerate(xs)]
        del views
    sum(d.float().square().sum() for d in deltas).backward()
    ours = A_param.grad.clone(), B_param.grad.clone()
    assert sum(kept.values()) == E * N * R * 4  # each expert's u = x A^T in fp32, and nothing else

    A_param.grad = B_param.grad = None
    A_ERI, B_EOR, _ = factors().factors["up_proj"][0]
    linear = torch.nn.functional.linear
    sum(
        (linear(linear(x.float(), A_ERI[e]), B_EOR[e]) * scale).bfloat16().float().square().sum()
        for e, x in enumerate(xs)
    ).backward()
    # the same products in fp32: bitwise on the AVX-512 BF16 / AMX Xeon, a few units in the last place apart on an
    # AMD EPYC, whose BLAS sums autograd's (u^T g)^T and our g^T u in another order (0.001 on values of ~1,400)
    for got, want in zip(ours, (A_param.grad, B_param.grad)):
        ulps = 16 * torch.finfo(torch.float32).eps * want.abs().max().item()
        torch.testing.assert_close(got, want, atol=ulps, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_sorted_path_under_lora_is_the_per_expert_reference_bitwise_with_one_node_per_projection(dtype):
    """With gradients, the sorted path runs projection by projection, each projection's LoRA delta for every
    expert in one autograd node (`_SortedLowRankDelta`), where the per-expert loop made one per expert and
    projection and autograd stacked their factor gradients. The logits and every LoRA gradient are the
    reference path's (the per-expert loop) to the bit."""
    x = torch.randint(0, 300, (3, 10), generator=torch.Generator().manual_seed(0))
    results = {}
    for impl in ("reference", "sorted"):
        ours, _ = adapted_pair("mixtral-tiny", expert_impl=impl)
        ours = ours.to(dtype)
        out = ours(input_ids=x, labels=x)
        nodes, seen, stack = [], set(), [out.loss.grad_fn]
        while stack:  # the autograd graph's node names
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            nodes.append(type(node).__name__)
            stack.extend(next_node for next_node, _ in node.next_functions)
        out.loss.backward()
        results[impl] = out.logits.detach(), lora_grads(ours), nodes
    (ref_logits, ref_grads, ref_nodes), (logits, grads, nodes) = results["reference"], results["sorted"]
    assert torch.equal(logits, ref_logits)
    assert grads.keys() == ref_grads.keys() and any(".experts." in n for n in grads)
    for name, grad in grads.items():
        assert torch.equal(grad, ref_grads[name]), name
    layers, projections = 2, 3  # mixtral-tiny: two MoE layers of SwiGLU experts, every projection adapted
    assert nodes.count("_SortedLowRankDeltaBackward") == layers * projections
    assert (
        "_LowRankDeltaBackward" not in nodes
        and ref_nodes.count("_LowRankDeltaBackward") > layers * projections
    )


@pytest.mark.parametrize("tokens", [1, 3])
def test_the_decode_path_under_lora_equals_the_reference(tokens, monkeypatch):
    """The few-slot decode path (`StackedExperts.forward_decode`, what generation runs on an adapter loaded
    unmerged, `moe_core.finetune.as_trained`) applies every chosen expert's LoRA: the reference path's outputs."""
    ours, _ = adapted_pair("mixtral-tiny", expert_impl="reference")
    ours.eval()
    stacks = [m for m in ours.modules() if isinstance(m, StackedExperts)]
    x = torch.randint(0, 300, (1, tokens), generator=torch.Generator().manual_seed(0))
    decode_calls = []
    forward_decode = StackedExperts.forward_decode

    def counted(self, x_TD, record, lora=None):
        decode_calls.append(lora is not None)
        return forward_decode(self, x_TD, record, lora)

    monkeypatch.setattr(StackedExperts, "forward_decode", counted)
    with torch.no_grad():
        reference = ours(input_ids=x).logits
        assert decode_calls == []
        for m in stacks:
            m.impl, m.max_slots = "sorted", 64
        decoded = ours(input_ids=x).logits
    assert decode_calls == [True] * len(stacks)  # every MoE layer decoded, with its LoRA
    torch.testing.assert_close(decoded, reference, atol=1e-6, rtol=1e-6)
