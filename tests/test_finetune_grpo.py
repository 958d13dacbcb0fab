"""objective=grpo (TRL's GRPOTrainer sampling through the lab's decode path) with rollout routing replay (R3):
the mean reward of a verifiable task rises, the training pass routes exactly as the rollout did (and would not
without replay), GSPO's sequence-level ratio and a reward model run, bad rewards and data stop with one error
naming the function and the example and write nothing, and TRL's internals the trainer relies on still hold."""

import copy
import inspect
import json
import math
import re
import shlex
import shutil
import types
from pathlib import Path

import pytest
import torch
from trl import GRPOTrainer

from moe_core.config import get_config
from moe_core.data.errors import DataError
from moe_core.data.tokenizer import train_tokenizer
from moe_core.finetune import FinetuneConfig, FinetuneDivergedError, FinetuneError, finetune
from moe_core.finetune.grpo import LabRollout, MoEGRPOTrainer, RewardError, RolloutRouting
from moe_core.finetune.rewards import sum_of_two
from moe_core.inference.generate import GenerationConfig, batch_generate
from moe_core.model import MoEForCausalLM
from moe_core.reward_model import reward_model_from
from moe_core.routing import RoutingReplay, RoutingReplayError, build_router, replay_weights
from moe_core.train.telemetry import read_jsonl
from tests.finetune_helpers import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

REPO = Path(__file__).resolve().parents[1]
SUM_REWARD = "moe_core.finetune.rewards:sum_of_two"


def sums_records(n: int = 25) -> list[dict]:
    return [{"prompt": f"What is {a} + {b}?"} for a in range(5) for b in range(5)][:n]


@pytest.fixture(scope="module")
def tokenizer():
    texts = [f"What is {a} + {b}?\n{a + b}" for a in range(5) for b in range(5)] * 4
    return train_tokenizer(texts, vocab_size=280, min_frequency=2)


def grpo_config(**fields) -> FinetuneConfig:
    base = {
        "objective": "grpo",
        "method": "full",
        "data": {"chat_template": "plain", "max_length": 32},
        "grpo": {"rewards": [SUM_REWARD], "num_generations": 8, "max_completion_length": 3},
        "steps": 2,
        "batch_size": 16,
        "optim": {"lr": 1e-2},
        "export": {"merged": False},
        "log": {"progress": "off"},
    }
    for key, value in fields.items():
        base[key] = {**base[key], **value} if isinstance(value, dict) and key in base else value
    return FinetuneConfig.build(base)


# ------------------------------------------------------------------------------------------------ rewards
def test_sum_of_two_checks_the_answer():
    prompts = ["What is 3 + 4?\n"] * 4 + [[{"role": "user", "content": "What is 1 + 1?"}]]
    completions = ["7", " 7 apples", "9", "no idea", [{"role": "assistant", "content": "2"}]]
    assert sum_of_two(prompts, completions) == [1.0, 1.0, pytest.approx(0.3), 0.0, 1.0]
    with pytest.raises(ValueError, match="a \\+ b"):
        sum_of_two(["hello"], ["1"])


