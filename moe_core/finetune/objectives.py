"""SFT, DPO, ORPO, KTO and reward models through TRL, with the MoE load-balancing loss kept in the objective and
logged.

Why subclasses: TRL 1.16 computes both losses through a "fused LM head" it patches onto the model
(`trl.trainer.utils.add_fused_lm_head`), which expects a transformers backbone returning ``last_hidden_state``
and adds an MoE auxiliary loss only for models whose config has ``output_router_logits`` (transformers' Mixtral
family). Our model has neither, so TRL as-is would fail, or (worse, on a model it could run) silently drop the
router loss during fine-tuning.

- `MoESFTTrainer` keeps TRL's data pipeline (chat template, prompt/completion masking, truncation, collation) and
  takes the loss from our model's own forward: ``lm_loss + router_loss`` (`moe_core.model`), so the router
  losses are in whenever their coefficient is above zero. ``lm_loss``, ``aux_loss`` and ``z_loss`` are logged
  next to ``loss``.
- `MoEDPOTrainer` keeps TRL's DPO loss and metrics; the fused head TRL calls is replaced by `fused_forward`
  (per-token log-probabilities from our logits), and the policy forward's ``router_loss`` is added to the DPO
  loss in training (TRL does the same for Mixtral via ``output_router_logits``), and logged. The reference
  forward never carries router losses.
- `MoEKTOTrainer` (TRL's KTOTrainer: unpaired prompt/completion/label data) works as `MoEDPOTrainer`: the fused
  head is `fused_forward`, the policy forward's ``router_loss`` is added to the KTO loss; the KL reference
  forward (under no_grad) and the reference model's carry none.
- `MoEORPOTrainer` (ORPO, Hong et al. 2024) uses ``trl.experimental.orpo.ORPOTrainer``: experimental upstream, so
  its API may change between TRL releases (pinned by constraints.txt). ORPO calls the model's forward and
  reads its logits; a forward pre-hook asks the policy forward (under autograd) for its routing and a forward
  hook keeps its output, whose ``router_loss`` is added to the ORPO loss (PyTorch's public module hooks, on our
  model only).
- `MoERewardTrainer` trains a reward model (`moe_core.reward_model.MoEForSequenceClassification`) with TRL's
  RewardTrainer (pairwise loss); the reward forward returns ``router_loss`` like the causal LM's, added to the
  pairwise loss.
- Every trainer weighs the router losses alike: the model's ``router_loss`` comes from
  `moe_core.router_losses.router_loss` (the coefficients and the layer reduction in one place), computed over
  the non-padding tokens.
- Both divide by the gradient-accumulation steps themselves (``loss_is_scaled_for_ga = False``): our loss is a
  per-micro-batch mean, and transformers would otherwise assume a model with ``**kwargs`` scales it already.
- Both skip TRL's usage-telemetry ping: a library run never calls home.
- Both skip a step whose loss or gradient is not finite, as pretraining does (`FiniteStepGuard`): no weight,
  optimizer or router-bias update, counted in ``skipped_steps``; the logged ``loss`` is the mean over the finite
  steps of the interval (absent when there was none), never a stand-in; more than
  ``faults.max_bad_steps_in_a_row`` in a row stops the run with `FinetuneDivergedError`.

- On several processes (`moe_core.finetune.parallel.ExpertGradients`, handed in with `use_parallel_gradients`)
  the last micro-step of every optimizer step syncs the expert gradients and clips by the global norm (the
  Trainer's own clip is off); the logged ``loss``, ``grad_norm``, ``lm_loss``, ``aux_loss``, ``z_loss`` and
  ``mean_token_accuracy`` are the world's, the routing statistics rank 0's. Checkpoints are per rank
  (`moe_core.finetune.trainer_seam`).

Metrics go through `moe_core.train.telemetry` sinks (`SinkCallback`; the JSONL sink is always on), with per-layer
routing statistics (`RoutingStats`): numbers only, never text.
"""

from __future__ import annotations

import contextlib
import math
import types
from typing import Any

import datasets
import torch
from transformers import TrainerCallback
from trl import (
    DPOConfig,
    DPOTrainer,
    GRPOConfig,
    KTOConfig,
    KTOTrainer,
    RewardConfig,
    RewardTrainer,
    SFTConfig,
    SFTTrainer,
)
from trl.experimental.orpo import ORPOConfig, ORPOTrainer
from trl.trainer.utils import FusedCausalLMOutput

from moe_core.data.framing import plain_text
from moe_core.data.sources import to_messages
from moe_core.finetune import expert_lora
from moe_core.finetune.config import FinetuneConfig, FinetuneDivergedError, FinetuneError
from moe_core.finetune.methods import MethodPlan, expert_axes, unwrap
from moe_core.finetune.parallel import ExpertGradients
from moe_core.finetune.trainer_seam import PerRankCheckpoints
from moe_core.progress import Progress
from moe_core.train.optim import ExpertAdamW
from moe_core.train.telemetry import RoutingStats


