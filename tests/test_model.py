"""The model: fast paths equal the reference, presets build, save/load and generation round-trip."""

import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from moe_core import MoEConfig, MoEForCausalLM, dense_baseline, get_config, parameter_counts
from moe_core.config import PRESETS
from moe_core.model import MoEBlock

IMPLS = ("sorted", "grouped_mm", "static", "gather")


def seeded_block(config):
    torch.manual_seed(0)
    block = MoEBlock(config)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return block


def forward_backward(block, x, impl):
    block.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    with torch.random.fork_rng():  # the same router jitter (Switch's default) for every path compared
        torch.manual_seed(1)
        y, record = block(x, impl)
    # a non-uniform upstream gradient, so that every weight's gradient is exercised
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    grads = {name: p.grad.clone() for name, p in block.named_parameters() if p.grad is not None}
    return y.detach(), x.grad, grads


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "preset,overrides",
    [
        ("mixtral-tiny", {}),
        ("switch-tiny", {}),  # top-1, GELU experts, capacity with drops
        ("olmoe-tiny", {}),
        ("shared-tiny", {}),
        ("mixtral-tiny", {"router": "expert_choice"}),
        ("mixtral-tiny", {"capacity_factor": 0.5}),
        ("mixtral-tiny", {"router": "aux_free", "router_score": "sigmoid"}),
    ],
)
def test_fast_paths_equal_the_reference_loop_forward_and_backward(preset, overrides, impl):
    config = get_config(preset, **overrides)
    block = seeded_block(config)
    x = torch.randn(3, 11, config.hidden_size)
    y_ref, dx_ref, grads_ref = forward_backward(block, x, "reference")
    y, dx, grads = forward_backward(block, x, impl)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dx, dx_ref, atol=1e-5, rtol=1e-5)
    assert grads.keys() == grads_ref.keys()
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], atol=1e-5, rtol=1e-5, msg=name)


def test_dropped_tokens_pass_through_the_residual_only():
    config = get_config("switch-tiny", capacity_factor=0.25, num_hidden_layers=1)
    block = seeded_block(config)
    x = torch.randn(1, 32, config.hidden_size)
    y, record = block(x)
    dropped = record.dropped_tokens_T
    assert dropped.any()
    assert torch.count_nonzero(y.view(32, -1)[dropped]) == 0  # the block adds nothing for them


@pytest.mark.parametrize("num_experts,k", [(8, 2), (32, 4), (128, 8)])
def test_8_to_128_experts_work(num_experts, k):
    config = get_config(
        "olmoe-tiny", num_experts=num_experts, num_experts_per_tok=k, expert_intermediate_size=16
    )
    model = MoEForCausalLM(config)
    x = torch.randint(0, config.vocab_size, (2, 12))
    out = model(x, labels=x, output_routing=True)
    out.loss.backward()
    assert all(r.tokens_per_expert_E.sum() == 24 * k for r in out.routing)
    assert model.model.layers[0].mlp.experts.up_proj.grad.shape[0] == num_experts


@pytest.mark.parametrize("preset", [p for p in PRESETS if p.endswith("-tiny")])
def test_every_tiny_preset_trains_one_step_and_counts_its_parameters(preset):
    config = get_config(preset)
    model = MoEForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == parameter_counts(config)["total"]
    x = torch.randint(0, config.vocab_size, (2, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(3):
        out = model(x, labels=x)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.lm_loss.item())
    assert losses[-1] < losses[0]
    if config.num_experts:
        assert out.aux_loss is not None and out.z_loss is not None
        layers = len(config.moe_layer_ids) if config.router_loss_reduction == "sum" else 1  # Switch: summed
        expected = out.lm_loss + layers * (
            config.router_aux_loss_coef * out.aux_loss + config.router_z_loss_coef * out.z_loss
        )
        torch.testing.assert_close(out.loss, expected)
    else:
        assert out.aux_loss is None and torch.equal(out.loss, out.lm_loss)


def test_dense_baselines_match_active_and_total_parameters():
    config = get_config("mixtral-small")
    counts = parameter_counts(config)
    active, total = dense_baseline(config, "active"), dense_baseline(config, "total")
    router_params = config.num_hidden_layers * config.hidden_size * config.num_experts
    assert parameter_counts(active)["total"] == counts["active"] - router_params
    assert parameter_counts(total)["total"] == counts["total"] - router_params
    assert active.num_experts == 0 and active.intermediate_size == 2 * config.expert_intermediate_size
    with pytest.raises(ValueError, match="already dense"):
        dense_baseline(active)


def test_moe_every_n_and_dense_layers():
    config = get_config("mixtral-tiny", num_hidden_layers=4, moe_every_n=2, dense_layers=[3])
    assert config.moe_layer_ids == [1]
    model = MoEForCausalLM(config)
    assert [layer.is_moe for layer in model.model.layers] == [False, True, False, False]


def test_save_pretrained_round_trip_through_auto_classes(tmp_path):
    config = get_config("olmoe-tiny", router="aux_free", router_bias_update_rate=0.01)
    model = MoEForCausalLM(config).eval()
    with torch.no_grad():
        model.routers()[0].expert_bias.uniform_(-1, 1)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    assert AutoConfig.from_pretrained(tmp_path).model_type == "moe_lab"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, MoEForCausalLM)
    x = torch.randint(0, config.vocab_size, (2, 10))
    torch.testing.assert_close(loaded(x).logits, model(x).logits, atol=0, rtol=0)
    torch.testing.assert_close(loaded.routers()[0].expert_bias, model.routers()[0].expert_bias)
    assert loaded.config.to_dict()["router"] == "aux_free"