# ------------------------------------------------------------------------------------------------ the run
def expected_reward(model, tokenizer) -> float:
    """The policy's mean `sum_of_two` reward: 8 samples (temperature 1, a fixed seed) for each of the 25 prompts,
    framed plainly as the fine-tune frames them."""
    prompts = [r["prompt"] + "\n" for r in sums_records()] * 8
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    config = GenerationConfig(
        max_new_tokens=3,
        batch_size=len(ids),
        temperature=1.0,
        seed=123,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    out = batch_generate(model, ids, config)
    rewards = sum_of_two(prompts, [tokenizer.decode(o, skip_special_tokens=True) for o in out.token_ids])
    return sum(rewards) / len(rewards)


@pytest.fixture(scope="module")
def learned(tokenizer, tmp_path_factory):
    """A short GRPO run on the sums: a tiny MoE from scratch, full fine-tuning, 4 prompts x 8 completions a step;
    the policy's expected reward before and after."""
    out = tmp_path_factory.mktemp("grpo")
    config = grpo_config(steps=16, batch_size=32, optim={"lr": 3e-2})
    model = tiny_model(vocab_size=len(tokenizer), router_aux_loss_coef=0.05, router_z_loss_coef=0.01)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the `one_thread` fixture, which a module fixture comes before
    try:
        before = expected_reward(copy.deepcopy(model), tokenizer)
        result = finetune(config, out, model=model, tokenizer=tokenizer, records=sums_records())
        after = expected_reward(result.model, tokenizer)
    finally:
        torch.set_num_threads(threads)
    return out, result, before, after


def test_the_mean_reward_rises_and_replay_leaves_no_routing_mismatch(learned):
    out, result, before, after = learned
    assert before < 0.1 and after > before + 0.2  # the policy learned to answer with (nearly) the sum
    rows = [r for r in result.metrics if "train_runtime" not in r]
    rewards = [r["reward"] for r in rows]
    assert len(rewards) == 16 and sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.1, rewards
    # R3: every routing decision the rollout made is reproduced by the training pass
    assert all(r["routing_mismatch"] == 0.0 for r in rows)
    assert all(0.0 <= r["routing_replay_changed"] <= 1.0 for r in rows)
    assert all(0.0 <= r["routing_shift"] <= 1.0 for r in rows)  # the probe's routing shift, every step
    assert any(r["routing_shift"] > 0 for r in rows)  # full fine-tuning at this lr moves the routing
    # the router losses are in the loss and logged, with the routing statistics
    assert all(r["aux_loss"] > 0.5 and r["z_loss"] > 0 for r in rows)
    assert all("moe/layer_0/entropy" in r for r in rows)
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("routing_shift" in row and "routing_replay_changed" in row for row in logged)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["skipped_steps"] == 0 and summary["steps_done"] == 16
    assert json.loads((out / "finetune_config.json").read_text())["objective"] == "grpo"


def test_the_dashboard_run_page_gets_the_routing_shift(learned):
    """The run page asks the scalars API for the GRPO keys beside the router losses (RunPage.svelte's KEYS)."""
    from fastapi.testclient import TestClient

    from dashboard.server import create_app

    out = learned[0]
    client = TestClient(create_app([out.parent]))
    runs = {r["name"]: r["id"] for r in client.get("/api/runs").json()["runs"]}
    keys = "routing_shift,routing_replay_changed,routing_mismatch,aux_loss"
    series = client.get(f"/api/runs/{runs[out.name]}/scalars?keys={keys}").json()["series"]
    assert len(series["routing_shift"]["y"]) == 16 and series["routing_mismatch"]["y"] == [0.0] * 16
    page = (REPO / "dashboard" / "web" / "src" / "RunPage.svelte").read_text()
    assert all(f'"{key}"' in page for key in keys.split(","))


def test_gspo_with_a_reward_model_and_lora_runs(tokenizer, tmp_path):
    """GSPO's sequence-level ratio (TRL's importance_sampling_level="sequence") with a reward model from
    objective=reward beside the function, under LoRA, replay off: the drift replay would remove is measured."""
    rm_dir = tmp_path / "rm"
    reward_model = reward_model_from(tiny_model(vocab_size=len(tokenizer), seed=3))
    reward_model.save_pretrained(rm_dir)
    tokenizer.save_pretrained(rm_dir)
    config = grpo_config(
        method="lora",
        grpo={"importance_sampling": "sequence", "reward_model": str(rm_dir), "routing_replay": False},
    )
    assert config.grpo.resolved_loss_type == "grpo"  # GSPO's own aggregation
    model = tiny_model(vocab_size=len(tokenizer))
    result = finetune(config, tmp_path / "out", model=model, tokenizer=tokenizer, records=sums_records())
    rows = [r for r in result.metrics if "train_runtime" not in r]
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
    assert all("rewards/reward_model/mean" in r and "rewards/sum_of_two/mean" in r for r in rows)
    assert all(r["routing_mismatch"] == r["routing_replay_changed"] for r in rows)  # nothing replayed
    assert (tmp_path / "out" / "adapter" / "adapter_config.json").is_file()


def test_a_kl_to_the_adapter_s_copy_runs_on_a_4_bit_base(tokenizer, tmp_path):
    """``grpo.beta`` above 0 under LoRA: TRL 1.16 adds the KL reference as a frozen copy of the adapter ("ref"),
    which missed the expert wrappers nested by hand over 4-bit (or memory-mapped) experts and stopped the run
    ("ModuleDict has no attribute `ref`"); every expert factor has its copy now, frozen at the start."""
    config = grpo_config(method="lora", grpo={"beta": 0.04}, quantize={"base": "int4", "group_size": 16})
    model = tiny_model(vocab_size=len(tokenizer))
    result = finetune(config, tmp_path / "out", model=model, tokenizer=tokenizer, records=sums_records())
    params = dict(result.model.named_parameters())
    expert_B = [n for n in params if ".experts." in n and ".lora_B.default." in n]
    assert expert_B
    for name in expert_B:
        ref = params[name.replace(".default.", ".ref.")]
        assert not ref.requires_grad and not ref.any()  # the adapter as it started (B = 0)
        assert params[name].any()
    rows = [r for r in result.metrics if "train_runtime" not in r]
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) and "kl" in r for r in rows)