# ------------------------------------------------------------------------------------------------ datasets
def instruction_messages(record: dict[str, Any], index: int) -> list[dict[str, str]]:
    messages = to_messages(record)
    if len(messages) < 2 or messages[-1]["role"] != "assistant":
        raise FinetuneError(
            f"instruction example {index}: the last turn must be the assistant's answer "
            f"(got roles {[m['role'] for m in messages]}); fix or drop that row"
        )
    return messages


def task_names_of(records, task_column: str | None) -> list[str]:
    if not task_column:
        return []
    columns = getattr(records, "column_names", None) or (list(records[0]) if len(records) else [])
    if task_column not in columns:
        raise FinetuneError(
            f"data.task_column={task_column!r} is not a column of the data (columns: {columns})"
        )
    return sorted({str(r[task_column]) for r in records})


def sft_dataset(
    records, task_column: str | None = None, task_names: list[str] | None = None, *, plain: bool = False
):
    """Instruction records (alpaca or chat) as TRL prompt/completion rows: the prompt is every turn before the
    last assistant answer, the completion that answer; ``task_index`` when tasks are given. Conversational rows
    (turns, framed by the chat template), or with ``plain`` TRL's non-conversational rows: the prompt as plain
    text (`moe_core.data.framing.plain_text`) and the answer's text (TRL appends EOS)."""
    rows: dict[str, list[Any]] = {"prompt": [], "completion": []}
    if task_column:
        rows["task_index"] = []
    for i, record in enumerate(records):
        messages = instruction_messages(record, i)
        if plain:
            rows["prompt"].append(plain_text(messages[:-1]))
            rows["completion"].append(messages[-1]["content"])
        else:
            rows["prompt"].append(messages[:-1])
            rows["completion"].append(messages[-1:])
        if task_column:
            rows["task_index"].append(task_names.index(str(record[task_column])))
    return datasets.Dataset.from_dict(rows)


def _turns(value, role: str) -> list[dict[str, Any]]:
    return [{"role": role, "content": value}] if isinstance(value, str) else list(value)


def dpo_dataset(records, *, plain: bool = False):
    """Preference records (``prompt``, ``chosen``, ``rejected``; strings or chat turns) as conversational rows, so
    the tokenizer's chat template frames them like the SFT data; with ``plain``, as TRL's non-conversational
    rows framed like plain SFT data (the prompt's text and a newline; each answer's text, to which TRL appends
    EOS)."""
    rows: dict[str, list[Any]] = {"prompt": [], "chosen": [], "rejected": []}
    for i, record in enumerate(records):
        prompt, chosen, rejected = record["prompt"], record["chosen"], record["rejected"]
        if any(v is None or (isinstance(v, str) and not v) for v in (prompt, chosen, rejected)):
            raise FinetuneError(
                f"preference example {i}: empty prompt, chosen or rejected; fix or drop that row"
            )
        if plain:
            rows["prompt"].append(plain_text(_turns(prompt, "user")))
            for key, value in (("chosen", chosen), ("rejected", rejected)):
                rows[key].append("\n".join(str(t.get("content") or "") for t in _turns(value, "assistant")))
            continue
        rows["prompt"].append(_turns(prompt, "user"))
        for key, value in (("chosen", chosen), ("rejected", rejected)):
            rows[key].append(_turns(value, "assistant"))
    return datasets.Dataset.from_dict(rows)


def kto_dataset(records, *, plain: bool = False):
    """KTO records (``prompt``, ``completion``: strings or chat turns; ``label``: true for a desirable completion,
    false for an undesirable one) as conversational rows framed by the chat template, or with ``plain`` as TRL's
    non-conversational rows (as `dpo_dataset`). A row without a boolean label is refused, naming it."""
    rows: dict[str, list[Any]] = {"prompt": [], "completion": [], "label": []}
    for i, record in enumerate(records):
        prompt, completion, label = record.get("prompt"), record.get("completion"), record.get("label")
        if any(v is None or (isinstance(v, str) and not v) for v in (prompt, completion)):
            raise FinetuneError(f"KTO example {i}: empty prompt or completion; fix or drop that row")
        if not isinstance(label, bool):
            raise FinetuneError(
                f"KTO example {i}: label is {'missing' if label is None else repr(type(label).__name__)}; "
                "each row needs label true (a desirable completion) or false (an undesirable one)"
            )
        rows["label"].append(label)
        if plain:
            rows["prompt"].append(plain_text(_turns(prompt, "user")))
            rows["completion"].append(
                "\n".join(str(t.get("content") or "") for t in _turns(completion, "assistant"))
            )
            continue
        rows["prompt"].append(_turns(prompt, "user"))
        rows["completion"].append(_turns(completion, "assistant"))
    return datasets.Dataset.from_dict(rows)


