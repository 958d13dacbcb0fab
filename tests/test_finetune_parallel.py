"""Fine-tuning on several processes (`moe_core.finetune.parallel`, gloo on CPU, fp32): N processes of batch_size B
train what one process of batch_size B and grad_accum N trains, loss curve and adapter equal within float
tolerance (SFT on 2 processes, experts split over both, one of them SIGKILLed mid-run: the group restarts and
resumes; DPO on 4, ep 2 x dp 2); one process resumes too; what does not compose is refused before anything loads.

Two torchrun launches (2 processes, restarted once; 4) are the cost of this file: most of it is each process
importing transformers, TRL and PEFT on 2 cores. The runs are shared by the assertions (module fixtures)."""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import transformers
from safetensors.torch import load_file

from moe_core import load
from moe_core.finetune import FinetuneConfig, finetune
from moe_core.finetune.config import FinetuneError
from moe_core.finetune.parallel import (
    CHECKPOINTS,
    CheckpointStore,
    check_experts_split,
    check_world,
    drop_incomplete_checkpoints,
    has_checkpoint,
)
from moe_core.finetune.trainer_seam import REPLACED
from moe_core.train import read_jsonl
from tests.finetune_helpers import (
    Crash,
    CrashAt,
    instruction_records,
    preference_records,
    tiny_model,
    tiny_tokenizer,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

REPO = Path(__file__).resolve().parents[1]
STEPS = 4
SETS = [
    f"steps={STEPS}",
    "batch_size=2",
    "log.progress=off",
    "optim.lr=1e-2",
    "lora.r=4",
    "data.max_length=64",
    "checkpoint.every=2",
]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A 2-layer, 4-expert model with its tokenizer, a 16-row instruction file and an 8-row preference file."""
    root = tmp_path_factory.mktemp("base")
    tiny_model(num_hidden_layers=2).save_pretrained(root / "model")
    tiny_tokenizer().save_pretrained(root / "model")
    with open(root / "data.jsonl", "w") as f:
        for row in instruction_records(16):
            f.write(json.dumps(row) + "\n")
    with open(root / "preferences.jsonl", "w") as f:
        for row in preference_records(8):
            f.write(json.dumps(row) + "\n")
    return root


DPO = ["objective=dpo", "data.source={base}/preferences.jsonl"]


def config_for(base: Path, *extra: str) -> FinetuneConfig:
    sets = [f"model.path={base / 'model'}", f"data.source={base / 'data.jsonl'}", *SETS, *extra]
    sets = [item.format(base=base) for item in sets]
    return FinetuneConfig().with_overrides(sets)


def command(base: Path, out: Path, nproc: int, *extra: str) -> list[str]:
    cmd = [sys.executable, "-m", "moe_core.cli", "finetune", "--nproc", str(nproc), "--out", str(out)]
    cmd += ["--model", str(base / "model"), "--data", str(base / "data.jsonl")]
    for item in SETS:
        cmd += ["--set", item]
    return cmd + [item.format(base=base) for item in extra]


def env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def run(cmd: list[str]) -> None:
    result = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]


@pytest.fixture(scope="module")
def one_process(base, tmp_path_factory):
    """The references: one process, SFT with grad_accum 2 and DPO with grad_accum 4 (what 2 and 4 processes of the
    same batch_size train)."""
    out = {2: tmp_path_factory.mktemp("one_sft_ga2"), 4: tmp_path_factory.mktemp("one_dpo_ga4")}
    finetune(config_for(base, "grad_accum=2"), out[2], overwrite=True)
    finetune(config_for(base, "grad_accum=4", *DPO), out[4], overwrite=True)
    return out


@pytest.fixture(scope="module")
def two_resumed(base, tmp_path_factory) -> dict:
    """2 processes, experts split over both, under torchrun's elastic agent (--max-restarts 1): rank 1 SIGKILLed
    once the step-2 checkpoint is complete; the agent stops rank 0 and restarts the group, which resumes."""
    out = tmp_path_factory.mktemp("ep2")
    cmd = command(base, out, 2, "--max-restarts", "1", "--set", "parallel.ep_size=2")
    launcher = subprocess.Popen(cmd, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not (out / CHECKPOINTS / "step_00000002").is_dir():
        assert launcher.poll() is None, launcher.stderr.read()[-4000:]
        assert time.monotonic() < deadline
        time.sleep(0.02)
    workers = psutil.Process(launcher.pid).children(recursive=True)
    (victim,) = [w for w in workers if "finetune" in w.cmdline() and w.environ().get("RANK") == "1"]
    victim.send_signal(signal.SIGKILL)
    left = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))  # before the group restarts
    _, stderr = launcher.communicate(timeout=400)
    assert launcher.returncode == 0, stderr[-4000:]
    return {"out": out, "left_by_the_kill": left, "log": stderr}


@pytest.fixture(scope="module")
def four(base, tmp_path_factory) -> Path:
    """4 processes, DPO: experts split over groups of 2 (ep 2 x dp 2)."""
    out = tmp_path_factory.mktemp("ep2dp2")
    run(command(base, out, 4, "--set", "parallel.ep_size=2", *[a for item in DPO for a in ("--set", item)]))
    return out


def assert_same_run(one: Path, many: Path) -> None:
    a = [r for r in read_jsonl(one / "metrics.jsonl") if "loss" in r]
    b = [r for r in read_jsonl(many / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm", "lm_loss", "aux_loss", "rewards/margins"):
        if key in a[0]:
            assert [r[key] for r in b] == pytest.approx([r[key] for r in a], rel=1e-5, abs=1e-7), key
    assert a[-1]["loss"] < a[0]["loss"] - 0.05  # it trained: not a comparison of two idle runs
    # the adapter: one file, the same keys, shapes and config as one process's, the factors within tolerance
    wa = load_file(one / "adapter" / "adapter_model.safetensors")
    wb = load_file(many / "adapter" / "adapter_model.safetensors")
    assert {k: v.shape for k, v in wb.items()} == {k: v.shape for k, v in wa.items()}
    assert any(".mlp.experts." in k for k in wa)
    # relative to each factor's norm: lora_B starts at zero, so every entry is near zero, where Adam's
    # m / (sqrt(v) + eps) turns a 1e-7 gradient rounding into a larger update difference (1.3e-5 seen on an
    # AVX-512 CPU for the killed-and-resumed run; the losses above stay within 1e-5)
    for name in wa:
        assert ((wb[name] - wa[name]).norm() / wa[name].norm().clamp_min(1e-12)).item() < 1e-4, name
    config = "adapter_config.json"
    assert json.loads((many / "adapter" / config).read_text()) == json.loads(
        (one / "adapter" / config).read_text()
    )
    assert not (many / CHECKPOINTS).exists()  # a finished run keeps nothing to resume


@pytest.mark.slow
def test_two_processes_one_killed_restarted_and_resumed_equal_one_process(two_resumed, one_process):
    assert two_resumed["left_by_the_kill"] == [CHECKPOINTS]  # no output of a run that did not finish
    assert "(exitcode: -9)" in two_resumed["log"]  # the agent saw the SIGKILL and restarted the group
    assert_same_run(one_process[2], two_resumed["out"])
    summary = json.loads((two_resumed["out"] / "summary.json").read_text())
    assert summary["steps_done"] == STEPS and summary["skipped_steps"] == 0


@pytest.mark.slow
def test_four_processes_expert_and_data_parallel_dpo_equal_one_process(four, one_process, base):
    assert_same_run(one_process[4], four)
    # the gathered adapter applies to the base model like a one-process run's
    ours, theirs = load(four / "adapter").model, load(one_process[4] / "adapter").model
    ids = torch.tensor([[1, 5, 9, 14, 20, 33]])
    with torch.no_grad():
        torch.testing.assert_close(
            ours(input_ids=ids).logits, theirs(input_ids=ids).logits, rtol=1e-4, atol=1e-5
        )


@pytest.mark.slow
def test_one_process_resumes_a_crashed_run(base, tmp_path, one_process):
    config = config_for(base, "grad_accum=2")
    with pytest.raises(Crash):  # after step 3: the checkpoint of step 2 is complete
        finetune(config, tmp_path, sinks=[CrashAt(3)])
    assert sorted(p.name for p in tmp_path.iterdir()) == [CHECKPOINTS]
    with pytest.raises(FinetuneError, match="--resume"):  # the checkpoints are not silently replaced
        finetune(config, tmp_path)
    finetune(config, tmp_path, resume=True)
    assert_same_run(one_process[2], tmp_path)


def test_what_does_not_compose_is_refused_before_loading():
    lora = FinetuneConfig()
    with pytest.raises(FinetuneError, match="--nproc 2"):
        check_world(lora.with_overrides(["parallel.ep_size=2"]), 1)
    with pytest.raises(FinetuneError, match="does not divide the 4 processes"):
        check_world(lora.with_overrides(["parallel.ep_size=3"]), 4)
    with pytest.raises(FinetuneError, match="only LoRA"):
        check_world(lora.with_overrides(["method=full"]), 2)
    with pytest.raises(FinetuneError, match="freeze.router=false"):
        check_world(lora.with_overrides(["freeze.router=false"]), 2)
    check_world(lora.with_overrides(["parallel.ep_size=2"]), 4)  # ep 2 x dp 2
    for sets, match in (
        (["quantize.base=nf4"], "QLoRA"),
        (["export.merged=true"], "export.merged"),
        (["method=full"], "method=full"),
    ):
        with pytest.raises(FinetuneError, match=match):
            lora.with_overrides([*sets, "parallel.ep_size=2"])
    with pytest.raises(FinetuneError, match="divide the model's 4 experts"):
        check_experts_split(lora.with_overrides(["parallel.ep_size=3"]), tiny_model().config)
    with pytest.raises(FinetuneError, match="resume needs checkpoint.every"):
        finetune(lora, "unused", resume=True)


def test_only_complete_checkpoints_are_resumed(tmp_path):
    root = tmp_path / CHECKPOINTS
    (root / ".tmp-step_00000004").mkdir(parents=True)  # a save cut short: never resumed from
    assert not has_checkpoint(root)
    drop_incomplete_checkpoints(root)
    assert not root.exists()
    for step in (2, 4):
        (root / f"step_{step:08d}").mkdir(parents=True)
    (root / ".tmp-step_00000006").mkdir()
    store = CheckpointStore(root, None, keep=2)
    assert store.latest() == root / "step_00000004"
    drop_incomplete_checkpoints(root)  # a complete one is there: nothing goes
    assert store.latest() == root / "step_00000004"
    for rank in (0, 1):
        (root / "step_00000004" / f"rank_{rank:05d}.pt").touch()
    with pytest.raises(
        FinetuneError, match="written by 2 processes and this run has 1; resume with --nproc 2"
    ):
        store.check_layout(store.latest())


def test_trainer_seam():
    """transformers still has, and still calls, the Trainer methods `PerRankCheckpoints` replaces (5.24)."""
    trainer = transformers.Trainer
    for name in REPLACED:
        assert callable(getattr(trainer, name, None)), f"transformers.Trainer.{name} is gone"
    calls = inspect.getsource(trainer.train) + inspect.getsource(trainer._inner_training_loop)
    calls += inspect.getsource(trainer._maybe_log_save_evaluate)
    # 5.x: the optimizer is restored in _prepare_for_training, the RNG state in the epoch loop
    calls += inspect.getsource(trainer._prepare_for_training) + inspect.getsource(trainer._run_epoch)
    for name in REPLACED:
        assert f"self.{name}(" in calls, f"transformers.Trainer no longer calls {name}"
    assert list(inspect.signature(trainer._save_checkpoint).parameters) == ["self", "model", "trial"]
    assert list(inspect.signature(trainer._load_from_checkpoint).parameters)[:2] == [
        "self",
        "resume_from_checkpoint",
    ]