def test_a_non_finite_step_is_skipped_and_counted(tokenizer, tmp_path, monkeypatch):
    original = MoEGRPOTrainer.compute_loss
    calls = []

    def poisoned(self, model, inputs, *args, **kwargs):
        loss = original(self, model, inputs, *args, **kwargs)
        calls.append(1)
        return loss * float("nan") if len(calls) == 2 else loss

    monkeypatch.setattr(MoEGRPOTrainer, "compute_loss", poisoned)
    model = tiny_model(vocab_size=len(tokenizer))
    result = finetune(
        grpo_config(steps=3), tmp_path, model=model, tokenizer=tokenizer, records=sums_records()
    )
    assert result.skipped_steps == 1 and result.summary["skipped_steps"] == 1
    rows = [row for row in read_jsonl(tmp_path / "metrics.jsonl") if "train_runtime" not in row]
    assert [row.get("skipped_steps") for row in rows] == [0.0, 1.0, 1.0]
    assert "loss" not in rows[1] and rows[1]["routing_shift"] == 0.0  # nothing moved
    assert all(math.isfinite(row["loss"]) for row in rows if "loss" in row)


def test_a_diverging_run_writes_nothing(tokenizer, tmp_path):
    (tmp_path / "mlflow_run.json").write_text("{}")  # what a caller put there first
    config = grpo_config(steps=3, optim={"lr": 1e30, "grad_clip": None})
    with pytest.raises(FinetuneDivergedError, match="logits are not finite.*nothing written"):
        model = tiny_model(vocab_size=len(tokenizer))
        finetune(config, tmp_path, model=model, tokenizer=tokenizer, records=sums_records())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow_run.json"]


# ------------------------------------------------------------------------------------------------ replay
def _rollout_batch(model, tokenizer, prompts):
    """Sample like `LabRollout` does and lay the rows out as TRL's training batch (prompts left-padded,
    completions right-padded)."""
    replay = RoutingReplay(model.routers())
    config = grpo_config(grpo={"max_completion_length": 4, "temperature": 1.5})
    rollout = LabRollout(tokenizer, config, replay)

    trainer = types.SimpleNamespace(model=model, state=types.SimpleNamespace(global_step=0))  # what it reads
    out = rollout(prompts, trainer)
    prompt_ids, completions = out["prompt_ids"], out["completion_ids"]
    P, C = max(map(len, prompt_ids)), max(map(len, completions))
    pad = tokenizer.pad_token_id
    batch = {
        "prompt_ids": torch.tensor([[pad] * (P - len(p)) + p for p in prompt_ids]),
        "prompt_mask": torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompt_ids]),
        "completion_ids": torch.tensor([c + [pad] * (C - len(c)) for c in completions]),
        "completion_mask": torch.tensor([[1] * len(c) + [0] * (C - len(c)) for c in completions]),
    }
    return replay, rollout, batch