# the column `grpo_dataset` adds: each row's index in the data, for errors that name the example (the reward
# checks in `moe_core.finetune.grpo` take it out before a reward function sees the columns)
EXAMPLE_INDEX = "example_index"


def grpo_dataset(records, *, plain: bool = False):
    """Prompt records (``prompt``: a string or chat turns; any other columns, which reach the reward functions)
    as TRL's GRPO rows: the prompt as conversational turns framed by the chat template, or with ``plain`` as
    plain text (`moe_core.data.framing.plain_text`); plus `EXAMPLE_INDEX`. A row without a prompt is refused,
    naming it."""
    columns = getattr(records, "column_names", None) or (list(records[0]) if len(records) else [])
    if "prompt" not in columns:
        raise FinetuneError(
            f"objective=grpo reads prompt data: a `prompt` column (text or chat turns), found {columns}"
        )
    extra = [c for c in columns if c not in ("prompt", EXAMPLE_INDEX)]
    rows: dict[str, list[Any]] = {"prompt": [], **{c: [] for c in extra}, EXAMPLE_INDEX: []}
    for i, record in enumerate(records):
        prompt = record["prompt"]
        if prompt is None or (isinstance(prompt, str | list) and not prompt):
            raise FinetuneError(f"prompt example {i}: empty prompt; fix or drop that row")
        turns = _turns(prompt, "user")
        rows["prompt"].append(plain_text(turns) if plain else turns)
        for c in extra:
            rows[c].append(record[c])
        rows[EXAMPLE_INDEX].append(i)
    return datasets.Dataset.from_dict(rows)


def prompt_token_ids(tokenizer, prompt) -> list[int]:
    """A TRL prompt row's token ids as training frames it: plain text (a string) as ``tokenizer`` encodes it, or
    turns with the chat template and the generation prompt."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"])
    # return_dict=False: the ids themselves (transformers 5 returns a BatchEncoding by default)
    return list(
        tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True, return_dict=False)
    )


def objective_dataset(objective: str, records, *, plain: bool = False, task_column=None, task_names=None):
    """The TRL rows of ``records`` for ``objective``: `sft_dataset`, `dpo_dataset` (dpo, orpo, reward),
    `kto_dataset` or `grpo_dataset`."""
    if objective == "sft":
        return sft_dataset(records, task_column, task_names, plain=plain)
    if objective == "kto":
        return kto_dataset(records, plain=plain)
    if objective == "grpo":
        return grpo_dataset(records, plain=plain)
    return dpo_dataset(records, plain=plain)


def answered_messages(objective: str, record: dict[str, Any], index: int) -> list[dict[str, Any]]:
    """One training example as turns ending in its answer (preference data: the chosen one; KTO: the completion,
    desirable or not; GRPO: none, an empty turn): what ESFT's routing profile routes through the base model."""
    if objective == "sft":
        return instruction_messages(record, index)
    if objective == "grpo":  # prompts only: an empty answer
        return _turns(record["prompt"], "user") + [{"role": "assistant", "content": ""}]
    answer = record["completion"] if objective == "kto" else record["chosen"]
    return _turns(record["prompt"], "user") + _turns(answer, "assistant")


def answer_token_ids(tokenizer, prompt, answer) -> list[int]:
    """A TRL row's prompt followed by an answer, tokenized as TRL's RewardTrainer tokenizes a preference pair's
    side: plain text (strings) with EOS appended, or the chat template over the prompt's and the answer's turns.
    What a reward model scores (`reward_pair_ids`; GRPO's `moe_core.finetune.grpo.RewardModelScorer`)."""
    if isinstance(prompt, str):
        text = answer if isinstance(answer, str) else "\n".join(str(t.get("content") or "") for t in answer)
        return list(tokenizer(prompt + text + tokenizer.eos_token)["input_ids"])
    turns = _turns(answer, "assistant")
    return list(tokenizer.apply_chat_template(prompt + turns, tokenize=True, return_dict=False))


def reward_pair_ids(tokenizer, records, *, plain: bool = False) -> list[tuple[list[int], list[int]]]:
    """(chosen ids, rejected ids) of each preference record, the whole sequence tokenized as TRL's
    RewardTrainer tokenizes it (`answer_token_ids`), for `moe_core.reward_model.pairwise_accuracy`."""
    return [
        (
            answer_token_ids(tokenizer, row["prompt"], row["chosen"]),
            answer_token_ids(tokenizer, row["prompt"], row["rejected"]),
        )
        for row in dpo_dataset(records, plain=plain)
    ]


