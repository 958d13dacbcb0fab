"""`ExpertAdamW` (`moe_core.train.optim`): each expert of a stacked LoRA factor steps as its own parameter under
torch's AdamW, as per-expert modules do (transformers 4 + PEFT); an expert without a gradient in a step is not
stepped and holds no state; its state resumes exactly; and a LoRA fine-tune (``optim.idle_experts``) uses it."""

import io

import pytest
import torch
from safetensors.torch import load_file

from moe_core.finetune import FinetuneConfig, finetune
from moe_core.finetune.config import CONFIG_VERSION, FinetuneError
from moe_core.finetune.methods import apply_method, expert_axes
from moe_core.train.optim import ExpertAdamW, ExpertAxis
from tests.finetune_helpers import Crash, CrashAt, instruction_records, tiny_model, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

E, R, I, O = 6, 3, 10, 7  # experts, rank, in, out
HYPER = dict(lr=3e-2, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.1)


def stacked_factors(seed: int = 0):
    """An expert stack's LoRA factors in PEFT's layout, one other (dense) parameter, and their axes."""
    gen = torch.Generator().manual_seed(seed)
    A_RI = torch.nn.Parameter(torch.randn(E * R, I, generator=gen))  # expert e: rows e*R .. e*R+R-1
    B_OR = torch.nn.Parameter(torch.randn(O, R * E, generator=gen))  # expert e: columns j*E + e
    dense = torch.nn.Parameter(torch.randn(5, 4, generator=gen))
    axes = {A_RI: ExpertAxis(E, "rows", 0), B_OR: ExpertAxis(E, "columns", 0)}
    return A_RI, B_OR, dense, axes


def expert_slices(A_RI, B_OR):
    """Per-expert parameters with the same values: what per-expert modules hold."""
    A = [torch.nn.Parameter(A_RI.detach().view(E, R, I)[e].clone()) for e in range(E)]
    B = [torch.nn.Parameter(B_OR.detach().view(O, R, E)[:, :, e].clone()) for e in range(E)]
    return A, B


def gradients(step: int, routed: list[int]):
    """Random gradients on the routed experts, exact zeros elsewhere; at step 0 A's gradient is zero everywhere
    (LoRA's B starts at zero, so a routed expert's A gets none): the expert still steps, by its B."""
    gen = torch.Generator().manual_seed(100 + step)
    gA_ERI, gB_OER = torch.randn(E, R, I, generator=gen), torch.randn(O, R, E, generator=gen)
    idle = [e for e in range(E) if e not in routed]
    gA_ERI[idle] = 0
    gB_OER[:, :, idle] = 0
    if step == 0:
        gA_ERI.zero_()
    return gA_ERI, gB_OER, torch.randn(5, 4, generator=gen)


ROUTED = [[0, 2, 3], [2, 3, 5], [0, 1], [2], [0, 1, 2, 3, 4, 5], [4]]


@pytest.mark.parametrize("masked", [False, True], ids=["per-expert", "masked"])
def test_each_expert_steps_as_its_own_parameter_under_torch_s_adamw(masked):
    """Both paths, each bitwise its reference: the CPU's, torch's fused AdamW on the experts' rows, against
    per-expert parameters under torch's fused AdamW (transformers' default optimizer); the accelerators' masked
    update over whole stacks, computed as torch's multi-tensor AdamW computes, against that one."""
    A_RI, B_OR, dense, axes = stacked_factors()
    ours = ExpertAdamW([{"params": [A_RI, B_OR, dense]}], expert_axes=axes, masked=masked, **HYPER)
    A, B = expert_slices(A_RI, B_OR)
    dense_ref = torch.nn.Parameter(dense.detach().clone())
    kernel = {"foreach": True} if masked else {"fused": True}
    reference = torch.optim.AdamW([*A, *B], **kernel, **HYPER)
    reference_dense = torch.optim.AdamW([dense_ref], **HYPER)
    for step, routed in enumerate(ROUTED):
        gA_ERI, gB_OER, g_dense = gradients(step, routed)
        A_RI.grad, B_OR.grad, dense.grad = gA_ERI.reshape(E * R, I), gB_OER.reshape(O, R * E), g_dense
        for e in range(E):  # a per-expert module without a token has no gradient at all
            A[e].grad = gA_ERI[e].clone() if e in routed else None
            B[e].grad = gB_OER[:, :, e].clone() if e in routed else None
        dense_ref.grad = g_dense.clone()
        before_RI = A_RI.detach().clone()
        ours.step()
        reference.step()
        reference_dense.step()
        for e in range(E):  # bitwise
            assert torch.equal(A_RI.detach().view(E, R, I)[e], A[e].detach())
            assert torch.equal(B_OR.detach().view(O, R, E)[:, :, e], B[e].detach())
            if e not in routed:  # not stepped: bitwise as it was
                assert torch.equal(A_RI.detach().view(E, R, I)[e], before_RI.view(E, R, I)[e])
        assert torch.equal(dense, dense_ref)  # every other parameter: torch's AdamW itself
        assert A_RI.grad is not None  # the gradients are left for the caller's zero_grad
        ours.zero_grad(set_to_none=True)


