"""The families of issue 32 (qwen3, deepseek, gptoss, glm4moe tiny presets) under expert parallelism on CPU (gloo):
2 processes at ep 2 (DDP; FSDP2 for the dense weights on deepseek and gptoss) train what one process trains, from the same initial
weights; a checkpoint written at ep 2 resumes at one process; LoRA on gpt-oss's experts at ep 2 equals one process.

One torchrun launch holds every multi-process run (`tests/arch_parallel_worker.py`: 4 presets x 2 layouts, then
the fine-tune): a launch costs more than the tiny runs it holds. The one-process references run here.

What is equal in principle and what only to float rounding: as tests/test_train_parallel.py (every rank half of
each global batch, the load-balancing statistics all-reduced, dropless routing, so the objective is the same;
sums happen in another order). The aux-loss-free bias (deepseek, glm4moe) moves by +-rate per expert from the
sign of the GLOBAL load's deviation (the trainer all-reduces the load before the update), so it is equal
bitwise. Weights: per tensor, the difference's norm within 1e-4 of the tensor's norm, plus a floor of 1% of one
Adam step (lr per element): a parameter whose true gradient is zero gets Adam steps of rounding noise, of either
sign on either layout (glm4moe's key bias in the half of each head RoPE leaves alone: softmax is invariant to a
per-query constant, q . b_k; measured 2e-5 absolute after 4 steps, 1e-3 of that bias's small norm).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from moe_core.config import get_config
from moe_core.finetune import finetune
from moe_core.model import MoEForCausalLM
from moe_core.train import plan, read_jsonl
from moe_core.train.checkpoint import gather_state_dict
from moe_core.train.loop import Trainer
from moe_core.train.parallel import EXPERT_MARK
from tests.arch_parallel_worker import LAYOUTS, PRESETS, RUNS, config_for, finetune_config
from tests.dist_helpers import free_port
from tests.finetune_helpers import instruction_records, tiny_model, tiny_tokenizer
from tests.test_finetune_parallel import assert_same_run as assert_same_finetune
from tests.test_plan import saved_bytes

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

REPO = Path(__file__).resolve().parents[1]
STEPS = 4
LR = 1e-2  # (the worker's optim.lr)
FINETUNE_PRESET = (
    "gptoss-tiny"  # biased experts and router, sinks, the clamped SwiGLU: LoRA on biased experts
)


def step_dir(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:08d}"


@pytest.fixture(scope="module")
def finetune_base(tmp_path_factory) -> Path:
    """A 2-layer gpt-oss model of 8 experts (top 2) with the test tokenizer, and a 16-row instruction file."""
    root = tmp_path_factory.mktemp("base")
    model = tiny_model(FINETUNE_PRESET, num_experts=8, num_experts_per_tok=2, hidden_size=64)
    model.save_pretrained(root / "model")
    tiny_tokenizer().save_pretrained(root / "model")
    with open(root / "data.jsonl", "w") as f:
        for row in instruction_records(16):
            f.write(json.dumps(row) + "\n")
    return root


@pytest.fixture(scope="module")
def launched(tmp_path_factory, finetune_base) -> Path:
    """The one torchrun launch: ROOT/<preset>/<layout> runs and ROOT/finetune."""
    root = tmp_path_factory.mktemp("two")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        str(REPO / "tests" / "arch_parallel_worker.py"),
        "--out",
        str(root),
        "--finetune",
        str(finetune_base),
        str(root / "finetune"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return root


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    """Each preset's one-process run (ROOT/<preset>), its step-0 checkpoint the initial weights."""
    root = tmp_path_factory.mktemp("one")
    torch.set_num_threads(1)  # (a module fixture runs before the function-scoped one_thread)
    for preset in PRESETS:
        trainer = Trainer(config_for(preset, []), root / preset)
        try:
            trainer.save_checkpoint()
            trainer.run()
        finally:
            trainer.close()
    return root