def template_renderings(dataset):
    """What TRL renders with the chat template for each row of `sft_dataset` / `dpo_dataset`: the prompt with
    the generation prompt, and the prompt followed by each answer (`moe_core.data.chat_template` checks them
    all, bounded, before the model loads)."""
    for i, row in enumerate(dataset):
        yield i, row["prompt"], True
        for key in ("completion", "chosen", "rejected"):
            if key in row:
                yield i, row["prompt"] + row[key], False


class TaskCollator:
    """Wraps TRL's collator and adds ``task_ids`` [B] from each example's ``task_index``."""

    def __init__(self, base) -> None:
        self.base = base

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        task_ids = torch.tensor([int(ex["task_index"]) for ex in examples])
        keep = ("input_ids", "labels", "seq_lengths")
        batch = self.base([{k: v for k, v in ex.items() if k in keep} for ex in examples])
        batch["task_ids"] = task_ids
        return batch


# ------------------------------------------------------------------------------------------------ callbacks
class SinkCallback(TrainerCallback):
    """Forward every numeric log of the Trainer to `moe_core.train.telemetry` sinks (``log(step, metrics)``)."""

    def __init__(self, sinks) -> None:
        self.sinks = list(sinks)

    def on_log(self, args, state, control, logs=None, **kwargs):
        metrics = {
            k: float(v)
            for k, v in (logs or {}).items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }
        for sink in self.sinks:
            sink.log(state.global_step, metrics)