def test_old_config_without_new_fields_still_loads(tmp_path):
    config = get_config("mixtral-tiny").to_dict()
    for key in ("router_bias_update_rate", "expert_impl", "hf_origin", "dense_layers"):
        config.pop(key)
    assert MoEConfig(**config).expert_impl == "auto"


@pytest.mark.parametrize("preset", ["mixtral-tiny", "olmoe-tiny", "shared-tiny", "switch-tiny", "dense-tiny"])
def test_generation_with_kv_cache_equals_generation_without(preset):
    config = get_config(preset, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    model = MoEForCausalLM(config).eval()
    prompt = torch.randint(1, config.vocab_size, (2, 7))
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    with_cache = model.generate(prompt, use_cache=True, **kwargs)
    without = model.generate(prompt, use_cache=False, **kwargs)
    assert with_cache.shape == (2, 19)
    assert torch.equal(with_cache, without)


def test_incremental_decoding_logits_equal_full_forward():
    config = get_config("mixtral-tiny")
    model = MoEForCausalLM(config).eval()
    x = torch.randint(0, config.vocab_size, (2, 12))
    full = model(x).logits
    out = model(x[:, :8], use_cache=True)
    steps = [out.logits]
    cache = out.cache
    for t in range(8, 12):
        out = model(x[:, t : t + 1], cache=cache, use_cache=True)
        cache = out.cache
        steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_left_padded_batch_generates_like_each_prompt_alone():
    config = get_config("mixtral-tiny", eos_token_id=None, pad_token_id=0)
    torch.manual_seed(1)
    model = MoEForCausalLM(config).eval()
    short = torch.randint(1, config.vocab_size, (1, 4))
    long = torch.randint(1, config.vocab_size, (1, 9))
    batch = torch.cat([torch.cat([torch.zeros(1, 5, dtype=torch.long), short], 1), long])
    mask = (batch != 0).long()
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    batched = model.generate(batch, attention_mask=mask, **kwargs)
    alone_short = model.generate(short, **kwargs)
    alone_long = model.generate(long, **kwargs)
    assert torch.equal(batched[0, 5:], alone_short[0])
    assert torch.equal(batched[1], alone_long[0])


def test_gradient_checkpointing_gives_the_same_gradients_including_aux_loss():
    config = get_config("mixtral-tiny", router_aux_loss_coef=1.0)
    torch.manual_seed(0)
    model = MoEForCausalLM(config).train()
    x = torch.randint(0, config.vocab_size, (2, 16))

    def grads():
        model.zero_grad()
        model(x, labels=x).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain = grads()
    model.activation_checkpointing_enable()
    checkpointed = grads()
    assert model.model.gradient_checkpointing
    router_grad = "model.layers.0.mlp.router.gate.weight"
    assert plain[router_grad].abs().sum() > 0
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], msg=name)