def assert_close_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], where) -> None:
    assert a.keys() == b.keys(), where
    for name in a:
        floor = 1e-2 * LR * a[name].numel() ** 0.5  # see the module docstring
        assert (b[name] - a[name]).norm().item() <= 1e-4 * a[name].norm().item() + floor, (where, name)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_each_family_at_ep2_starts_and_trains_as_one_process(launched, one_process, layout):
    for preset in [p for p, runs_layout in RUNS if runs_layout == layout]:
        one, two = one_process / preset, launched / preset / layout
        # the meta-device start: every tensor drawn from its own stream, so ep 2 holds the same weights bitwise
        initial = gather_state_dict(step_dir(one, 0))
        assert_equal = {
            n for n, t in gather_state_dict(step_dir(two, 0)).items() if torch.equal(t, initial[n])
        }
        assert assert_equal == set(initial), (preset, sorted(set(initial) - assert_equal)[:5])
        a = [r for r in read_jsonl(one / "metrics.jsonl") if "loss" in r]
        b = [r for r in read_jsonl(two / "metrics.jsonl") if "loss" in r]
        assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, STEPS + 1)), preset
        for key in ("loss", "lm_loss", "aux_loss", "grad_norm"):
            assert [r[key] for r in b] == pytest.approx([r[key] for r in a], rel=2e-5, abs=1e-9), (
                preset,
                key,
            )
        for step in (2, STEPS):
            one_w, two_w = gather_state_dict(step_dir(one, step)), gather_state_dict(step_dir(two, step))
            assert_close_weights(one_w, two_w, (preset, layout, step))
        # it trained (4 steps need not lower the loss yet): every tensor moved 10x beyond the tolerance
        for name, tensor in one_w.items():
            if "rotary" not in name:
                assert (tensor - initial[name]).norm() > 10 * (1e-4 * tensor.norm() + 1e-2 * LR), (
                    preset,
                    name,
                )


def test_the_meta_start_initializes_the_new_modules_by_their_rules(one_process):
    """MLA's projections and norms, gpt-oss's sinks and expert biases, the routers' correction biases: drawn or
    set by the model's own rule (not left as `torch.empty`'s memory)."""
    deepseek = gather_state_dict(step_dir(one_process / "deepseek-tiny", 0))
    for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
        w = deepseek[f"model.layers.1.self_attn.{name}.weight"]
        assert w.std().item() == pytest.approx(0.02, rel=0.2), name
    for name in ("q_a_layernorm", "kv_a_layernorm"):
        assert torch.equal(
            deepseek[f"model.layers.1.self_attn.{name}.weight"],
            torch.ones(deepseek[f"model.layers.1.self_attn.{name}.weight"].shape),
        ), name
    assert not deepseek["model.layers.1.mlp.router.expert_bias"].any()
    gptoss = gather_state_dict(step_dir(one_process / "gptoss-tiny", 0))
    sinks = torch.cat([gptoss[f"model.layers.{i}.self_attn.sinks"] for i in range(2)])
    assert sinks.abs().min() > 0 and sinks.abs().max() < 0.1
    for p in ("gate_proj", "up_proj", "down_proj"):
        if f"model.layers.0.mlp.experts.{p}_bias" in gptoss:
            assert not gptoss[f"model.layers.0.mlp.experts.{p}_bias"].any(), p


def test_what_is_replicated_is_the_same_on_every_rank(launched):
    """Attention, the dense first layer, shared experts, routers and their aux-loss-free biases: after the run,
    rank 1's copy equals rank 0's bitwise (FSDP2's shards gathered)."""
    for preset, layout in RUNS:
        differences = json.loads((launched / preset / layout / "replicas.json").read_text())
        assert differences and not any(differences.values()), (preset, layout)
    deepseek = json.loads((launched / "deepseek-tiny" / "ep2" / "replicas.json").read_text())
    assert "model.layers.1.mlp.router.expert_bias" in deepseek
    assert "model.layers.0.mlp.up_proj.weight" in deepseek  # the dense first layer
    assert "model.layers.1.mlp.shared_expert.up_proj.weight" in deepseek


def test_the_aux_loss_free_bias_follows_the_global_load(launched, one_process):
    for preset in ("deepseek-tiny", "glm4moe-tiny"):
        name = "model.layers.1.mlp.router.expert_bias"
        one = gather_state_dict(step_dir(one_process / preset, STEPS))[name]
        assert one.any(), preset  # it moved
        for layout in [layout for p, layout in RUNS if p == preset]:
            assert torch.equal(gather_state_dict(step_dir(launched / preset / layout, STEPS))[name], one)