class ProgressCallback(TrainerCallback):
    """The fine-tuning progress display (`moe_core.progress.Progress`, as pre-training has): one bar that
    moves every optimizer step, with rate, ETA and the last logged loss, learning rate and gradient norm.
    Replaces the Trainer's own tqdm bar (``disable_tqdm=True`` in `trainer_args`)."""

    SHOWN = {"loss": "loss", "learning_rate": "lr", "grad_norm": "gnorm", "rewards/margins": "margin"}

    def __init__(self, mode: str = "auto", desc: str = "finetune", stream=None) -> None:
        self.mode, self.desc, self.stream = mode, desc, stream
        self.progress = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.progress = Progress(
            state.max_steps or None,
            self.desc,
            unit="step",
            mode=self.mode,
            initial=state.global_step,
            stream=self.stream,
        )

    def on_step_end(self, args, state, control, **kwargs):
        if self.progress is not None:
            self.progress.advance_to(state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.progress is not None:
            self.progress.set_postfix(
                **{
                    short: float(logs[key])
                    for key, short in self.SHOWN.items()
                    if isinstance((logs or {}).get(key), int | float)
                }
            )

    def on_train_end(self, args, state, control, **kwargs):
        if self.progress is not None:
            self.progress.close()
            self.progress = None


class FiniteStepGuard(TrainerCallback):
    """Skips optimizer steps whose loss or gradient is not finite (as `moe_core.train.loop` does): just before
    the optimizer step, every gradient of a bad step is dropped (AdamW leaves a parameter without a gradient, and
    its moments, untouched). Counts skipped steps, stops after more than ``max_bad_in_row`` in a row, and keeps
    the finite step losses of the current logging interval."""

    def __init__(self, max_bad_in_row: int) -> None:
        self.max_bad_in_row = max_bad_in_row
        self.micro_losses: list[float] = []
        self.skipped_steps = 0
        self.bad_in_row = 0
        self.last_step_skipped = False
        self.last_step_loss: float | None = (
            None  # the loss of the last optimizer step (NaN when it was skipped)
        )
        self.interval: list[float] = []  # finite step losses since the last log

    def observe(self, loss: torch.Tensor) -> None:
        self.micro_losses.append(float(loss))

    def step_loss(self) -> float:
        """The loss of the optimizer step so far (its micro-steps' losses, each already divided by them)."""
        return sum(self.micro_losses)

    def set_step_loss(self, loss: float) -> None:
        """Stand the step's loss in for its micro-steps' (several processes: the world's mean)."""
        self.micro_losses = [loss]

    def state_dict(self) -> dict[str, int]:
        return {"skipped_steps": self.skipped_steps, "bad_in_row": self.bad_in_row}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.skipped_steps, self.bad_in_row = state["skipped_steps"], state["bad_in_row"]

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        step_loss = self.step_loss()
        self.micro_losses = []
        grads_finite = all(torch.isfinite(p.grad).all() for p in params if p.grad is not None)
        self.last_step_loss = step_loss
        if math.isfinite(step_loss) and grads_finite:
            self.bad_in_row = 0
            self.last_step_skipped = False
            self.interval.append(step_loss)
            return
        for p in params:
            p.grad = None
        self.skipped_steps += 1
        self.bad_in_row += 1
        self.last_step_skipped = True
        if self.bad_in_row > self.max_bad_in_row:
            raise FinetuneDivergedError(
                f"step {state.global_step + 1}: {self.bad_in_row} steps in a row had a non-finite loss or gradient "
                f"(last loss {step_loss}); stopped, nothing written. Lower optim.lr, keep optim.grad_clip on, or "
                f"use method=lora"
            )

    def interval_metrics(self) -> dict[str, float]:
        """``loss`` (mean over the finite steps since the last call; absent if none) and ``skipped_steps``."""
        out = {"skipped_steps": float(self.skipped_steps)}
        if self.interval:
            out["loss"] = sum(self.interval) / len(self.interval)
        self.interval = []
        return out


class MoEStepCallback(TrainerCallback):
    """After each optimizer step: restore frozen experts bitwise, and let aux-loss-free routers update their bias
    when the router trains (as pretraining does); a frozen router keeps its bias too, and so does a skipped step."""

    def __init__(self, model, plan: MethodPlan, guard: FiniteStepGuard | None = None) -> None:
        self.model, self.plan, self.guard = model, plan, guard

    def on_step_end(self, args, state, control, **kwargs):
        if self.plan.expert_freeze is not None:
            self.plan.expert_freeze.restore()
        if self.guard is not None and self.guard.last_step_skipped:
            for router in unwrap(self.model).routers():  # the load of a skipped step moves no bias
                if getattr(router, "pending_load", None) is not None:
                    router.pending_load.zero_()
        elif self.plan.train_router:
            unwrap(self.model).update_router_biases()


# ------------------------------------------------------------------------------------------------ trainers
class _MoEMetrics:
    """Shared by both trainers: the router-loss coefficients, routing statistics and the task context."""

    loss_is_scaled_for_ga = False  # our losses are per-micro-batch means: let Trainer divide by accumulation

    _guard: FiniteStepGuard | None = None
    # several processes (`moe_core.finetune.parallel`): the expert-gradient sync, global clip and loss at the end
    # of each optimizer step's backward; None on one process
    _gradients: ExpertGradients | None = None

    def use_parallel_gradients(self, gradients: ExpertGradients) -> None:
        """Finish every optimizer step's backward with ``gradients`` (the Trainer's own clip must be off)."""
        self._gradients = gradients

    def _setup_moe(self, plan: MethodPlan | None, log_routing: bool, per_expert: bool) -> None:
        self._guard = next(
            (c for c in self.callback_handler.callbacks if isinstance(c, FiniteStepGuard)), None
        )
        base = unwrap(self.model)
        self._base = base
        self._plan = plan
        self._per_expert = per_expert
        cfg = base.config
        self._routing = (
            RoutingStats(len(cfg.moe_layer_ids), cfg.num_experts) if log_routing and cfg.num_experts else None
        )

    def create_optimizer(self, model=None):
        """The Trainer's AdamW (its parameter groups, its kwargs), as `ExpertAdamW` where LoRA adapts stacked
        experts and ``optim.idle_experts`` is "hold": an expert that got no token in a step is not stepped."""
        model = self.model if model is None else model
        plan = getattr(self, "_plan", None)
        if self.optimizer is None and self.optimizer_cls_and_kwargs is None and plan is not None:
            axes = expert_axes(model) if plan.idle_experts == "hold" else {}
            optimizer_cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, model)
            if axes and optimizer_cls is torch.optim.AdamW:
                self.optimizer_cls_and_kwargs = (ExpertAdamW, {**kwargs, "expert_axes": axes})
        return super().create_optimizer(model)

    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        if self._guard is not None:
            self._guard.observe(loss)
        if self._gradients is not None and self.accelerator.sync_gradients:  # the step's last micro-step
            local = self._guard.step_loss() if self._guard is not None else float(loss)
            world_loss = self._gradients.finish_step(local)
            if self._guard is not None:
                self._guard.set_step_loss(world_loss)
        return loss

    def _send_telemetry(self):  # TRL pings its usage endpoint from every trainer; a library run stays offline
        return None

    def _task_context(self, task_ids):
        bias = self._plan.task_bias if self._plan is not None else None
        if bias is None:
            return contextlib.nullcontext()
        return bias.tasks(task_ids)

    def _observe(self, out, mode: str) -> None:
        metrics = self._metrics[mode]
        if getattr(out, "lm_loss", None) is not None:  # a reward model's output has none
            metrics["lm_loss"].append(out.lm_loss.detach().float().item())
        if out.aux_loss is not None:
            metrics["aux_loss"].append(out.aux_loss.detach().float().item())
            metrics["z_loss"].append(out.z_loss.detach().float().item())
        if self._routing is not None and mode == "train" and out.routing is not None:
            self._routing.add(out.routing)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if (
            self._guard is not None and "loss" in logs
        ):  # Trainer's loss stands in for NaN steps: ours does not
            del logs["loss"]
            logs.update(self._guard.interval_metrics())
            if self._gradients is not None and self._gradients.last_norm is not None:
                logs["grad_norm"] = self._gradients.last_norm  # the global norm (the Trainer's clip is off)
            if "grad_norm" in logs and not math.isfinite(logs["grad_norm"]):
                del logs["grad_norm"]
        if self._gradients is not None:
            self._gradients.average_metrics(self._metrics["train" if self.model.training else "eval"])
        if self._routing is not None and "loss" in logs:
            cfg = self._base.config
            logs.update(self._routing.metrics(cfg.moe_layer_ids, per_expert=self._per_expert))
            self._routing.reset()
        super().log(logs, start_time)


