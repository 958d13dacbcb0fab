"""``objective=grpo``: online RL with TRL's GRPOTrainer, sampled by the lab's own decode path, with the MoE routing
the rollout used replayed in the training pass.

GRPO (Shao et al. 2024, DeepSeekMath §4.1): each prompt is sampled ``grpo.num_generations`` times, each completion
scored by the rewards, and its advantage is its reward against its group's mean (divided by the group's std); the
policy gradient is clipped PPO-style on the importance ratio, per token, or per sequence with
``grpo.importance_sampling=sequence`` (GSPO, Zheng et al. 2025: the length-normalized sequence likelihood ratio,
TRL's ``importance_sampling_level="sequence"``).

What this module adds to TRL's trainer:

- Sampling through `moe_core.inference.generate.batch_generate` (prefill, then a KV-cache decode step per token,
  positions counting real tokens only), plugged in as TRL's ``rollout_func`` (`LabRollout`); TRL's own
  ``model.generate`` path is not used. The training pass gives the same positions (`grpo_forward`).
- Rollout routing replay (R3, `moe_core.routing.RoutingReplay`): while the rollout is sampled, every MoE layer's
  top-k choice for every token is recorded (`RolloutRouting`, keyed by the row's tokens); the training forward of
  each micro-batch routes its tokens to those experts again, gate weights recomputed from its own logits, so the
  routers keep their gradient. ``routing_mismatch`` (share of recorded routing decisions, a token's top-k set in one
  layer, that the training pass did not reproduce: 0 with replay) and ``routing_replay_changed`` (the share whose
  router, left alone, would have chosen otherwise) are logged every step; with ``grpo.routing_replay=false`` the
  same counts measure the drift replay would have removed.
- ``routing_shift``: the share of routing decisions on a fixed probe batch (the first ``grpo.probe_prompts``
  prompts) whose top-k set changed since the previous optimizer step (`RoutingShiftProbe`).
- Rewards: Python functions named by import path (``grpo.rewards``) and/or a reward model (``grpo.reward_model``,
  `RewardModelScorer`), each wrapped in `CheckedReward`: one that raises, returns NaN, None or the wrong count
  stops the run with `RewardError` naming the function and the data example, and nothing is written.
- The router losses of the policy's training forward (`moe_core.router_losses`, through the model's
  ``router_loss``) added to GRPO's loss, scaled as TRL scales it for accumulation; non-finite steps skipped and
  counted (`objectives.FiniteStepGuard`), routing statistics logged (`objectives._MoEMetrics`).

Where TRL's internals are relied on: `moe_core.finetune.trl_seam`.

Legend: B = completions in a micro-batch, P = prompt length, C = completion length, S = P + C, L = MoE layers,
K = experts per token, T = tokens (B * S), N = a row's tokens with a recorded routing.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
import types
from typing import Any

import torch
from transformers import TrainerCallback
from trl import GRPOTrainer

from moe_core.data.framing import PLAIN, read_framing
from moe_core.finetune import expert_lora
from moe_core.finetune.config import FinetuneConfig, FinetuneDivergedError, FinetuneError
from moe_core.finetune.methods import MethodPlan, unwrap
from moe_core.finetune.objectives import (
    EXAMPLE_INDEX,
    _config_kept,
    _MoEMetrics,
    _with_router_loss,
    answer_token_ids,
    fused_forward,
    prompt_token_ids,
)
from moe_core.finetune.trl_seam import batch_layout, rollout_func_accepted, without_trl_aux_loss
from moe_core.inference.generate import GenerationConfig, batch_generate
from moe_core.loading import load
from moe_core.reward_model import MoEForSequenceClassification
from moe_core.routing import RoutingReplay


class RewardError(FinetuneError):
    """A reward that cannot be used: not importable, not callable, raised, or returned a non-number."""


# ------------------------------------------------------------------------------------------------ rewards
class CheckedReward:
    """A reward function as TRL calls it (``f(prompts=, completions=, **columns)``), its output checked: one finite
    number per completion. Anything else stops the run with `RewardError` naming the function and the data
    example (`objectives.EXAMPLE_INDEX`, taken out of the columns the function sees)."""

    def __init__(self, func, name: str) -> None:
        self.func, self.name = func, name
        self.__name__ = name.rpartition(":")[2] or name  # TRL logs rewards/<__name__>/mean

    def __call__(self, prompts, completions, **columns) -> list[float]:
        examples = columns.pop(EXAMPLE_INDEX, None) or list(range(len(prompts)))
        try:
            values = list(self.func(prompts=prompts, completions=completions, **columns))
        except Exception as err:
            i = self._first_failing(prompts, completions, columns)
            where = (
                f"data example {examples[i]}" if i is not None else f"data examples {sorted(set(examples))}"
            )
            message = str(err)[:200]
            raise RewardError(
                f"reward function {self.name} raised {type(err).__name__}({message!r}) on {where}; fix the "
                "function or that example (nothing written)"
            ) from err
        if len(values) != len(prompts):
            raise RewardError(
                f"reward function {self.name} returned {len(values)} rewards for {len(prompts)} completions; "
                "return one number per completion (nothing written)"
            )
        rewards = []
        for i, value in enumerate(values):
            try:
                reward = float(value)
            except (TypeError, ValueError):
                reward = None
            if reward is None or not math.isfinite(reward):
                raise RewardError(
                    f"reward function {self.name} returned {value!r} for data example {examples[i]}; every "
                    "completion needs a finite number (nothing written)"
                )
            rewards.append(reward)
        return rewards

    def _first_failing(self, prompts, completions, columns) -> int | None:
        """The first completion the function fails on alone; None when each passes alone (a batch-level fault)."""
        n = len(prompts)
        for i in range(n):
            one = {
                k: (v[i : i + 1] if isinstance(v, list) and len(v) == n else v) for k, v in columns.items()
            }
            try:
                self.func(prompts=prompts[i : i + 1], completions=completions[i : i + 1], **one)
            except Exception:
                return i
        return None


def import_reward(path: str):
    """The function at ``path`` ("package.module:function"), imported; `RewardError` when it is not there."""
    module_name, _, name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise RewardError(
            f"grpo.rewards: {path!r}: module {module_name!r} cannot be imported ({err})"
        ) from None
    func = getattr(module, name, None)
    if not callable(func):
        raise RewardError(f"grpo.rewards: {path!r}: module {module_name!r} has no function {name!r}")
    return func


class RewardModelScorer:
    """A reward model (`moe_core.reward_model`, objective=reward's output) as a reward function: each prompt +
    completion framed as reward training framed its pairs (`objectives.answer_token_ids`), the score of its last
    token. Frozen, in eval mode, under no_grad."""

    __name__ = "reward_model"

    def __init__(self, model: MoEForSequenceClassification, tokenizer, batch_size: int = 16) -> None:
        self.model, self.tokenizer, self.batch_size = (
            model.eval().requires_grad_(False),
            tokenizer,
            batch_size,
        )

    @torch.no_grad()
    def __call__(self, prompts, completions, **_columns) -> list[float]:
        device = next(self.model.parameters()).device
        pad = self.tokenizer.pad_token_id or 0
        rewards: list[float] = []
        for start in range(0, len(prompts), self.batch_size):
            seqs = [
                answer_token_ids(self.tokenizer, p, c)
                for p, c in zip(
                    prompts[start : start + self.batch_size], completions[start : start + self.batch_size]
                )
            ]
            S = max(len(s) for s in seqs)
            ids_BS = torch.full((len(seqs), S), pad, dtype=torch.long)
            mask_BS = torch.zeros((len(seqs), S), dtype=torch.long)
            for b, s in enumerate(seqs):  # right padding: the score is read at the last real token
                ids_BS[b, : len(s)] = torch.tensor(s)
                mask_BS[b, : len(s)] = 1
            out = self.model(input_ids=ids_BS.to(device), attention_mask=mask_BS.to(device))
            rewards.extend(out.logits[:, 0].float().tolist())
        return rewards


def load_reward_model(path: str, plain: bool) -> RewardModelScorer:
    """The reward model at ``path``, refused when it is not one or frames prompts unlike this fine-tune."""
    loaded = load(path)
    if not isinstance(loaded.model, MoEForSequenceClassification):
        raise RewardError(
            f"grpo.reward_model={path!r} is a {loaded.kind} checkpoint, not a reward model; give objective=reward's "
            "output (its directory or merged/)"
        )
    if loaded.tokenizer is None:
        raise RewardError(f"grpo.reward_model={path!r} has no tokenizer beside it")
    framing = read_framing(loaded.tokenizer_dir)
    if framing is not None and (framing.kind == PLAIN) != plain:
        raise RewardError(
            f"grpo.reward_model={path!r} was trained on {framing.kind} framing, this fine-tune frames prompts "
            f"{'plain' if plain else 'with a chat template'}: set data.chat_template to match"
        )
    tokenizer = loaded.tokenizer
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return RewardModelScorer(loaded.model, tokenizer)


def load_rewards(config: FinetuneConfig, plain: bool) -> list[CheckedReward]:
    """``grpo.rewards`` imported and ``grpo.reward_model`` loaded, each checked (`CheckedReward`)."""
    rewards = [CheckedReward(import_reward(path), path) for path in config.grpo.rewards]
    if config.grpo.reward_model is not None:
        scorer = load_reward_model(config.grpo.reward_model, plain)
        rewards.append(CheckedReward(scorer, f"reward model {config.grpo.reward_model}"))
        rewards[-1].__name__ = "reward_model"
    return rewards


# ------------------------------------------------------------------------------------------------ rollout
class RolloutRouting:
    """The routing each rollout row was sampled with, per token and MoE layer, keyed by the row's tokens (its
    prompt ids, its completion ids): what TRL shuffles and splits into micro-batches comes back here by content.
    Rows that are identical token for token were routed identically (routing is per token, dropless) and share a
    key. Holds one generation batch: `clear` at each rollout."""

    def __init__(self) -> None:
        self.rows: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[torch.Tensor, torch.Tensor]] = {}

    def clear(self) -> None:
        self.rows.clear()

    def add(self, trace, order: list[int], prompt_ids: list[list[int]], completions: list[list[int]]) -> None:
        """Store each row's routing from ``trace`` (`RoutingReplay.recording` over one `batch_generate` batch:
        a prefill over [B, P] left-padded prompts, then a decode step per token), ``order`` the prompt index of
        each batch row. Kept per row: the prompt's tokens and every completion token that was fed back (all
        but the last: nothing reads its routing), ids_NLK and dropped_NLK."""
        B = len(order)
        prefill = [layer[0] for layer in trace]
        P = prefill[0][0].shape[0] // B
        K = prefill[0][0].shape[1]
        ids_LBPK = torch.stack([ids.view(B, P, K) for ids, _ in prefill])
        dropped_LBPK = torch.stack([dropped.view(B, P, K) for _, dropped in prefill])
        steps = len(trace[0]) - 1
        if steps:
            ids_LJBK = torch.stack([torch.stack([ids.view(B, K) for ids, _ in layer[1:]]) for layer in trace])
            dropped_LJBK = torch.stack([torch.stack([d.view(B, K) for _, d in layer[1:]]) for layer in trace])
        for row, i in enumerate(order):
            n, c = len(prompt_ids[i]), len(completions[i])
            if c - 1 > steps:
                raise RuntimeError(f"rollout row {row}: {c} tokens but {steps} decode steps were recorded")
            ids_NLK = [ids_LBPK[:, row, P - n :].permute(1, 0, 2)]
            dropped_NLK = [dropped_LBPK[:, row, P - n :].permute(1, 0, 2)]
            if c > 1:
                ids_NLK.append(ids_LJBK[:, : c - 1, row].permute(1, 0, 2))
                dropped_NLK.append(dropped_LJBK[:, : c - 1, row].permute(1, 0, 2))
            key = (tuple(prompt_ids[i]), tuple(completions[i]))
            self.rows[key] = (torch.cat(ids_NLK), torch.cat(dropped_NLK))

    def batch(self, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The recorded routing of a TRL training micro-batch, laid out as its forward routes it: ids_LTK and
        dropped_LTK over T = B * (P + C) tokens, ``-1`` where nothing was recorded (padding, each completion's
        last token)."""
        prompt_ids_BP, prompt_mask_BP, completion_ids_BC, completion_mask_BC = batch_layout(inputs)
        (B, P), C = prompt_ids_BP.shape, completion_ids_BC.shape[1]
        some_ids, _ = next(iter(self.rows.values()))
        L, K = some_ids.shape[1:]
        ids_BSLK = torch.full((B, P + C, L, K), -1, dtype=torch.long)
        dropped_BSLK = torch.zeros((B, P + C, L, K), dtype=torch.bool)
        for b in range(B):
            prompt = prompt_ids_BP[b][prompt_mask_BP[b].bool()].tolist()
            completion = completion_ids_BC[b][completion_mask_BC[b].bool()].tolist()
            found = self.rows.get((tuple(prompt), tuple(completion)))
            if found is None:
                raise RuntimeError(
                    f"routing replay: row {b} of the training batch was not sampled by this rollout (TRL's batch "
                    "layout changed? see moe_core.finetune.trl_seam)"
                )
            ids_NLK, dropped_NLK = found
            start = P - len(prompt)
            ids_BSLK[b, start : start + len(ids_NLK)] = ids_NLK
            dropped_BSLK[b, start : start + len(ids_NLK)] = dropped_NLK
        return (
            ids_BSLK.permute(2, 0, 1, 3).reshape(L, B * (P + C), K),
            dropped_BSLK.permute(2, 0, 1, 3).reshape(L, B * (P + C), K),
        )