def _training_forward(model, batch):
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    return model(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=(mask.cumsum(-1) - 1).clamp_min(0),  # as GRPO's training forward (`grpo_forward`)
        output_routing=True,
    )


def test_the_training_pass_reproduces_the_rollout_routing(tokenizer):
    """The rollout's routing, recorded during KV-cache decoding, is reproduced token for token by the training
    forward over the whole sequences once the router has moved (a perturbed gate: what an optimizer step or a
    different numeric path does), with gradient reaching the router; without replay it is not."""
    torch.manual_seed(0)
    model = tiny_model(vocab_size=len(tokenizer), router_aux_loss_coef=0.05)
    prompts = [f"What is {a} + {b}?\n" for a, b in [(1, 2), (3, 4), (0, 0), (4, 4), (2, 3), (1, 1)]]
    replay, rollout, batch = _rollout_batch(model, tokenizer, prompts)
    ids_LTK, dropped_LTK = rollout.routing.batch(batch)
    recorded_T = ids_LTK[0, :, 0] >= 0
    assert int(recorded_T.sum()) > 0 and not bool(dropped_LTK.any())

    # the same weights: every recorded decision is counted once per MoE layer, and reproduced
    replay.load(ids_LTK)
    _training_forward(model.eval(), batch)
    replay.unload()
    counts = replay.take_counts()
    assert counts.mismatched == 0 and counts.decisions == int(recorded_T.sum()) * len(model.routers())

    with torch.no_grad():  # the router moves
        for router in model.routers():
            router.gate.weight.add_(torch.randn_like(router.gate.weight) * 0.5)
    model.train()
    replay.apply = False
    replay.load(ids_LTK)
    _training_forward(model, batch)
    replay.unload()
    drift = replay.take_counts()
    assert drift.mismatched > 0 and drift.mismatched == drift.changed  # without replay the routing drifted

    replay.apply = True
    replay.load(ids_LTK)
    replayed = _training_forward(model, batch)
    replayed.logits.float().logsumexp(-1).mean().backward()  # through the experts' gate weights alone
    replay.unload()
    counts = replay.take_counts()
    assert counts.mismatched == 0 and counts.changed == drift.changed
    for layer, record in enumerate(replayed.routing):
        used_TK = record.expert_ids_TK[recorded_T].sort(-1).values
        assert torch.equal(used_TK, ids_LTK[layer, recorded_T].sort(-1).values)
    assert all(router.gate.weight.grad.abs().sum() > 0 for router in model.routers())
    replay.close()


@pytest.mark.parametrize(
    "preset,overrides",
    [
        ("mixtral-tiny", {}),  # softmax, top-k renormalized
        ("olmoe-tiny", {}),  # softmax probabilities as they are
        ("switch-tiny", {}),  # top-1
        ("mixtral-tiny", {"router": "aux_free"}),  # selection by score + bias, weights by score
        ("mixtral-tiny", {"router_topk_order": "topk_then_softmax"}),
        ("deepseek-tiny", {}),  # sigmoid, group-limited, scaled
    ],
)
def test_replay_weights_are_the_routers_own_for_its_own_choice(preset, overrides):
    torch.manual_seed(0)
    router = build_router(get_config(preset, **overrides))
    torch.nn.init.normal_(router.gate.weight, std=1.0)
    if hasattr(router, "expert_bias"):
        router.expert_bias.normal_()
    record = router(torch.randn(64, router.gate.in_features))
    weights_TK = replay_weights(router, record, record.expert_ids_TK)
    assert torch.equal(weights_TK.masked_fill(record.dropped_TK, 0.0), record.weights_TK)  # Switch: capacity