@contextlib.contextmanager
def _config_kept(model):
    """TRL writes ``output_router_logits`` and ``router_aux_loss_coef`` into the model config; keep ours as is."""
    config = unwrap(model).config
    saved = {
        k: config.__dict__[k]
        for k in ("output_router_logits", "router_aux_loss_coef")
        if k in config.__dict__
    }
    try:
        yield
    finally:
        for key in ("output_router_logits", "router_aux_loss_coef"):
            config.__dict__.pop(key, None)
        config.__dict__.update(saved)


class MoESFTTrainer(PerRankCheckpoints, _MoEMetrics, SFTTrainer):
    """TRL's SFTTrainer with our model's own loss (LM + router losses); see the module docstring."""

    def __init__(
        self,
        model,
        *args,
        plan: MethodPlan | None = None,
        log_routing: bool = True,
        per_expert: bool = False,
        **kwargs,
    ) -> None:
        with _config_kept(model):
            super().__init__(model, *args, **kwargs)
        unwrap(self.model).__dict__.pop("forward", None)  # undo TRL's fused-head patch: our forward and loss
        self._setup_moe(plan, log_routing, per_expert)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if self.model.training else "eval"
        task_ids = inputs.pop("task_ids", None)
        with self._task_context(task_ids):
            out = model(
                input_ids=inputs["input_ids"],
                attention_mask=inputs.get("attention_mask"),
                labels=inputs["labels"],
                use_cache=False,
                output_routing=self._routing is not None,
            )
        loss = out.loss
        self._observe(out, mode)
        with torch.no_grad():
            labels_BS = inputs["labels"][:, 1:]
            mask = labels_BS != -100
            correct = (out.logits[:, :-1].argmax(-1) == labels_BS) & mask
            n_labels = int(mask.sum())
            self._metrics[mode]["mean_token_accuracy"].append(correct.sum().item() / max(n_labels, 1))
            if mode == "train":
                self._total_train_tokens += (
                    int(inputs["attention_mask"].sum()) if "attention_mask" in inputs else n_labels
                )
                self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
        return (loss, out) if return_outputs else loss


def fused_forward(self, *args, fused_lm_head: bool = False, labels=None, temperature: float = 1.0, **kwargs):
    """Stands in for TRL's fused LM head on our model: with ``fused_lm_head=True`` returns TRL's
    `FusedCausalLMOutput` (per-token log-probabilities of the labels, entropy, mean logits, top-1 hits) computed
    from our logits divided by ``temperature`` (as TRL's head: GRPO scores completions at the temperature they were
    sampled at); the router losses of a forward under autograd are kept in ``self._moe_router_out``."""
    kwargs.pop("output_router_logits", None)
    if not fused_lm_head:
        return type(self).forward(self, *args, labels=labels, **kwargs)
    kwargs["use_cache"] = False
    out = type(self).forward(self, *args, output_routing=True, **kwargs)
    logits_BSV = out.logits[:, :-1].float()
    if temperature != 1.0:
        logits_BSV = logits_BSV / temperature
    labels_BS = labels[:, 1:].to(logits_BSV.device)
    mask = labels_BS != -100
    logp_BSV = logits_BSV.log_softmax(-1)
    log_probs = logp_BSV.gather(-1, labels_BS.clamp(min=0)[..., None]).squeeze(-1).masked_fill(~mask, 0.0)
    with torch.no_grad():
        entropy = -(logp_BSV.exp() * logp_BSV).sum(-1).masked_fill(~mask, 0.0)
        mean_logits = logits_BSV.mean(-1).masked_fill(~mask, 0.0)
        is_top1 = (logits_BSV.argmax(-1) == labels_BS) & mask
    if torch.is_grad_enabled():  # the policy forward; the reference forward runs under no_grad
        self._moe_router_out = out
    return FusedCausalLMOutput(
        loss=-log_probs.sum() / mask.sum().clamp(min=1),
        log_probs=log_probs,
        entropy=entropy,
        mean_logits=mean_logits,
        is_top1=is_top1,
        label_mask=mask,
        aux_loss=out.aux_loss,
    )