class LabRollout:
    """TRL's ``rollout_func``: the prompts tokenized as training frames them (`objectives.prompt_token_ids`) and
    sampled in one batch by `batch_generate` (temperature, top-k, a seed per call), the routing of every token
    recorded into ``routing`` when a `RoutingReplay` is given. The batch's row order is read from the stream of
    new tokens (the first step emits one per row, in row order)."""

    def __init__(self, tokenizer, config: FinetuneConfig, replay: RoutingReplay | None) -> None:
        self.tokenizer, self.replay = tokenizer, replay
        grpo = config.grpo
        self.settings = dict(
            max_new_tokens=grpo.max_completion_length, temperature=grpo.temperature, top_k=grpo.top_k
        )
        self.seed = config.seed
        self.calls = 0
        self.routing = RolloutRouting()

    def __call__(self, prompts: list, trainer) -> dict[str, Any]:
        prompt_ids = [prompt_token_ids(self.tokenizer, p) for p in prompts]
        generation = GenerationConfig(
            batch_size=len(prompt_ids),
            seed=self.seed * 1_000_003 + self.calls,  # a fresh, reproducible draw per rollout
            eos_token_id=self.tokenizer.eos_token_id,
            pad_token_id=self.tokenizer.pad_token_id,
            **self.settings,
        )
        self.calls += 1
        order: list[int] = []

        def on_token(i: int, token_id: int, text) -> None:
            if len(order) < len(prompt_ids):
                order.append(i)

        self.routing.clear()
        recording = self.replay.recording() if self.replay is not None else contextlib.nullcontext()
        head = unwrap(trainer.model).get_output_embeddings()
        guard = head.register_forward_hook(FiniteLogits(trainer.state.global_step))
        try:
            with recording as trace:
                result = batch_generate(trainer.model, prompt_ids, generation, on_token=on_token)
        finally:
            guard.remove()
        if trace is not None:
            self.routing.add(trace, order, prompt_ids, result.token_ids)
        return {"prompt_ids": prompt_ids, "completion_ids": result.token_ids, "logprobs": None}