def test_replay_refuses_expert_choice_and_batches_it_does_not_fit():
    model = MoEForCausalLM(get_config("mixtral-tiny", router="expert_choice"))
    with pytest.raises(RoutingReplayError, match="token-choice"):
        RoutingReplay(model.routers())
    model = tiny_model()
    replay = RoutingReplay(model.routers())
    replay.load(torch.zeros(len(model.routers()), 5, 2, dtype=torch.long))
    with pytest.raises(RoutingReplayError, match="load the routing of this very batch"):
        model(input_ids=torch.ones(1, 4, dtype=torch.long))
    replay.close()


def test_rollout_routing_finds_rows_by_their_tokens(tokenizer):
    model = tiny_model(vocab_size=len(tokenizer))
    _, rollout, batch = _rollout_batch(model, tokenizer, ["What is 1 + 2?\n", "What is 4 + 4?\n"])
    shuffled = {k: v.flip(0) for k, v in batch.items()}  # TRL shuffles the generation batch
    ids, _ = rollout.routing.batch(batch)
    ids_flipped, _ = rollout.routing.batch(shuffled)
    L, T, K = ids.shape
    assert torch.equal(ids.view(L, 2, -1, K).flip(1).reshape(L, T, K), ids_flipped)
    alien = {**batch, "completion_ids": batch["completion_ids"] + 1}
    with pytest.raises(RuntimeError, match="not sampled by this rollout"):
        rollout.routing.batch(alien)
    assert isinstance(rollout.routing, RolloutRouting)


def test_the_rollout_is_the_lab_decode_path(tokenizer):
    """`LabRollout` samples exactly what `batch_generate` samples for the same prompts and seed."""
    model = tiny_model(vocab_size=len(tokenizer))
    prompts = ["What is 1 + 2?\n", "What is 3 + 3?\n"]
    _, rollout, _ = _rollout_batch(model, tokenizer, prompts)
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    again = batch_generate(
        model,
        ids,
        GenerationConfig(
            max_new_tokens=4,
            batch_size=2,
            temperature=1.5,
            seed=0,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ),
    )
    keys = {(tuple(p), tuple(c)) for p, c in zip(ids, again.token_ids)}
    assert keys == set(rollout.routing.rows)


# ------------------------------------------------------------------------------------------------ bad input
def raising_reward(prompts, completions, **_):
    if any("3 + 4" in p for p in prompts):
        raise ValueError("cannot score this one")
    return [0.0] * len(prompts)


def nan_reward(prompts, completions, **_):
    return [float("nan") if "2 + 2" in p else 0.0 for p in prompts]


@pytest.mark.parametrize(
    "reward,message",
    [
        ("tests.test_finetune_grpo:raising_reward", r"raising_reward raised ValueError.*data example 19"),
        ("tests.test_finetune_grpo:nan_reward", r"nan_reward returned nan for data example 12"),
    ],
)
def test_a_bad_reward_names_the_function_and_the_example_and_writes_nothing(
    tokenizer, tmp_path, reward, message
):
    config = grpo_config(
        steps=1, batch_size=200, grpo={"rewards": [reward]}
    )  # every prompt in the first batch
    out = tmp_path / "out"
    with pytest.raises(RewardError, match=message):
        finetune(
            config,
            out,
            model=tiny_model(vocab_size=len(tokenizer)),
            tokenizer=tokenizer,
            records=sums_records(),
        )
    assert not out.exists() or not any(out.iterdir())