def test_router_math_stays_fp32_under_bf16_autocast():
    config = get_config("mixtral-tiny")
    model = MoEForCausalLM(config)
    x = torch.randint(0, config.vocab_size, (2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x, labels=x, output_routing=True)
    record = out.routing[0]
    assert record.logits_TE.dtype == record.probs_TE.dtype == record.weights_TK.dtype == torch.float32
    out.loss.backward()


def test_static_path_exports_with_torch_export():
    """The export-friendly path has no data-dependent shapes, so torch.export traces it whole."""
    config = get_config("mixtral-tiny", expert_impl="static", use_cache=False)
    model = MoEForCausalLM(config).eval()
    x = torch.randint(0, config.vocab_size, (1, 8))
    exported = torch.export.export(model, (x,), kwargs={"use_cache": False}, strict=False)
    other = torch.randint(0, config.vocab_size, (1, 8))
    torch.testing.assert_close(exported.module()(other, use_cache=False).logits, model(other).logits)


def test_peft_lora_reaches_attention_and_every_expert_weight():
    from peft import LoraConfig, get_peft_model

    config = get_config("mixtral-tiny")
    model = MoEForCausalLM(config).eval()
    x = torch.randint(0, config.vocab_size, (2, 8))
    base_logits = model(x).logits
    lora = LoraConfig(
        r=4,
        target_modules=["q_proj", "v_proj"],
        target_parameters=["experts.gate_proj", "experts.up_proj", "experts.down_proj"],
    )
    peft_model = get_peft_model(model, lora)
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert any("q_proj.lora_A" in n for n in trainable)
    assert sum("mlp.experts" in n and "lora_A" in n for n in trainable) == 3 * config.num_hidden_layers
    torch.testing.assert_close(peft_model(input_ids=x).logits, base_logits)  # B starts at zero
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "mlp.experts" in name and "lora_B" in name:
                p.normal_(std=0.5)
    assert not torch.allclose(peft_model(input_ids=x).logits, base_logits, atol=1e-4)


def test_auto_impl_avoids_grouped_mm_for_misaligned_widths():
    from moe_core.experts import grouped_mm_supported

    config = get_config("mixtral-tiny", expert_intermediate_size=3)
    block = seeded_block(config)
    x = torch.randn(2, 5, config.hidden_size)
    assert not grouped_mm_supported(x, 3, config.hidden_size)  # rows of 12 bytes
    assert grouped_mm_supported(x, 128, config.hidden_size)
    assert block.experts.resolved_impl(x) == "sorted"  # fp32 stacks, but widths grouped_mm cannot take
    torch.testing.assert_close(block(x)[0], block(x, "reference")[0])


def test_auto_impl_on_the_cpu_follows_the_stacks_dtype():
    """fp32 stacks (a trainer's weights, bf16 autocast or not) take grouped_mm on the CPU, bf16 stacks (a
    published checkpoint's base) the per-expert loop: what measured faster for each (benchmarks/README.md)."""
    config = get_config("olmoe-tiny")
    block = seeded_block(config)
    x = torch.randn(2, 5, config.hidden_size)
    assert block.experts.resolved_impl(x) == "grouped_mm"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert block.experts.resolved_impl(x) == "grouped_mm"
        torch.testing.assert_close(block(x)[0], block(x, "sorted")[0], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(block(x)[0], block(x, "reference")[0])
    block.to(torch.bfloat16)
    x_bf16 = x.to(torch.bfloat16)
    assert block.experts.grouped_mm_ok(x_bf16)  # grouped_mm could run: the stacks' dtype is what decides
    assert block.experts.resolved_impl(x_bf16) == "sorted"


def test_gather_path_refuses_to_materialize_a_large_batch_eagerly():
    config = get_config("olmoe-tiny", expert_impl="gather")
    block = seeded_block(config)
    F_, D, K = config.expert_intermediate_size, config.hidden_size, config.num_experts_per_tok
    tokens = 2**28 // (K * F_ * D) + 1
    with pytest.raises(ValueError, match="compiled decoding"):
        block(torch.randn(1, tokens, D))


def test_router_gates_get_the_switch_initialization():
    """Switch Transformer §2.4: truncated normal, std sqrt(0.1 / fan_in), cut at two std; not the 0.02 normal of
    the other Linears (transformers 5 never calls _init_weights on the parameter-less Router, so the gate
    Linear carries it)."""
    torch.manual_seed(0)
    model = MoEForCausalLM(get_config("mixtral-tiny", num_experts=64))
    for router in model.routers():
        weight = router.gate.weight
        router_std = math.sqrt(0.1 / weight.shape[1])
        assert weight.abs().max() <= 2 * router_std
        assert 0.75 * router_std < weight.std() < router_std  # a normal cut at 2 std keeps 88% of its std


def test_auto_impl_while_a_graph_is_captured(monkeypatch):
    """`impl_under_capture`: eagerly the module's own choice; under torch.compile the routed paths (on the CPU
    ``sorted``, run eagerly between the graphs), never ``static``, which runs every expert on every token (E/K
    times the FLOPs); under torch.export ``static``, the one path without a data-dependent shape."""
    from moe_core.experts import StackedExperts, impl_under_capture

    config = get_config("olmoe-tiny")
    block = seeded_block(config)
    x = torch.randn(2, 5, config.hidden_size)
    assert impl_under_capture(x, lambda: True) is None
    y_ref, dx_ref, grads_ref = forward_backward(block, x, None)

    def refused(path: str, capture: str):
        def run(*args, **kwargs):
            raise AssertionError(f"the {path} path ran under {capture}")

        return run

    with monkeypatch.context() as patch:
        patch.setattr(StackedExperts, "forward_static", refused("static", "torch.compile"))
        torch.compiler.reset()
        compiled = torch.compile(block, backend="aot_eager")  # the graphs and autograd, without a C++ build
        y, dx, grads = forward_backward(compiled, x, None)
    grads = {name.removeprefix("_orig_mod."): g for name, g in grads.items()}
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(dx, dx_ref)
    assert grads.keys() == grads_ref.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], grads_ref[name], msg=name)

    class Output(torch.nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, x):
            return self.block(x)[0]

    with monkeypatch.context() as patch:
        patch.setattr(StackedExperts, "forward_sorted", refused("sorted", "torch.export"))
        program = torch.export.export(Output(block), (x,))
    torch.testing.assert_close(program.module()(x), y_ref, atol=1e-5, rtol=1e-5)