def test_the_masked_path_steps_stacks_of_many_shapes_modules_and_groups_as_the_per_expert_path():
    """The masked path steps the stacks of one shape and group together (`_Stacks`): two experts modules of 4
    and 6 experts, two shapes each, two parameter groups with their own learning rate and weight decay, and a
    module whose every expert idles; the per-expert path's result to rounding (its fused kernel computes in
    another order), the idle experts bitwise as they were."""

    def factors(seed):
        gen = torch.Generator().manual_seed(seed)
        shapes = [
            (4 * 2, 5, "rows", 0),
            (3, 2 * 4, "columns", 0),
            (6 * 2, 5, "rows", 1),
            (3, 2 * 6, "columns", 1),
        ]
        shapes += [(4 * 2, 5, "rows", 2), (3, 2 * 4, "columns", 2)]  # module 2: the same shapes as module 0
        params = [torch.nn.Parameter(torch.randn(o, i, generator=gen)) for o, i, _, _ in shapes]
        axes = {p: ExpertAxis(4 if m != 1 else 6, layout, m) for p, (_, _, layout, m) in zip(params, shapes)}
        return params, axes

    def run(masked):
        params, axes = factors(0)
        groups = [
            {"params": params[:4], "lr": 3e-2, "weight_decay": 0.1},
            {"params": params[4:], "lr": 1e-2, "weight_decay": 0.0},
        ]
        optimizer = ExpertAdamW(groups, expert_axes=axes, masked=masked, betas=(0.8, 0.95))
        for step in range(5):
            gen = torch.Generator().manual_seed(50 + step)
            for p in params:
                axis = axes[p]
                p.grad = torch.randn(p.shape, generator=gen)
                idle = [
                    e for e in range(axis.experts) if (e + step) % 3 == 0 or axis.module == 2 and step < 2
                ]
                axis.per_expert(p.grad)[idle] = 0
            optimizer.step()
        return [p.detach() for p in params]

    for ours, reference in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-7)


