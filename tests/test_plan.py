"""The planner (`moe_core.train.plan`, `moe-lab plan`): its activation model against what autograd really saves
(a `saved_tensors_hooks` probe: the slow reference), its parameter accounting against the dry run's, the layouts
it offers, and `moe-lab train`'s refusal of a layout that cannot work, before anything is allocated."""

from __future__ import annotations

import json

import pytest
import torch

from moe_core.config import get_config
from moe_core.model import MoEForCausalLM
from moe_core.train import plan
from moe_core.train.build import rank_parameter_bytes
from moe_core.train.config import TrainConfig


def saved_bytes(model: MoEForCausalLM, ids_BS: torch.Tensor) -> int:
    """Bytes autograd saves for backward in one training forward: every saved tensor's storage once,
    parameters left out (they are the weights, not activations)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids_BS, labels=ids_BS, use_cache=False)
    assert out.loss.requires_grad
    return sum(seen.values())


CASES = [  # (preset, overrides, micro-batch, seq_len, checkpointing)
    ("switch-tiny", {"capacity_factor": None}, 2, 16, False),
    ("mixtral-tiny", {}, 3, 24, False),
    ("mixtral-tiny", {"num_key_value_heads": 4, "moe_every_n": 2, "num_hidden_layers": 3}, 2, 8, False),
    ("olmoe-tiny", {}, 1, 32, False),
    ("shared-tiny", {}, 2, 12, False),
    ("dense-tiny", {}, 2, 16, False),
    ("mixtral-tiny", {}, 2, 16, True),
    ("olmoe-tiny", {}, 2, 8, True),
]


@pytest.mark.parametrize("preset,overrides,B,S,ckpt", CASES)
def test_activation_formula_matches_saved_tensors(preset, overrides, B, S, ckpt):
    config = get_config(preset, **overrides)
    torch.manual_seed(0)
    model = MoEForCausalLM(config).train()
    if ckpt:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    ids_BS = torch.randint(0, config.vocab_size, (B, S))
    measured = saved_bytes(model, ids_BS)
    predicted = sum(plan.activation_parts(config, B, S, checkpointing=ckpt).values())
    assert predicted == measured, (preset, overrides, predicted, measured)


@pytest.mark.parametrize("world,ep,mode", [(1, 1, "ddp"), (4, 2, "ddp"), (4, 4, "fsdp2"), (3, 1, "fsdp2")])
def test_weights_are_what_the_dry_run_counts(world, ep, mode):
    """One accounting: the planner's per-rank parameters equal `rank_parameter_bytes` (the dry run's), every rank."""
    config = get_config("mixtral-tiny")
    params = plan.model_params(config)
    for row in rank_parameter_bytes(config, world, ep, mode):
        by_layer = plan.rank_layer_bytes(params, world, ep, mode, rank=row["rank"])
        assert sum(by_layer.values()) == row["params"]


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    from moe_core.cli import COMMANDS, build_parser, run_command

    code = run_command(list(argv), COMMANDS, build_parser)
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_cli_json_lists_layouts_and_recommends_one_that_fits(capsys):
    code, out, _ = run_cli(
        capsys, "plan", "--preset", "mixtral-tiny", "--gpus", "4", "--gpu-memory", "1", "--json"
    )
    assert code == 0
    result = json.loads(out)
    layouts = {x["name"]: x for x in result["layouts"]}
    assert len(layouts) == 3 * 2 * 2  # ep 1, 2, 4 (8 experts, 4 ranks) x ddp/fsdp2 x checkpointing
    assert result["recommended"] in layouts and layouts[result["recommended"]]["fits"]
    no_ep, ep4 = layouts["ep1 ddp(4) no-ckpt"], layouts["ep4 ddp(4) no-ckpt"]
    assert ep4["weights"] < no_ep["weights"] and ep4["comm_bytes"]["all_to_all"] > 0
    assert layouts["ep1 fsdp2(4) no-ckpt"]["weights"] < no_ep["weights"]
    assert layouts["ep1 ddp(4) ckpt"]["activations"] < no_ep["activations"]
    for x in layouts.values():
        assert x["optimizer"] == 2 * x["weights"] and x["peak"] > x["weights"] + x["optimizer"]


def test_plan_cli_table_says_when_nothing_fits(capsys):
    code, out, _ = run_cli(capsys, "plan", "--preset", "mixtral-tiny", "--gpus", "2", "--gpu-memory", "0.001")
    assert code == 1
    assert "ep2 fsdp2(2) ckpt" in out and "none fits" in out


def test_train_refuses_an_ep_size_that_does_not_divide(capsys, tmp_path):
    code, _, err = run_cli(
        capsys,
        "train",
        "--preset",
        "mixtral-tiny",
        "--set",
        "parallel.ep_size=3",
        "--out",
        str(tmp_path / "r"),
    )
    assert code == 2
    assert "parallel.ep_size=3" in err and "planner's choices here: 1" in err
    assert not (tmp_path / "r").exists()


def test_train_refuses_a_layout_that_cannot_fit_before_allocating(capsys, tmp_path):
    """A 1.4 TB model on one process: refused with the planner's numbers, from the meta model alone (building it
    for real would take the machine down, so a return at all shows nothing was allocated)."""
    big = ["hidden_size=4096", "expert_intermediate_size=14336", "num_experts=64", "num_hidden_layers=32"]
    sets = [x for item in big for x in ("--set", f"model.overrides.{item}")]
    out = tmp_path / "r"
    code, _, err = run_cli(capsys, "train", "--preset", "mixtral-tiny", *sets, "--out", str(out))
    assert code == 2
    assert "does not fit: predicted peak" in err and "weights" in err and "moe-lab plan" in err
    assert not out.exists()


def test_check_layout_accepts_what_the_plan_recommends():
    config = TrainConfig.from_preset("mixtral-tiny")
    p = plan.make_plan(config, gpus=2, gpu_memory_gb=1)
    rec = p.recommended
    chosen = config.with_overrides([f"parallel.ep_size={rec.ep_size}", f"parallel.dp_mode={rec.dp_mode}"])
    checked = plan.check_layout(chosen, 2, int(1 * plan.GIB))
    assert checked.peak - checked.process == rec.peak  # a CPU run's check adds the process (rec: GPUs)


def test_cpu_ranks_count_the_process_beside_the_tensors():
    """On CPU the rank's peak adds the process's own memory (measured by benchmarks/plan_check.py); on CUDA the
    device holds only tensors (the context is the headroom)."""
    config = TrainConfig.from_preset("mixtral-tiny")
    params = plan.model_params(config.model.build_config())
    on_cuda = plan.evaluate_layout(config, params, 1, 1, "ddp", False)
    on_cpu = plan.evaluate_layout(config, params, 1, 1, "ddp", False, device="cpu")
    assert (on_cuda.process, on_cpu.process) == (0, plan.CPU_PROCESS_BYTES)
    assert on_cpu.peak - on_cuda.peak == plan.CPU_PROCESS_BYTES