def test_prompt_data_and_reward_settings_are_checked_before_the_model_loads(tokenizer, tmp_path):
    with pytest.raises(FinetuneError, match="`prompt` column"):
        finetune(
            grpo_config(),
            tmp_path / "a",
            model=tiny_model(vocab_size=len(tokenizer)),
            tokenizer=tokenizer,
            records=[{"q": "x"}],
        )
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "What is 1 + 1?"}\n{"prompt": ""}\n')
    with pytest.raises(DataError, match=r"bad.jsonl: row 2: prompt is empty"):
        finetune(
            grpo_config(data={"source": str(data)}),
            tmp_path / "b",
            model=tiny_model(vocab_size=len(tokenizer)),
            tokenizer=tokenizer,
        )
    with pytest.raises(RewardError, match="has no function 'nope'"):
        config = grpo_config(grpo={"rewards": ["moe_core.finetune.rewards:nope"]})
        finetune(
            config,
            tmp_path / "c",
            model=tiny_model(vocab_size=len(tokenizer)),
            tokenizer=tokenizer,
            records=sums_records(),
        )
    with pytest.raises(FinetuneError, match="needs a reward"):
        grpo_config(grpo={"rewards": []})
    with pytest.raises(FinetuneError, match="not an import path"):
        grpo_config(grpo={"rewards": ["sum_of_two"]})
    with pytest.raises(FinetuneError, match="multiple of it"):
        grpo_config(batch_size=6)
    with pytest.raises(FinetuneError, match="method=lora"):
        grpo_config(grpo={"beta": 0.1})
    for name in ("a", "b", "c"):
        assert not (tmp_path / name).exists() or not any((tmp_path / name).iterdir())


# ------------------------------------------------------------------------------------------------ TRL seam
def test_trl_seam():
    """What `moe_core.finetune.trl_seam` says of TRL's GRPOTrainer still holds in the installed TRL."""
    generate = inspect.getsource(GRPOTrainer._generate)
    assert "self.rollout_func(prompts, self)" in generate
    assert '{"prompt_ids", "completion_ids", "logprobs"}' in generate
    compute = inspect.getsource(GRPOTrainer._compute_loss)
    assert "torch.cat([prompt_ids, completion_ids], dim=1)" in compute
    scoring = compute[compute.index("self._get_per_token_logps_and_entropies(") :].split(")", 1)[0]
    assert "batch_size" not in scoring  # one forward over the whole micro-batch
    assert "fused_lm_head=True" in inspect.getsource(GRPOTrainer._get_per_token_logps_and_entropies)
    assert "self.aux_loss_enabled =" in inspect.getsource(GRPOTrainer.__init__)
    assert "You are using 'rollout_func'" in inspect.getsource(GRPOTrainer.__init__)
    batch = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask"):
        assert f'"{key}": {key}' in batch
    assert 'padding_side="left"' in batch and 'padding_side="right"' in batch


# ------------------------------------------------------------------------------------------------ CLI, flows
def grpo_commands() -> list[str]:
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("#### GRPO") :]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line.strip() for line in block.splitlines() if line.startswith("moe-lab ")]


def test_the_readme_grpo_command_runs_on_the_bundled_data(tokenizer, tmp_path, monkeypatch, capsys):
    from moe_core.cli import main

    shutil.copytree(REPO / "examples", tmp_path / "examples")
    base = tmp_path / "runs" / "a" / "final"
    tiny_model(vocab_size=len(tokenizer)).save_pretrained(base)
    tokenizer.save_pretrained(base)
    monkeypatch.chdir(tmp_path)
    commands = grpo_commands()
    assert commands and all("grpo" in c for c in commands)
    for command in commands:
        argv = shlex.split(command)[1:] + ["--set", "steps=2", "--set", "log.progress=off"]
        assert main(argv) == 0, command
    assert "moe-lab finetune: full/grpo, 2 steps" in capsys.readouterr().out
    summary = json.loads((tmp_path / "runs" / "ft-grpo" / "summary.json").read_text())
    assert summary["steps_done"] == 2


def test_the_flows_take_grpo_and_the_lifecycle_aligns_only_when_asked():
    from flows.finetune import FinetuneFlowParams
    from flows.params import LifecycleParams

    params = FinetuneFlowParams.model_validate(
        {"config": {"objective": "grpo", "grpo": {"rewards": SUM_REWARD}}, "base_model_dir": "runs/a/final"}
    )
    assert params.config.grpo.rewards == [SUM_REWARD]
    lifecycle = LifecycleParams()
    assert lifecycle.align.enabled is False and lifecycle.align.config.objective == "grpo"
    assert LifecycleParams.model_validate({"align": {"enabled": True}}).align.enabled