def test_state_is_kept_only_for_experts_that_had_a_gradient_each_with_its_own_step_count():
    A_RI, B_OR, _, axes = stacked_factors()
    ours = ExpertAdamW([A_RI, B_OR], expert_axes=axes, **HYPER)
    for step, routed in enumerate(ROUTED[:4]):
        gA_ERI, gB_OER, _ = gradients(step, routed)
        A_RI.grad, B_OR.grad = gA_ERI.reshape(E * R, I), gB_OER.reshape(O, R * E)
        ours.step()
    for p in (A_RI, B_OR):
        state = ours.state[p]
        assert state["slot"][4] == -1  # expert 4 got no token yet: no moments
        assert sorted(state["slot"].tolist()) == [-1, 0, 1, 2, 3, 4]  # a row each for the five others
        assert state["exp_avg"].shape == state["exp_avg_sq"].shape == (5, p.numel() // E)
        counts = [sum(e in routed for routed in ROUTED[:4]) for e in range(E)]
        assert state["expert_step"].tolist() == counts  # each expert its own step count
    A_RI.grad = B_OR.grad = None  # no gradient at all (zero_grad): nothing steps
    saved = A_RI.detach().clone()
    ours.step()
    assert torch.equal(A_RI.detach(), saved)


def test_the_masked_path_keeps_stack_shaped_moments_and_each_expert_s_step_count():
    A_RI, B_OR, _, axes = stacked_factors()
    ours = ExpertAdamW([A_RI, B_OR], expert_axes=axes, masked=True, **HYPER)
    for step, routed in enumerate(ROUTED[:4]):
        gA_ERI, gB_OER, _ = gradients(step, routed)
        A_RI.grad, B_OR.grad = gA_ERI.reshape(E * R, I), gB_OER.reshape(O, R * E)
        ours.step()
    state = ours.state[A_RI]
    assert state["exp_avg"].shape == state["exp_avg_sq"].shape == A_RI.shape
    counts = [sum(e in routed for routed in ROUTED[:4]) for e in range(E)]
    assert state["expert_step"].tolist() == counts  # expert 4 took no token: 0, and its moments are zero
    assert not state["exp_avg"].view(E, -1)[4].any() and not state["exp_avg_sq"].view(E, -1)[4].any()


@pytest.mark.parametrize(
    "saved_masked, resumed_masked", [(False, False), (True, True), (False, True), (True, False)]
)
def test_the_state_dict_resumes_exactly(saved_masked, resumed_masked):
    """A state resumes bitwise on its path, and on the other one (saved on a GPU, resumed on the CPU, and back)
    to the rounding between the two kernels."""

    def run(steps, start=None, masked=False):
        A_RI, B_OR, dense, axes = stacked_factors()
        optimizer = ExpertAdamW(
            [{"params": [A_RI, B_OR]}, {"params": [dense]}], expert_axes=axes, masked=masked, **HYPER
        )
        if start is not None:
            params, state = start
            with torch.no_grad():
                for p, saved in zip((A_RI, B_OR, dense), params, strict=True):
                    p.copy_(saved)
            optimizer.load_state_dict(state)
        for step in steps:
            gA_ERI, gB_OER, g_dense = gradients(step, ROUTED[step])
            A_RI.grad, B_OR.grad, dense.grad = gA_ERI.reshape(E * R, I), gB_OER.reshape(O, R * E), g_dense
            optimizer.step()
        return (A_RI, B_OR, dense), optimizer

    whole, _ = run(range(6), masked=resumed_masked)
    first, optimizer = run(range(3), masked=saved_masked)
    buffer = io.BytesIO()  # through bytes, as a checkpoint goes: torch.save, torch.load(weights_only=True)
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed, optimizer = run(range(3, 6), ([p.detach().clone() for p in first], saved), masked=resumed_masked)
    state = optimizer.state[resumed[0]]
    assert state["expert_step"].dtype == torch.float32
    assert ("slot" in state) != resumed_masked and (resumed_masked or state["slot"].dtype == torch.long)
    for a, b in zip(resumed, whole, strict=True):
        if saved_masked == resumed_masked:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_amsgrad_and_the_like_are_refused_by_name():
    A_RI, B_OR, _, axes = stacked_factors()
    with pytest.raises(ValueError, match="amsgrad"):
        ExpertAdamW([A_RI, B_OR], expert_axes=axes, amsgrad=True)


def test_the_axes_of_a_lora_model_are_its_expert_factors_one_module_per_nest():
    model, _ = apply_method(tiny_model(), FinetuneConfig.build({"lora": {"r": 2, "experts": "all"}}))
    axes = expert_axes(model)
    factors = {n: p for n, p in model.named_parameters() if "experts" in n and "lora_" in n}
    assert set(map(id, axes)) == set(map(id, factors.values()))
    layers = len(model.base_model.model.config.moe_layer_ids)
    assert len({axis.module for axis in axes.values()}) == layers  # gate, up and down of a layer share one
    for name, p in factors.items():
        assert axes[p].layout == ("rows" if "lora_A" in name else "columns") and axes[p].experts == 4


# ------------------------------------------------------------------------------------------------ fine-tuning
@pytest.fixture(scope="module")
def base_without_expert_3(tmp_path_factory):
    """A model whose routers never choose expert 3 (a selection bias far below the others')."""
    model = tiny_model("glm4moe-tiny")
    with torch.no_grad():
        for router in model.routers():
            router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, -1e4]))
    path = tmp_path_factory.mktemp("base") / "glm4moe-tiny"
    model.save_pretrained(path)
    return path


def expert_A(out, expert: int) -> dict[str, torch.Tensor]:
    """Every experts' ``lora_A`` rows of ``expert`` in the adapter a fine-tune wrote."""
    weights = load_file(out / "adapter" / "adapter_model.safetensors")
    return {
        k: v.view(4, -1, v.shape[-1])[expert] for k, v in weights.items() if "experts" in k and "lora_A" in k
    }


@pytest.mark.parametrize("idle", ["hold", "step"])
def test_a_lora_fine_tune_leaves_an_expert_without_tokens_as_it_was(base_without_expert_3, tmp_path, idle):
    def run(steps, out):
        config = FinetuneConfig.build(
            {
                "model": {"path": str(base_without_expert_3)},
                "steps": steps,
                "batch_size": 4,
                "optim": {"lr": 5e-2, "weight_decay": 0.5, "idle_experts": idle},
                "lora": {"r": 2, "experts": "all"},
                "export": {"merged": False, "adapters": True},
            }
        )
        finetune(config, out, tokenizer=tiny_tokenizer(), records=instruction_records(8))
        return out

    one, three = run(1, tmp_path / "one"), run(3, tmp_path / "three")
    idle_one, idle_three = expert_A(one, 3), expert_A(three, 3)
    routed_one, routed_three = expert_A(one, 0), expert_A(three, 0)
    assert idle_one and all(not torch.equal(routed_one[k], routed_three[k]) for k in routed_one)
    if idle == "hold":  # never stepped: its initialization, whatever the run's length
        assert all(torch.equal(idle_one[k], idle_three[k]) for k in idle_one)
    else:  # the stack steps as one tensor: the weight decay shrinks it at every step
        for k in idle_one:
            torch.testing.assert_close(idle_three[k], idle_one[k] * (1 - 5e-2 * 0.5) ** 2)


