"""The training loop on one process: exact resume, telemetry, checkpoints, faults, baselines, precision.

Tiny models on the synthetic Markov-chain source (no tokenizer) so every test takes seconds."""

import json
import math
import os
import shutil
import signal

import pytest
import torch
from safetensors.torch import load_file

from moe_core.config import dense_baseline, get_config, parameter_counts
from moe_core.model import MoEForCausalLM
from moe_core.train import TrainConfig, read_jsonl, train
from moe_core.train.checkpoint import list_checkpoints, read_trainer_state
from moe_core.train.loop import OutOfMemoryError, Trainer, TrainingDivergedError

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def tiny(preset="switch-tiny", **fields):
    base = {
        "model": {"preset": preset},
        "steps": 8,
        "batch_size": 4,
        "data": {"source": "synthetic", "seq_len": 32, "synthetic_blocks": 128},
        "optim": {"warmup_steps": 2},
        "log": {"every": 2, "progress": "off"},
        "checkpoint": {"every": 4, "keep_last": 10},
        "eval": {"batches": 2},
    }
    for key, value in fields.items():
        if isinstance(value, dict):
            base[key] = {**base.get(key, {}), **value}
        else:
            base[key] = value
    return TrainConfig.build(base)


def final_weights(result):
    return load_file(result.export_dir / "model.safetensors")