class FiniteLogits:
    """A forward hook on the LM head while the rollout samples: logits that are not finite stop the run with
    `FinetuneDivergedError` before a token is drawn from them (a step too large for the optimizer: its loss and
    gradient were finite, so `FiniteStepGuard` let it through, and sampling would fail on NaN probabilities)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def __call__(self, module, args, logits) -> None:
        if not bool(torch.isfinite(logits).all()):
            raise FinetuneDivergedError(
                f"after step {self.step} the policy's logits are not finite (the last step was too large: its loss "
                "and gradient were finite); nothing written. Lower optim.lr, keep optim.grad_clip on, or use "
                "method=lora"
            )


def grpo_forward(self, *args, temperature: float = 1.0, fused_lm_head: bool = False, **kwargs):
    """The policy's forward under GRPO: TRL's scoring calls (``fused_lm_head=True``) get `fused_forward` at the
    sampling temperature, with positions counted over real tokens, as `batch_generate` counts them for a
    left-padded prompt (TRL passes no position ids)."""
    mask = kwargs.get("attention_mask")
    if fused_lm_head and kwargs.get("position_ids") is None and mask is not None:
        kwargs["position_ids"] = (mask.long().cumsum(-1) - 1).clamp_min(0)
    return fused_forward(self, *args, fused_lm_head=fused_lm_head, temperature=temperature, **kwargs)


# ------------------------------------------------------------------------------------------------ telemetry
class RoutingShiftProbe:
    """The policy's routing shift per optimizer step: the share of routing decisions (a token's top-k set in one
    MoE layer) on a fixed probe batch whose set changed since the previous measurement. Eval mode, no_grad."""

    def __init__(self, tokenizer, prompts: list) -> None:
        seqs = [prompt_token_ids(tokenizer, p) for p in prompts]
        S = max(len(s) for s in seqs)
        pad = tokenizer.pad_token_id or 0
        self.ids_BS = torch.full((len(seqs), S), pad, dtype=torch.long)
        self.mask_BS = torch.zeros((len(seqs), S), dtype=torch.long)
        for b, s in enumerate(seqs):  # right padding: positions from 0, as each prompt alone
            self.ids_BS[b, : len(s)] = torch.tensor(s)
            self.mask_BS[b, : len(s)] = 1
        self.previous_LTK: torch.Tensor | None = None
        self.shifts: list[float] = []

    @torch.no_grad()
    def measure(self, model) -> float | None:
        """Route the probe batch; the shift since the last call (None on the first)."""
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        try:
            out = model(
                input_ids=self.ids_BS.to(device),
                attention_mask=self.mask_BS.to(device),
                use_cache=False,
                output_routing=True,
            )
        finally:
            model.train(was_training)
        sets_LTK = torch.stack([r.expert_ids_TK.sort(dim=-1).values for r in out.routing]).cpu()
        previous, self.previous_LTK = self.previous_LTK, sets_LTK
        if previous is None:
            return None
        real_T = self.mask_BS.flatten().bool()
        changed_LT = (sets_LTK != previous).any(dim=-1)[:, real_T]
        return float(changed_LT.float().mean())

    def interval_metrics(self) -> dict[str, float]:
        """``routing_shift``: the mean over the optimizer steps since the last call (absent if none)."""
        shifts, self.shifts = self.shifts, []
        return {"routing_shift": sum(shifts) / len(shifts)} if shifts else {}


class RoutingShiftCallback(TrainerCallback):
    """Measures `RoutingShiftProbe` before training and after every optimizer step (after the router biases
    moved: add it after `objectives.MoEStepCallback`)."""

    def __init__(self, probe: RoutingShiftProbe) -> None:
        self.probe = probe

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.probe.measure(model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        shift = self.probe.measure(model)
        if shift is not None:
            self.probe.shifts.append(shift)


# ------------------------------------------------------------------------------------------------ trainer
class MoEGRPOTrainer(_MoEMetrics, GRPOTrainer):
    """TRL's GRPOTrainer sampling with `LabRollout`, replaying the rollout's routing in the training pass, with
    our router losses and routing telemetry; see the module docstring."""

    loss_is_scaled_for_ga = True  # GRPO divides its loss by the accumulation steps itself (TRL)

    def __init__(
        self,
        model,
        *args,
        rollout: LabRollout,
        replay: RoutingReplay | None = None,
        probe: RoutingShiftProbe | None = None,
        temperature: float = 1.0,
        plan: MethodPlan | None = None,
        log_routing: bool = True,
        per_expert: bool = False,
        **kwargs,
    ) -> None:
        # with grpo.beta above 0 TRL adds the KL reference as a frozen copy of the adapter: on our injected experts too
        with _config_kept(model), rollout_func_accepted(), expert_lora.adapters_reach_injected_experts(model):
            super().__init__(model, *args, rollout_func=rollout, **kwargs)
        without_trl_aux_loss(self)
        base = unwrap(self.model)  # TRL's fused head patched in; ours answers its calls instead
        base.forward = types.MethodType(functools.partial(grpo_forward, temperature=temperature), base)
        self._rollout, self._replay, self._probe = rollout, replay, probe
        self._setup_moe(plan, log_routing, per_expert)

    def training_step(self, model, inputs, num_items_in_batch=None):
        try:  # the replayed routing holds through backward (a recomputing checkpointed forward), then goes
            return super().training_step(model, inputs, num_items_in_batch)
        finally:
            if self._replay is not None:
                self._replay.unload()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if self.model.training else "eval"
        if self._replay is not None and mode == "train":
            self._replay.load(*self._rollout.routing.batch(inputs))
        self._base._moe_router_out = None
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        out = self._base.__dict__.pop("_moe_router_out", None)
        scale = 1.0 / self.current_gradient_accumulation_steps if mode == "train" else 1.0
        return _with_router_loss(self, loss, out, mode, False, router_scale=scale)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:  # a training step's row
            if self._replay is not None:
                counts = self._replay.take_counts()
                if counts.decisions:
                    logs["routing_mismatch"] = counts.mismatched / counts.decisions
                    logs["routing_replay_changed"] = counts.changed / counts.decisions
            if self._probe is not None:
                logs.update(self._probe.interval_metrics())
        super().log(logs, start_time)

    def close(self) -> None:
        """Take the replay hooks off the model (`finetune` does after training: the exported model has none)."""
        if self._replay is not None:
            self._replay.close()


def grpo_trainer(
    config: FinetuneConfig, train_model, tokenizer, dataset, rewards, callbacks, **trainer_kwargs
):
    """`MoEGRPOTrainer` for ``config`` on ``dataset`` (`objectives.grpo_dataset` rows): the rollout, the routing
    replay (recording always, replaying when ``grpo.routing_replay``; none for a dense model) and the routing
    shift probe on the first ``grpo.probe_prompts`` prompts."""
    base = unwrap(train_model)
    routers = base.routers() if base.config.num_experts else []
    replay = RoutingReplay(routers, apply=config.grpo.routing_replay) if routers else None
    probe = None
    if routers:
        probe = RoutingShiftProbe(tokenizer, dataset[: config.grpo.probe_prompts]["prompt"])
        callbacks = [*callbacks, RoutingShiftCallback(probe)]
    return MoEGRPOTrainer(
        train_model,
        reward_funcs=rewards,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=callbacks,
        rollout=LabRollout(tokenizer, config, replay),
        replay=replay,
        probe=probe,
        temperature=config.grpo.temperature,
        **trainer_kwargs,
    )