def test_an_older_config_reads_as_it_trained():
    assert CONFIG_VERSION == 4
    assert FinetuneConfig.build({}).optim.idle_experts == "hold"
    assert FinetuneConfig.build({"version": 3}).optim.idle_experts == "step"
    assert (
        FinetuneConfig.build({"version": 3, "optim": {"idle_experts": "hold"}}).optim.idle_experts == "hold"
    )


def test_a_resume_with_the_other_idle_experts_setting_is_refused_by_name(base_without_expert_3, tmp_path):
    def config(idle):
        return FinetuneConfig.build(
            {
                "model": {"path": str(base_without_expert_3)},
                "steps": 3,
                "batch_size": 4,
                "optim": {"idle_experts": idle},
                "lora": {"r": 2},
                "checkpoint": {"every": 1},
                "export": {"merged": False, "adapters": True},
            }
        )

    run = dict(tokenizer=tiny_tokenizer(), records=instruction_records(8))
    with pytest.raises(Crash):
        finetune(config("hold"), tmp_path / "out", sinks=[CrashAt(2)], **run)
    with pytest.raises(
        FinetuneError, match="saved with optim.idle_experts=hold .* --set optim.idle_experts=hold"
    ):
        finetune(config("step"), tmp_path / "out", resume=True, **run)
    finetune(config("hold"), tmp_path / "out", resume=True, **run)


def test_a_state_loaded_into_the_same_masked_optimizer_replaces_its_stacks():
    """`load_state_dict` midway: the masked path's stacks are rebuilt from the loaded state, not kept."""
    A_RI, B_OR, _, axes = stacked_factors()
    optimizer = ExpertAdamW([A_RI, B_OR], expert_axes=axes, masked=True, **HYPER)

    def steps(which):
        for step in which:
            gA_ERI, gB_OER, _ = gradients(step, ROUTED[step])
            A_RI.grad, B_OR.grad = gA_ERI.reshape(E * R, I), gB_OER.reshape(O, R * E)
            optimizer.step()

    steps(range(2))
    snapshot = [p.detach().clone() for p in (A_RI, B_OR)]
    saved = io.BytesIO()
    torch.save(optimizer.state_dict(), saved)
    steps(range(2, 5))
    after = [p.detach().clone() for p in (A_RI, B_OR)]
    with torch.no_grad():
        for p, value in zip((A_RI, B_OR), snapshot, strict=True):
            p.copy_(value)
    saved.seek(0)
    optimizer.load_state_dict(torch.load(saved, weights_only=True))
    steps(range(2, 5))
    for p, value in zip((A_RI, B_OR), after, strict=True):
        assert torch.equal(p.detach(), value)