def test_gptoss_expert_biases_are_sharded_with_their_experts(launched, one_process):
    ckpt = step_dir(launched / "gptoss-tiny" / "ep2", STEPS)
    one = gather_state_dict(step_dir(one_process / "gptoss-tiny", STEPS))
    biases = [n for n in one if ".mlp.experts." in n and n.endswith("_bias")]
    assert biases
    for k in range(2):
        with safe_open(ckpt / f"experts-ep{k}-of-2.safetensors", "pt") as f:
            for name in biases:
                shard = f.get_tensor(name.replace(".experts.", EXPERT_MARK))
                half = one[name].shape[0] // 2
                assert shard.shape[0] == half
                assert torch.allclose(shard, one[name][k * half : (k + 1) * half], rtol=1e-4, atol=1e-6)
    assert any(one[n].any() for n in biases)  # they trained


@pytest.mark.parametrize("preset", ["deepseek-tiny", "gptoss-tiny"])
def test_a_checkpoint_written_at_ep2_resumes_at_one_process(launched, one_process, tmp_path, preset):
    run = tmp_path / "run"
    shutil.copytree(launched / preset / "ep2", run)
    shutil.rmtree(step_dir(run, STEPS))  # resume from step 2
    config = config_for(preset, LAYOUTS["ep2"]).with_overrides(["parallel.ep_size=1"])
    trainer = Trainer(config, run, resume=True)
    try:
        assert trainer.step == 2
        trainer.run()
    finally:
        trainer.close()
    one = gather_state_dict(step_dir(one_process / preset, STEPS))
    assert_close_weights(one, gather_state_dict(step_dir(run, STEPS)), preset)
    resumed = [r for r in read_jsonl(run / "metrics.jsonl") if "loss" in r][-2:]
    expected = [r for r in read_jsonl(one_process / preset / "metrics.jsonl") if "loss" in r][-2:]
    assert [r["step"] for r in resumed] == [3, 4]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in expected], rel=2e-5)


def test_lora_on_gptoss_experts_at_ep2_equals_one_process(launched, finetune_base, tmp_path):
    """`moe-lab finetune --nproc 2 --set parallel.ep_size=2`'s run (in the shared launch) against one process of
    the same global batch (grad_accum 2)."""
    finetune(finetune_config(finetune_base, ["grad_accum=2"]), tmp_path / "one", overwrite=True)
    assert_same_finetune(tmp_path / "one", launched / "finetune")


# gpt-oss without what the planner approximates (biases, clamped SwiGLU, windows): sinks and its router order exact
GPTOSS_EXACT = dict(
    expert_bias=False,
    router_bias=False,
    swiglu_limit=None,
    attention_window=None,
    attention_window_layers=None,
)


@pytest.mark.parametrize(
    "preset,overrides",
    [(preset, {}) for preset in PRESETS] + [("gptoss-tiny", GPTOSS_EXACT)],
)
def test_the_planner_counts_each_family_exactly_or_names_what_it_approximates(preset, overrides):
    """`plan.activation_parts` against what autograd saves (tests/test_plan.py's probe), at two shapes (the sinks'
    term is quadratic in S): equal where `activation_caveats` is empty, within 30% where it names the ops."""
    config = get_config(preset, **overrides)
    caveats = plan.activation_caveats(config)
    assert bool(caveats) == (preset in ("deepseek-tiny", "glm4moe-tiny", "gptoss-tiny") and not overrides)
    torch.manual_seed(0)
    model = MoEForCausalLM(config).train()
    for B, S in ((2, 16), (1, 40)):
        measured = saved_bytes(model, torch.randint(0, config.vocab_size, (B, S)))
        predicted = sum(plan.activation_parts(config, B, S).values())
        if caveats:
            assert abs(predicted - measured) <= 0.3 * measured, (preset, B, S, predicted, measured)
        else:
            assert predicted == measured, (preset, B, S, predicted, measured)