class _PolicyAndReference:
    """What the DPO and KTO trainers add to TRL's: the policy's forward (and the reference model's) through
    `fused_forward`, and our router losses added to TRL's loss (`_with_router_loss`). First in the bases, so its
    ``__init__`` and ``compute_loss`` are the ones that run."""

    def __init__(
        self,
        model,
        *args,
        plan: MethodPlan | None = None,
        log_routing: bool = True,
        per_expert: bool = False,
        **kwargs,
    ) -> None:
        # TRL adds the LoRA reference as a frozen copy of the adapter, "ref": on our injected expert wrappers too
        with _config_kept(model), expert_lora.adapters_reach_injected_experts(model):
            super().__init__(model, *args, **kwargs)
        self.aux_loss_enabled = False  # TRL's own MoE path would add a second, transformers-style aux loss
        base = unwrap(self.model)
        base.forward = types.MethodType(fused_forward, base)
        if self.ref_model is not None:
            ref = unwrap(self.ref_model)
            ref.forward = types.MethodType(fused_forward, ref)
        self._setup_moe(plan, log_routing, per_expert)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if self.model.training else "eval"
        self._base._moe_router_out = None
        result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        out = self._base.__dict__.pop("_moe_router_out", None)
        return _with_router_loss(self, result, out, mode, return_outputs)


class MoEDPOTrainer(_PolicyAndReference, PerRankCheckpoints, _MoEMetrics, DPOTrainer):
    """TRL's DPOTrainer plus our router losses on the policy forward; see the module docstring."""

    def compute_ref_log_probs(self, model, inputs):  # only with precompute_ref_log_probs, which we leave off
        raise FinetuneError("precompute_ref_log_probs is not supported by MoEDPOTrainer; leave it off")


class MoEKTOTrainer(_PolicyAndReference, PerRankCheckpoints, _MoEMetrics, KTOTrainer):
    """TRL's KTOTrainer plus our router losses on the policy forward; see the module docstring."""


def _with_router_loss(
    trainer, result, out, mode: str, return_outputs: bool, metrics=None, router_scale: float = 1.0
):
    """``result`` (a loss, or (loss, outputs)) with the policy forward's ``router_loss`` added (times
    ``router_scale``: GRPO's loss comes already divided by the accumulation steps); its aux and z losses into
    ``metrics`` (default: the trainer's ``_metrics[mode]``) and its routing into the statistics."""
    if out is None or out.aux_loss is None:
        return result
    loss = result[0] if return_outputs else result
    if out.router_loss is not None:
        loss = loss + router_scale * out.router_loss
    metrics = trainer._metrics[mode] if metrics is None else metrics
    metrics["aux_loss"].append(out.aux_loss.detach().float().item())
    metrics["z_loss"].append(out.z_loss.detach().float().item())
    if trainer._routing is not None and mode == "train" and out.routing is not None:
        trainer._routing.add(out.routing)
    return (loss, result[1]) if return_outputs else loss


def _ask_for_routing(module, args, kwargs):
    """Forward pre-hook: a forward under autograd (the policy's, not the reference or eval) returns its routing."""
    if torch.is_grad_enabled():
        kwargs["output_routing"] = True
    return args, kwargs


def _keep_router_out(module, args, kwargs, output):
    """Forward hook: keep the output of a forward under autograd, for its ``router_loss`` and routing."""
    if torch.is_grad_enabled():
        module._moe_router_out = output