def assert_bitwise_equal(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_resume_from_a_checkpoint_is_bitwise_identical_and_seeded_runs_repeat(tmp_path):
    config = tiny(steps=12, checkpoint={"every": 4})
    full = train(config, tmp_path / "full")
    again = train(config, tmp_path / "again")
    assert_bitwise_equal(final_weights(full), final_weights(again))

    # a run that "died" after step 4: only that checkpoint survives; resuming must land on the same weights
    resumed_dir = tmp_path / "resumed" / "checkpoints"
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step_00000004", resumed_dir / "step_00000004")
    resumed = train(config, tmp_path / "resumed", resume=True)
    assert resumed.step == 12 and resumed.tokens == full.tokens
    assert_bitwise_equal(final_weights(full), final_weights(resumed))
    logged = {row["step"]: row["loss"] for row in read_jsonl(full.metrics_path)}
    assert {row["step"]: row["loss"] for row in read_jsonl(resumed.metrics_path)} == {
        s: v for s, v in logged.items() if s > 4
    }

    with pytest.raises(Exception, match="already holds checkpoints"):
        train(config, tmp_path / "full")  # never silently restart over an existing run


def test_training_lowers_the_loss_and_telemetry_is_complete(tmp_path):
    config = tiny(steps=30, batch_size=8, optim={"lr": 1e-2, "warmup_steps": 6}, eval={"every": 10})
    result = train(config, tmp_path)
    rows = read_jsonl(result.metrics_path)
    assert [r["step"] for r in rows] == list(range(2, 31, 2))
    assert rows[-1]["lm_loss"] < rows[0]["lm_loss"] - 0.5  # the Markov chain is learnable
    assert result.val_loss is not None and result.val_loss < math.log(512)
    E = get_config("switch-tiny").num_experts
    for row in rows:
        for key in (
            "loss",
            "lm_loss",
            "aux_loss",
            "z_loss",
            "lr",
            "grad_norm",
            "tokens_per_s",
            "flops_per_token",
            "tflops_per_device",
            "skipped_steps",
        ):
            assert key in row and math.isfinite(row[key]), key
        for layer in get_config("switch-tiny").moe_layer_ids:
            prefix = f"moe/layer_{layer}/"
            fracs = [row[prefix + f"expert_{e}_frac"] for e in range(E)]
            assert sum(fracs) == pytest.approx(1.0)
            assert max(fracs) * E == pytest.approx(row[prefix + "max_over_mean_load"])
            assert 0.0 <= row[prefix + "drop_rate"] <= 1.0
            assert 0.0 < row[prefix + "entropy"] <= math.log(E) + 1e-6
    assert rows[0]["lr"] < rows[2]["lr"]  # warmup, then cosine decay
    assert rows[-1]["lr"] < max(r["lr"] for r in rows)
    assert sum("val_loss" in r for r in rows) == 3


def test_a_run_reports_its_own_peak_memory_not_an_earlier_one_s_in_the_same_process(tmp_path):
    """max_memory_mb is the run's peak: a notebook or sweep that trains twice in one process (or the GPU suite, which
    did: every run showed the first one's 38.6 GiB) must not inherit what came before."""
    from moe_core.train.telemetry import max_memory_mb, reset_peak_memory

    cpu = torch.device("cpu")
    reset_peak_memory(cpu)
    before = max_memory_mb(cpu)
    spike = torch.ones(2**28)  # 1 GiB, touched: the process's peak rises by it
    del spike
    if max_memory_mb(cpu) - before < 900:
        pytest.skip("this kernel keeps no resettable peak resident set (/proc/self/clear_refs)")
    rows = read_jsonl(train(tiny(steps=2, log={"every": 1}), tmp_path).out_dir / "metrics.jsonl")
    peaks = [row["max_memory_mb"] for row in rows if "max_memory_mb" in row]
    assert peaks and max(peaks) < before + 512  # the 1 GiB spike came before the run and is not in its figure


def test_checkpoints_keep_the_last_n_and_the_best(tmp_path):
    config = tiny(steps=12, checkpoint={"every": 2, "keep_last": 2}, eval={"every": 2})
    result = train(config, tmp_path)
    kept = [p.name for p in list_checkpoints(tmp_path / "checkpoints")]
    state = read_trainer_state(result.checkpoint)
    assert kept[-2:] == ["step_00000010", "step_00000012"]
    assert state["best"]["name"] in kept and len(kept) <= 3
    val_losses = [r["val_loss"] for r in read_jsonl(result.metrics_path) if "val_loss" in r]
    assert state["best"]["val_loss"] == pytest.approx(min(val_losses))
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
    saved = TrainConfig.load(result.checkpoint / "train_config.json")
    assert saved == config  # the typed config travels with every checkpoint


def test_export_and_single_process_checkpoints_load_with_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM

    result = train(tiny(steps=4), tmp_path)
    exported = AutoModelForCausalLM.from_pretrained(result.export_dir)
    from_ckpt = MoEForCausalLM.from_pretrained(result.checkpoint)
    ids = torch.randint(0, 512, (2, 16))
    assert torch.equal(exported(ids).logits, from_ckpt(ids).logits)
    assert json.loads((result.export_dir / "train_config.json").read_text())["steps"] == 4


class SignalAt:
    """A metrics sink that sends this process ``signals`` at logging step ``step`` (each one is handled before
    `os.kill` returns, so a second one meets the first one's state)."""

    def __init__(self, step: int, *signals: int) -> None:
        self.step, self.signals = step, signals

    def log(self, step, metrics) -> None:
        if step == self.step:
            for signum in self.signals:
                os.kill(os.getpid(), signum)

    def close(self) -> None:
        pass


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_the_run_at_the_step_with_a_checkpoint(tmp_path, signum, capfd):
    handler = signal.getsignal(signum)
    result = train(tiny(steps=8, log={"every": 1}), tmp_path, sinks=[SignalAt(2, signum)])
    name = signal.Signals(signum).name
    assert result.stopped_by == name and result.step == 2 and result.exit_code == 128 + signum
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step_00000002"]
    assert result.export_dir is None
    assert f"{name}: finishing this step, then saving a checkpoint and stopping" in capfd.readouterr().err
    assert signal.getsignal(signum) is handler  # given back


def test_a_second_ctrl_c_stops_at_once_without_a_checkpoint_and_a_later_sigterm_changes_nothing(
    tmp_path, capfd
):
    with pytest.raises(KeyboardInterrupt):
        train(
            tiny(steps=8, log={"every": 1}), tmp_path / "a", sinks=[SignalAt(2, signal.SIGINT, signal.SIGINT)]
        )
    assert not list_checkpoints(tmp_path / "a" / "checkpoints")
    assert "SIGINT again: stopping now, without a checkpoint" in capfd.readouterr().err

    # torchrun's agent passes a Ctrl-C on to its workers as SIGTERM: the checkpoint is still written
    result = train(
        tiny(steps=8, log={"every": 1}), tmp_path / "b", sinks=[SignalAt(2, signal.SIGINT, signal.SIGTERM)]
    )
    assert result.stopped_by == "SIGINT" and result.exit_code == 130
    assert [p.name for p in list_checkpoints(tmp_path / "b" / "checkpoints")] == ["step_00000002"]


def test_resume_says_which_checkpoint_and_step_and_what_it_discarded(tmp_path, capsys):
    config = tiny(steps=4, checkpoint={"every": 2})
    train(config, tmp_path)
    half_written = tmp_path / "checkpoints" / ".tmp-step_00000006"  # a writer killed mid-save
    half_written.mkdir()
    capsys.readouterr()
    train(config.with_overrides(["steps=5"]), tmp_path, resume=True)
    ckpt = tmp_path / "checkpoints" / "step_00000004"
    expected = (
        f"moe-lab train: resuming from {ckpt} (step 4); discarded the half-written {half_written.name}\n"
    )
    assert expected in capsys.readouterr().out
    assert not half_written.exists()

    train(config, tmp_path / "new", resume=True)  # nothing to resume: says so
    expected = (
        f"moe-lab train: no complete checkpoint in {tmp_path / 'new' / 'checkpoints'}; starting from step 0"
    )
    assert expected in capsys.readouterr().out


class PoisonedLoss(torch.nn.Module):
    """Wraps the model; makes the loss NaN on the chosen steps (counted by forward calls)."""

    def __init__(self, model, bad_calls):
        super().__init__()
        self.model, self.bad_calls, self.calls = model, set(bad_calls), 0

    def forward(self, **kwargs):
        out = self.model(**kwargs)
        self.calls += 1
        if self.calls in self.bad_calls:
            out.loss = out.loss * float("nan")
        return out


def test_a_non_finite_step_is_skipped_and_counted(tmp_path):
    trainer = Trainer(tiny(steps=6), tmp_path)
    trainer.forward_model = PoisonedLoss(trainer.model, bad_calls={3})
    trainer.train_step()
    trainer.train_step()
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    stats = trainer.train_step()  # the poisoned one
    assert stats["finite"] == 0.0 and trainer.skipped_steps == 1 and trainer.bad_in_row == 1
    assert_bitwise_equal(before, trainer.model.state_dict())  # no update from NaN gradients
    trainer.train_step()
    assert trainer.bad_in_row == 0 and trainer.step == 4
    trainer.close()


def test_too_many_bad_steps_in_a_row_stop_without_checkpointing_bad_weights(tmp_path):
    config = tiny(steps=10, faults={"max_bad_steps_in_a_row": 2}, checkpoint={"every": 1})
    trainer = Trainer(config, tmp_path)
    trainer.forward_model = PoisonedLoss(trainer.model, bad_calls=range(4, 100))
    with pytest.raises(TrainingDivergedError, match="3 steps in a row had a non-finite loss") as err:
        trainer.run()
    trainer.close()
    ckpts = list_checkpoints(tmp_path / "checkpoints")
    assert ckpts[-1].name == "step_00000003"  # only after good steps: the skipped steps 4-6 wrote nothing
    # step 4 diverged from the weights of step 3: the last good checkpoint is step 2
    assert "resume from " + str(tmp_path / "checkpoints" / "step_00000002") in str(err.value)
    for ckpt in ckpts:
        assert all(torch.isfinite(t).all() for t in load_file(ckpt / "model.safetensors").values())

    trainer = Trainer(tiny(steps=2), tmp_path / "nan_weights")
    with torch.no_grad():
        trainer.model.lm_head.weight[0, 0] = float("nan")
    with pytest.raises(TrainingDivergedError, match="lm_head.weight holds non-finite values"):
        trainer.save_checkpoint()
    trainer.close()


def test_out_of_memory_names_the_batch_settings(tmp_path, monkeypatch):
    def oom(self):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(Trainer, "train_step", oom)
    with pytest.raises(OutOfMemoryError, match=r"batch_size=4, grad_accum=1 .*data.seq_len=32"):
        train(tiny(), tmp_path)


def test_aux_loss_free_bias_moves_in_training_and_not_in_evaluation(tmp_path):
    config = tiny(
        "mixtral-tiny",
        steps=3,  # odd: +-rate steps of a balanced router can cancel to exactly 0 after an even number
        model={
            "overrides": {"router": "aux_free", "router_bias_update_rate": 0.01, "router_aux_loss_coef": 0.0}
        },
    )
    trainer = Trainer(config, tmp_path)
    trainer.run()
    biases = [r.expert_bias.clone() for r in trainer.model.routers()]
    assert all(b.abs().sum() > 0 for b in biases)
    trainer.evaluate()
    assert all(torch.equal(b, r.expert_bias) for b, r in zip(biases, trainer.model.routers()))
    trainer.close()
    saved = load_file(tmp_path / "final" / "model.safetensors")
    assert torch.equal(saved["model.layers.0.mlp.router.expert_bias"], biases[0])


@pytest.mark.parametrize("match", ["active", "total"])
def test_the_same_engine_trains_dense_baselines(tmp_path, match):
    result = train(tiny(steps=4, model={"baseline": match}), tmp_path)
    model = MoEForCausalLM.from_pretrained(result.export_dir)
    expected = dense_baseline(get_config("switch-tiny"), match)
    assert model.config.num_experts == 0 and model.config.intermediate_size == expected.intermediate_size
    assert sum(p.numel() for p in model.parameters()) == parameter_counts(expected)["total"]
    rows = read_jsonl(result.metrics_path)
    assert "aux_loss" not in rows[-1] and math.isfinite(rows[-1]["loss"])


def test_gradient_accumulation_matches_the_full_batch(tmp_path):
    # dropless routing and no aux loss: per-micro-batch statistics would otherwise differ in principle
    model = {"preset": "mixtral-tiny", "overrides": {"router_aux_loss_coef": 0.0}}
    whole = train(tiny(steps=6, batch_size=8, model=model, log={"every": 1}), tmp_path / "whole")
    accum = train(
        tiny(steps=6, batch_size=8, grad_accum=4, model=model, log={"every": 1}), tmp_path / "accum"
    )
    a = [r["loss"] for r in read_jsonl(whole.metrics_path)]
    b = [r["loss"] for r in read_jsonl(accum.metrics_path)]
    assert a == pytest.approx(b, rel=1e-5)


def test_activation_checkpointing_and_bf16(tmp_path):
    plain = train(tiny(steps=4, log={"every": 1}), tmp_path / "plain")
    ckpt = train(tiny(steps=4, log={"every": 1}, activation_checkpointing=True), tmp_path / "ckpt")
    assert [r["loss"] for r in read_jsonl(plain.metrics_path)] == pytest.approx(
        [r["loss"] for r in read_jsonl(ckpt.metrics_path)], rel=1e-6
    )
    bf16 = train(tiny(steps=4, log={"every": 1}, precision="bf16"), tmp_path / "bf16")
    losses = [r["loss"] for r in read_jsonl(bf16.metrics_path)]
    assert all(math.isfinite(x) for x in losses) and losses[0] == pytest.approx(
        read_jsonl(plain.metrics_path)[0]["loss"], rel=2e-2
    )


def test_fp16_needs_cuda(tmp_path):
    """fp16 (with its loss scaler) is refused on a CPU with a clear error, and trains where CUDA is present."""
    with pytest.raises(Exception, match="precision=fp16 needs CUDA"):
        train(tiny(precision="fp16", device="cpu"), tmp_path / "cpu")
    if torch.cuda.is_available():
        result = train(tiny(precision="fp16", device="cuda"), tmp_path / "cuda")
        assert all(math.isfinite(r["loss"]) for r in read_jsonl(result.metrics_path) if "loss" in r)


def test_compiled_training_runs_the_routed_experts_and_matches_eager(tmp_path, monkeypatch):
    """``compile=true`` trains through torch.compile (inductor) with the same losses as eager, and the experts
    run on their routed tokens: ``static`` (every expert on every token, E/K times the FLOPs), the path ``auto``
    took under compilation before, is never called (`moe_core.experts.impl_under_capture`)."""
    from moe_core.experts import StackedExperts

    model = {"preset": "olmoe-tiny"}  # top-2 of 8 experts: static would be 4x the expert FLOPs
    eager = train(tiny(steps=3, model=model, log={"every": 1}, checkpoint={"every": 100}), tmp_path / "eager")

    def no_static(*args, **kwargs):
        raise AssertionError("the static path ran under torch.compile")

    monkeypatch.setattr(StackedExperts, "forward_static", no_static)
    compiled = train(
        tiny(steps=3, model=model, log={"every": 1}, checkpoint={"every": 100}, compile=True),
        tmp_path / "compiled",
    )
    a = [r["loss"] for r in read_jsonl(eager.metrics_path)]
    b = [r["loss"] for r in read_jsonl(compiled.metrics_path)]
    assert len(a) == len(b) == 3 and a == pytest.approx(b, rel=1e-4)