@pytest.mark.parametrize("masked", [False, True], ids=["per-expert", "masked"])
def test_a_per_expert_state_as_session_30_saved_it_resumes(masked):
    """The state ``ExpertAdamW`` saved before its rows and stacks (``state[p]["experts"][e]``, one dict per
    expert that had a gradient) loads on both paths and steps on as per-expert parameters under torch's AdamW."""
    A_RI, B_OR, _, axes = stacked_factors()
    A, B = expert_slices(A_RI, B_OR)
    reference = torch.optim.AdamW([*A, *B], **({"foreach": True} if masked else {"fused": True}), **HYPER)

    def reference_steps(which):
        for step in which:
            gA_ERI, gB_OER, _ = gradients(step, ROUTED[step])
            for e in range(E):
                A[e].grad = gA_ERI[e].clone() if e in ROUTED[step] else None
                B[e].grad = gB_OER[:, :, e].clone() if e in ROUTED[step] else None
            reference.step()

    reference_steps(range(3))

    def legacy(experts: list) -> dict:
        states = {e: reference.state[p] for e, p in enumerate(experts) if reference.state[p]}
        return {
            "step": torch.tensor(3.0),
            "experts": {
                e: {
                    "step": st["step"],
                    "exp_avg": st["exp_avg"].flatten(),
                    "exp_avg_sq": st["exp_avg_sq"].flatten(),
                }
                for e, st in states.items()
            },
        }

    # B's experts are columns of the stack: expert e's [O, R] flattened in that order (its per-expert view's row)
    legacy_B = legacy(B)
    for st in legacy_B["experts"].values():
        for key in ("exp_avg", "exp_avg_sq"):
            st[key] = st[key].view(O, R).flatten()
    saved = {
        "state": {0: legacy(A), 1: legacy_B},
        "param_groups": [
            {
                **HYPER,
                "params": [0, 1],
                "amsgrad": False,
                "maximize": False,
                "foreach": None,
                "capturable": False,
                "differentiable": False,
                "fused": None,
                "decoupled_weight_decay": True,
            }
        ],
    }
    with torch.no_grad():
        A_RI.copy_(torch.stack([a.detach() for a in A]).view(E * R, I))
        B_OR.copy_(torch.stack([b.detach() for b in B], dim=2).view(O, R * E))
    ours = ExpertAdamW([A_RI, B_OR], expert_axes=axes, masked=masked, **HYPER)
    ours.load_state_dict(saved)
    for step in range(3, 6):
        gA_ERI, gB_OER, _ = gradients(step, ROUTED[step])
        A_RI.grad, B_OR.grad = gA_ERI.reshape(E * R, I), gB_OER.reshape(O, R * E)
        ours.step()
    reference_steps(range(3, 6))
    for e in range(E):
        assert torch.equal(A_RI.detach().view(E, R, I)[e], A[e].detach())
        assert torch.equal(B_OR.detach().view(O, R, E)[:, :, e], B[e].detach())


def test_the_experts_step_counts_keep_their_dtype_when_a_bf16_factor_s_state_loads():
    """torch casts a loaded state's tensors to the parameter's dtype: the step counts (and the CPU path's slots)
    are kept out of that, so 300 steps stay 300 under a bf16 LoRA factor, not 300 rounded to 8 bits."""
    for masked in (False, True):
        p = torch.nn.Parameter(torch.zeros(2 * 3, 4, dtype=torch.bfloat16))
        ours = ExpertAdamW([p], expert_axes={p: ExpertAxis(2, "rows", 0)}, masked=masked, lr=1e-3)
        for _ in range(3):
            p.grad = torch.ones_like(p)
            ours.step()
        state = ours.state_dict()
        state["state"][0]["expert_step"] = torch.tensor([301.0, 0.0])
        again = ExpertAdamW([p], expert_axes={p: ExpertAxis(2, "rows", 0)}, masked=masked, lr=1e-3)
        again.load_state_dict(state)
        assert again.state[p]["expert_step"].dtype == torch.float32
        assert again.state[p]["expert_step"].tolist() == [301.0, 0.0]
        if not masked:
            assert again.state[p]["slot"].dtype == torch.long


def test_the_masked_path_steps_bf16_factors_as_torch_s_adamw_does():
    """bf16 factors (a LoRA kept in the base's dtype): the masked path computes with float32 coefficients, as
    torch's AdamW computes bf16 with float scalars, and lands within bf16's resolution of it."""
    A_RI, B_OR, _, axes = stacked_factors()
    A16, B16 = (torch.nn.Parameter(t.detach().to(torch.bfloat16)) for t in (A_RI, B_OR))
    ours = ExpertAdamW(
        [A16, B16], expert_axes={A16: axes[A_RI], B16: axes[B_OR]}, masked=True, lr=1e-3, weight_decay=1e-3
    )
    A, B = (
        [torch.nn.Parameter(t.detach().to(torch.bfloat16)) for t in slices]
        for slices in expert_slices(A_RI, B_OR)
    )
    reference = torch.optim.AdamW([*A, *B], foreach=True, lr=1e-3, weight_decay=1e-3)
    for step, routed in enumerate(ROUTED):
        gA_ERI, gB_OER, _ = gradients(step, routed)
        A16.grad, B16.grad = gA_ERI.reshape(E * R, I).bfloat16(), gB_OER.reshape(O, R * E).bfloat16()
        for e in range(E):
            A[e].grad = gA_ERI[e].bfloat16() if e in routed else None
            B[e].grad = gB_OER[:, :, e].bfloat16() if e in routed else None
        ours.step()
        reference.step()
    for e in range(E):
        torch.testing.assert_close(A16.detach().view(E, R, I)[e], A[e].detach(), rtol=0, atol=0.01)
        torch.testing.assert_close(B16.detach().view(O, R, E)[:, :, e], B[e].detach(), rtol=0, atol=0.01)