class MoEORPOTrainer(PerRankCheckpoints, _MoEMetrics, ORPOTrainer):
    """``trl.experimental.orpo.ORPOTrainer`` (experimental upstream) plus our router losses on the policy forward;
    see the module docstring."""

    def __init__(
        self,
        model,
        *args,
        plan: MethodPlan | None = None,
        log_routing: bool = True,
        per_expert: bool = False,
        **kwargs,
    ) -> None:
        with _config_kept(model):
            super().__init__(model, *args, **kwargs)
        self.aux_loss_enabled = (
            False  # TRL's own MoE path reads a transformers-style aux loss we do not return
        )
        self._setup_moe(plan, log_routing, per_expert)
        self._hooks = [
            self._base.register_forward_pre_hook(_ask_for_routing, with_kwargs=True),
            self._base.register_forward_hook(_keep_router_out, with_kwargs=True),
        ]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if self.model.training else "eval"
        self._base._moe_router_out = None
        result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        out = self._base.__dict__.pop("_moe_router_out", None)
        metrics = {"aux_loss": [], "z_loss": []}
        result = _with_router_loss(self, result, out, mode, return_outputs, metrics)
        self.store_metrics({k: v[0] for k, v in metrics.items() if v}, train_eval=mode)
        return result

    def remove_hooks(self) -> None:
        """Take the hooks off the model (`finetune` does after training: the exported model carries none)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


class MoERewardTrainer(PerRankCheckpoints, _MoEMetrics, RewardTrainer):
    """TRL's RewardTrainer on `moe_core.reward_model.MoEForSequenceClassification`, plus its router losses."""

    def __init__(
        self,
        model,
        *args,
        plan: MethodPlan | None = None,
        log_routing: bool = True,
        per_expert: bool = False,
        **kwargs,
    ) -> None:
        super().__init__(model, *args, **kwargs)
        self._setup_moe(plan, log_routing, per_expert)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if self.model.training else "eval"
        inputs["output_routing"] = self._routing is not None and mode == "train"
        loss, out = super().compute_loss(model, inputs, True, num_items_in_batch)
        result = _with_router_loss(self, (loss, out), out, mode, True)
        return result if return_outputs else result[0]


# ------------------------------------------------------------------------------------------------ build
def trainer_args(config: FinetuneConfig, out_dir, **extra):
    """SFTConfig / DPOConfig from our config: CPU or the one visible GPU, no reporting integrations,
    checkpoints every ``checkpoint.every`` steps (per rank: `moe_core.finetune.trainer_seam`). ``extra`` overrides a
    field: `finetune` passes the ``activation_checkpointing`` it resolved for the model's size
    (`moe_core.finetune.sizing`; transformers 5.24's name, ``gradient_checkpointing`` is its deprecated alias)."""
    common = dict(
        output_dir=str(out_dir),
        max_steps=config.steps,
        per_device_train_batch_size=config.batch_size,
        gradient_accumulation_steps=config.grad_accum,
        learning_rate=config.optim.lr,
        weight_decay=config.optim.weight_decay,
        warmup_steps=config.optim.warmup_steps,
        lr_scheduler_type="constant_with_warmup"
        if config.optim.schedule == "constant"
        else config.optim.schedule,
        max_grad_norm=config.optim.grad_clip or 0.0,
        logging_steps=config.log.every,
        logging_first_step=True,
        save_strategy="steps" if config.checkpoint.every else "no",
        save_steps=config.checkpoint.every or 500,
        report_to="none",
        seed=config.seed,
        data_seed=config.seed,
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
        dataloader_num_workers=0,
        bf16=config.model.dtype == "bfloat16" and torch.cuda.is_available(),
        max_length=config.data.max_length,
        remove_unused_columns=False,
        logging_nan_inf_filter=False,  # FiniteStepGuard skips and counts bad steps; no stand-in losses
        activation_checkpointing=bool(config.gradient_checkpointing),
    )
    common.update(extra)
    if common["activation_checkpointing"]:
        # non-reentrant, as pretraining uses (moe_core.train.loop): works with a frozen embedding under LoRA
        common.setdefault("activation_checkpointing_kwargs", {"use_reentrant": False})
    if config.objective == "sft":
        return SFTConfig(completion_only_loss=config.completion_only, packing=False, **common)
    if config.objective == "reward":
        return RewardConfig(center_rewards_coefficient=config.reward.center_coefficient, **common)
    if config.objective == "orpo":
        return ORPOConfig(beta=config.orpo.beta, **common)
    if config.objective == "grpo":
        grpo = config.grpo
        common.pop("max_length")  # prompt + grpo.max_completion_length (checked when the config is built)
        return GRPOConfig(
            num_generations=grpo.num_generations,
            max_completion_length=grpo.max_completion_length,
            temperature=grpo.temperature,
            top_k=grpo.top_k,
            beta=grpo.beta,
            epsilon=grpo.epsilon,
            importance_sampling_level=grpo.importance_sampling,
            loss_type=grpo.resolved_loss_type,
            scale_rewards=grpo.scale_rewards,
            num_iterations=1,  # each generation trains one optimizer step (on-policy: old = current policy)
            log_completions=False,  # never log text
            **common,
        )
    if config.objective == "kto":
        return KTOConfig(
            beta=config.kto.beta,
            desirable_weight=config.kto.desirable_weight,
            undesirable_weight=config.kto.undesirable_weight,
            precompute_ref_log_probs=False,
            **common,
        )
    return DPOConfig(
        beta=config.dpo.beta, loss_type=[config.dpo.loss_type], precompute_ref_log_probs=False, **common
    )
