"""`finetune`: base model + data + method + objective -> trained adapter / merged weights, in one call.

    from moe_core.finetune import FinetuneConfig, finetune
    result = finetune(FinetuneConfig.load("finetune.yaml"), out_dir="runs/ft")

Base models: our checkpoints load as they are; Hugging Face checkpoints of any architecture `moe_core.convert`
reads (a local directory or a hub id) go through the exact converter (`moe_core.convert.from_hf`), so every
architecture trains through one code path: the same LoRA targets on the stacked experts, our router losses in
the objective, routing telemetry, and an exact export back to the architecture it came from (`<out>/hf`).

`finetune` runs four steps, each a function with a typed result that the next one takes: `load_inputs` (base
model, tokenizer, rows) -> `select_parameters` (the method: what trains, what stays frozen) -> `run_training`
(TRL SFT/DPO/ORPO/KTO/reward/GRPO with the router losses) -> `export_outputs` (adapter, merged, HF); then `run_summary`. What the
size-dependent auto fields (gradient checkpointing, merged and HF exports) resolve to is decided from the base
model's config before its weights load (`moe_core.finetune.sizing`), printed, and saved in ``summary.json``.

Written to ``out_dir``: ``finetune_config.json`` (the full config), ``trainable_parameters.json`` (the report),
``metrics.jsonl`` (every log step), ``esft_selection.json`` (ESFT: routing counts and the chosen experts),
``summary.json`` (counts, hashes and final metrics; never text), and the exports (`moe_core.finetune.export`).

The rules every run command follows: ``out_dir`` is locked for the life of the run (`moe_core.fileio.OutputLock`);
one that holds an earlier fine-tune's outputs is refused unless ``overwrite``; every output is staged and moved
into ``out_dir`` only when the run succeeded (`moe_core.fileio.staged_outputs`), so a failed run leaves nothing.
Steps with a non-finite loss or gradient are skipped and counted (`objectives.FiniteStepGuard`); a run whose
last step was skipped, or whose weights are not finite, raises `FinetuneDivergedError` and writes nothing.
Ctrl-C (SIGINT) or SIGTERM finishes the optimizer step, stops, and writes the outputs of the steps done, with
``stopped_by`` and ``steps_done`` in ``summary.json`` (`StopOnSignal`); a second Ctrl-C stops at once and writes
nothing. With ``checkpoint.every`` the run also keeps resumable checkpoints in ``out_dir/checkpoints`` (outside the
staging: a killed run leaves them), which ``resume=True`` continues from; a run that succeeded removes them.

Under torchrun (``moe-lab finetune --nproc N``) every rank runs `finetune`: rank 0 holds the lock, stages and
writes the outputs; the others work in a scratch directory and write only their checkpoint files. Experts are
split over ``parallel.ep_size`` ranks, everything else replicated (`moe_core.finetune.parallel`).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
import random
import shutil
import signal
import tempfile
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import datasets
import torch
from transformers import PrinterCallback, TrainerCallback

from moe_core.configfile import FINETUNE_CONFIG
from moe_core.data.chat_template import BUILTIN_TEMPLATES, check_chat_template, resolve_chat_template
from moe_core.data.framing import PLAIN, PromptFraming, framing_for, plain_text
from moe_core.data.sources import canonical_json, load_source, quiet_datasets
from moe_core.data.tokenizer import (
    adopt_special_token_ids,
    load_tokenizer,
    special_token_ids,
    with_model_input_names,
)
from moe_core.data.validation import validate
from moe_core.fileio import OutputLock, refuse_previous_outputs, staged_outputs
from moe_core.finetune import export
from moe_core.finetune.as_trained import ADAPTER_DIR, continued, place_adapter, recorded_selection
from moe_core.finetune.config import FinetuneConfig, FinetuneDivergedError, FinetuneError
from moe_core.finetune.methods import (
    MethodPlan,
    apply_method,
    resolve_expert_ids,
    routing_usage,
    select_esft_experts,
    unwrap,
)
from moe_core.finetune.objectives import (
    FiniteStepGuard,
    MoEDPOTrainer,
    MoEKTOTrainer,
    MoEORPOTrainer,
    MoERewardTrainer,
    MoESFTTrainer,
    MoEStepCallback,
    ProgressCallback,
    SinkCallback,
    TaskCollator,
    answered_messages,
    objective_dataset,
    prompt_token_ids,
    task_names_of,
    template_renderings,
    trainer_args,
)
from moe_core.finetune.parallel import (
    CHECKPOINTS,
    CheckpointStore,
    FinetuneParallel,
    check_experts_split,
    check_world,
    drop_incomplete_checkpoints,
    gathered_adapter,
    leave_experts_to_us,
    shard_experts,
    world_size,
)
from moe_core.finetune.qlora import (
    base_quant_config,
    group_size_hint,
    quantizes_attention,
    quantizes_shared_experts,
)
from moe_core.finetune.report import TrainableReport, trainable_parameter_report
from moe_core.finetune.sizing import SizeDefaults, check_full_training_fits, resolve_size_defaults
from moe_core.inference.quantize import quantize_experts
from moe_core.loading import detect, load, memory_map_refusal, model_config, tokenizer_dir
from moe_core.mapped import MappedExperts, load_mapped
from moe_core.memory import process_memory_bytes, release_freed_memory
from moe_core.model import MoEForCausalLM, compile_layers
from moe_core.quantized import (
    QuantizedExperts,
    attention_input_widths,
    load_quantizing_experts,
    quantize_attention,
    quantize_shared_experts,
)
from moe_core.reward_model import MoEForSequenceClassification, reward_model_from
from moe_core.train.loop import STOP_SIGNALS
from moe_core.train.parallel import shutdown_parallel
from moe_core.train.telemetry import JsonlSink, read_jsonl
from moe_core.transformers_seam import old_checkpointing_names_quiet

logger = logging.getLogger(__name__)


@dataclass
class FinetuneResult:
    out_dir: Path
    model: Any  # the trained model (a PEFT model for lora), in memory
    plan: MethodPlan
    report: TrainableReport
    metrics: list[dict[str, Any]]
    adapter_dir: Path | None = None
    merged_dir: Path | None = None
    hf_dir: Path | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    skipped_steps: int = 0  # optimizer steps skipped for a non-finite loss or gradient
    last_step_loss: float | None = None  # the loss of the very last optimizer step
    stopped_by: str | None = None  # "SIGINT" or "SIGTERM" when a signal stopped training early
    steps_done: int | None = None  # optimizer steps run (``steps`` unless a signal stopped it)

    @property
    def exit_code(self) -> int:
        """0, or 128 + the signal's number when a signal stopped the run (130 SIGINT, 143 SIGTERM)."""
        return 128 + signal.Signals[self.stopped_by].value if self.stopped_by else 0

    @property
    def final_loss(self) -> float | None:
        losses = [row["loss"] for row in self.metrics if "loss" in row and "train_runtime" not in row]
        return losses[-1] if losses else None


# what a fine-tune writes into its output directory (an earlier run's are refused unless overwrite)
OUTPUTS = (
    FINETUNE_CONFIG,
    "trainable_parameters.json",
    "esft_selection.json",
    "metrics.jsonl",
    "summary.json",
    "adapter",
    "merged",
    "hf",
    "trainer",
    CHECKPOINTS,
)


# ------------------------------------------------------------------------------------------------ loading
def base_model_config(path: str, quantize_base: str | None = None):
    """The config of the base model at ``path`` (any full-precision checkpoint `moe_core.load` reads: ours, or a
    Hugging Face checkpoint), read without its weights; a quantized model is refused,
    and with ``quantize.base`` (QLoRA, quantized while it loads) one that is not a model directory."""
    kind = detect(path)
    if kind == "quantized":
        raise FinetuneError(
            f"model.path={path!r} is a quantized model; fine-tune the full-precision checkpoint it came from"
            + (" (quantize.base quantizes it while loading)" if quantize_base else "")
        )
    if quantize_base and kind not in ("model", "hf"):
        raise FinetuneError(
            f"quantize.base={quantize_base} quantizes a model directory (ours or a Hugging Face one) while it "
            f"loads; model.path={path!r} is a {kind} directory: point at the model inside it (e.g. a fine-tune's "
            "merged/, a run's final/)"
        )
    return model_config(path)


def memory_map_base(config: FinetuneConfig, announce: bool = True) -> bool:
    """Whether the base at ``model.path`` loads memory-mapped (``model.mmap``, `moe_core.mapped`), decided from its
    files alone: unset, it is when the method keeps the base frozen and the files hold ``model.dtype``, else it is
    copied and one line says why; ``true`` where it cannot be is refused."""
    if config.model.mmap is False or config.method == "full" or config.quantize.base is not None:
        return False  # full fine-tuning changes every weight; QLoRA quantizes them as they stream in
    reason = memory_map_refusal(config.model.path, config.model.dtype)
    if reason is None:
        return True
    if config.model.mmap:
        raise FinetuneError(
            f"model.mmap=true, but model.path={config.model.path!r} cannot be memory-mapped: {reason}; set "
            "model.dtype to the dtype its files hold, or model.mmap=false to copy it into memory"
        )
    if announce:
        print(
            f"moe-lab finetune: the base model is copied into memory, not memory-mapped (model.mmap): {reason}",
            flush=True,
        )
    return False


def frame_with_template(tokenizer, chat_template: str | None):
    """The tokenizer with the template the data is framed with: ``data.chat_template`` when given, else its own;
    refused, before any model loads, when it has none. ``plain`` frames without a template
    (`moe_core.data.framing`): the tokenizer is used as it is."""
    if chat_template == PLAIN:
        return tokenizer
    if chat_template is not None:
        tokenizer.chat_template, _ = resolve_chat_template(chat_template)
    if getattr(tokenizer, "chat_template", None) is None:
        raise FinetuneError(
            f"the tokenizer {getattr(tokenizer, 'name_or_path', '') or ''} has no chat template, which frames "
            "SFT/DPO data (base models such as OLMoE-1B-7B and Mixtral-8x7B ship without one): set "
            f"data.chat_template to a built-in one ({', '.join(BUILTIN_TEMPLATES)}), a Jinja file, or "
            f"{PLAIN!r} (no template: the prompt's text, a newline, then the answer)"
        )
    return tokenizer


def check_lengths(tokenizer, framed, max_length: int, reserved: int = 0) -> None:
    """Refuse data whose every prompt fills ``data.max_length`` (less ``reserved`` tokens: GRPO's completions)
    (truncation would leave no answer token to train on); warn when some do."""
    too_long, shortest = 0, None
    limit = max_length - reserved
    for row in framed:  # the prompt alone: what decides whether an answer token survives
        n = len(prompt_token_ids(tokenizer, row["prompt"]))
        shortest = n if shortest is None else min(shortest, n)
        too_long += n >= limit
    if too_long == len(framed):
        less = f" less grpo.max_completion_length={reserved}" if reserved else ""
        raise FinetuneError(
            f"every example's prompt fills data.max_length={max_length}{less} tokens (the shortest has "
            f"{shortest}): no answer token would be left to train on; raise data.max_length above "
            f"{shortest + reserved} or shorten the prompts"
        )
    if too_long:
        logger.warning(
            "%d of %d examples have a prompt of data.max_length=%d tokens or more: their answers are cut "
            "off and they train nothing",
            too_long,
            len(framed),
            max_length,
        )


def prepare_tokenizer(tokenizer, config_of_model):
    """The tokenizer checked against the model's config (its vocabulary fits the embedding) and given a pad
    token; called with the config alone, before the weights load."""
    if len(tokenizer) > config_of_model.vocab_size:
        raise FinetuneError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
            f"{config_of_model.vocab_size}; use the model's own tokenizer"
        )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return with_model_input_names(tokenizer)  # a tokenizer given in memory may still add token_type_ids


# the data kind (`moe_core.data.sources.KINDS`) each objective trains on
DATA_KINDS = {
    "sft": "instruction",
    "dpo": "preference",
    "orpo": "preference",
    "reward": "preference",
    "kto": "kto",
    "grpo": "prompt",
}


def load_records(config: FinetuneConfig):
    if not config.data.source:
        raise FinetuneError(
            f"data.source is not set; objective={config.objective} needs a {DATA_KINDS[config.objective]} file"
        )
    kind = DATA_KINDS[config.objective]
    loaded = load_source(
        config.data.source,
        kind=kind,
        hub_config=config.data.hub_config,
        split=config.data.split,
        max_documents=config.data.max_examples,
    )
    if config.data.validate_data and kind not in ("kto", "prompt"):  # checked while loading
        validate(loaded.dataset, kind, source=loaded.spec.name).raise_for_failure()
    return loaded.dataset


def _records_hash(records) -> str:
    digest = hashlib.sha256()
    for record in records:
        digest.update(canonical_json(dict(record)).encode())
    return digest.hexdigest()


def _seed(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


# ------------------------------------------------------------------------------------------------ ESFT
def _framed_text(tokenizer, messages, plain: bool) -> str:
    """A whole example as training frames it: the chat template, or plain (prompt turns, answer, EOS)."""
    if plain:
        return plain_text(messages[:-1]) + messages[-1]["content"] + tokenizer.eos_token
    return tokenizer.apply_chat_template(messages, tokenize=False)


def esft_selection(model, tokenizer, records, config: FinetuneConfig, frozen: dict[int, list[int]]):
    """Route the first ``lora.esft_examples`` training examples (whole, framed as training frames them) through
    the base model and pick the experts (`select_esft_experts`)."""
    batches = []
    plain = config.data.chat_template == PLAIN
    n_examples = min(config.lora.esft_examples, len(records))
    for start in range(0, n_examples, config.batch_size):
        texts = [
            _framed_text(tokenizer, answered_messages(config.objective, records[i], i), plain)
            for i in range(start, min(start + config.batch_size, n_examples))
        ]
        enc = tokenizer(
            texts,
            return_tensors="pt",
            padding=True,
            truncation=True,
            max_length=config.data.max_length,
            add_special_tokens=plain,  # plain text is tokenized as TRL does (its BOS); a template has its own
        )
        batches.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    usage = routing_usage(model, batches)
    selection = select_esft_experts(
        usage, config.lora.esft_share, config.lora.esft_score, config.lora.esft_max_experts, exclude=frozen
    )
    return usage, selection


# ------------------------------------------------------------------------------------------------ run
@dataclass
class RunPlace:
    """Where this process stands in the run: its rank's parallel state (None on one process), the checkpoint
    store and the checkpoint to resume from."""

    parallel: FinetuneParallel | None = None
    checkpoints: CheckpointStore | None = None
    resume_from: Path | None = None

    @property
    def is_main(self) -> bool:
        return self.parallel is None or self.parallel.is_main


def finetune(
    config: FinetuneConfig,
    out_dir: str | Path,
    *,
    model=None,
    tokenizer=None,
    records=None,
    sinks=(),
    overwrite: bool = False,
    resume: bool = False,
) -> FinetuneResult:
    """Fine-tune per ``config`` and write the outputs to ``out_dir``.

    ``model`` (our `MoEForCausalLM`), ``tokenizer`` and ``records`` (a `datasets.Dataset` or list of dicts:
    alpaca/chat rows for SFT, prompt/chosen/rejected for DPO, ORPO and reward, prompt/completion/label for KTO,
    prompts (and the columns its rewards read) for GRPO)
    override ``config.model`` / ``config.data``.
    Extra ``sinks`` (`moe_core.train.telemetry.MetricsSink`) receive the metrics beside ``metrics.jsonl``.
    ``out_dir`` holding an earlier fine-tune's outputs is refused unless ``overwrite`` (then they are replaced
    once this run succeeded); ``resume`` continues from the newest checkpoint in ``out_dir/checkpoints``; see the
    module docstring for the locking, staging and several-process rules.
    """
    out_dir = Path(out_dir)
    config, continuing = continued(config)  # going on training an earlier fine-tune's adapter
    world = world_size()
    check_world(config, world)  # before anything loads or joins a process group
    if config.checkpoint.every is None and resume:
        raise FinetuneError("resume needs checkpoint.every (the run to continue kept checkpoints with it)")
    place = RunPlace(parallel=FinetuneParallel.start(config) if world > 1 else None)
    if continuing and place.is_main:
        print(f"moe-lab finetune: {continuing}", flush=True)
    try:
        if config.checkpoint.every is not None:
            place.checkpoints = CheckpointStore(out_dir / CHECKPOINTS, place.parallel, config.checkpoint.keep)
            if resume:
                place.resume_from = place.checkpoints.latest()
                if place.resume_from is None:
                    raise FinetuneError(
                        f"resume: {out_dir / CHECKPOINTS} holds no complete checkpoint; start without resume"
                    )
        if not place.is_main:  # the outputs are rank 0's; this rank's own files go to a scratch directory
            with tempfile.TemporaryDirectory(prefix="moe-lab-finetune-rank-") as scratch:
                result = _finetune(
                    config,
                    Path(scratch),
                    model=model,
                    tokenizer=tokenizer,
                    records=records,
                    sinks=(),
                    place=place,
                )
            result.out_dir = out_dir
            return result
        with OutputLock(out_dir, "fine-tuning run"):
            if not resume:
                drop_incomplete_checkpoints(
                    out_dir / CHECKPOINTS
                )  # a first save cut short: nothing to resume
            previous = tuple(name for name in OUTPUTS if not (resume and name == CHECKPOINTS))
            if not overwrite:
                refuse_previous_outputs(
                    out_dir,
                    previous,
                    "pass --overwrite (overwrite=True) to replace them"
                    + (
                        ""
                        if resume
                        else ", or --resume (resume=True) to continue the run that left checkpoints"
                    ),
                    error_cls=FinetuneError,
                )
            if not resume:  # checkpoints here now are an overwritten run's, not this run's
                shutil.rmtree(out_dir / CHECKPOINTS, ignore_errors=True)
            replaced = tuple(name for name in OUTPUTS if name != CHECKPOINTS) if overwrite else ()
            with staged_outputs(out_dir, replace=replaced) as stage:
                result = _finetune(
                    config, stage, model=model, tokenizer=tokenizer, records=records, sinks=sinks, place=place
                )
            if place.checkpoints is not None:  # the run is complete: nothing left to resume
                shutil.rmtree(out_dir / CHECKPOINTS, ignore_errors=True)
    finally:
        if place.parallel is not None:
            shutdown_parallel(place.parallel.state)
    for name in ("adapter_dir", "merged_dir", "hf_dir"):  # where the outputs are now
        if getattr(result, name) is not None:
            setattr(result, name, out_dir / getattr(result, name).name)
    result.out_dir = out_dir
    return result


def check_finite_weights(model, where: str, *, trained_only: bool = False) -> None:
    """Refuse weights that are not finite (a diverged run) before anything is written. ``trained_only``: the
    parameters that trained and the buffers (a router's selection bias moves during training) alone; a frozen base
    cannot have changed, and reading it all pages a memory-mapped base in whole (26.7 GiB for Qwen1.5-MoE-A2.7B)
    and made the highest peak of a QLoRA fine-tune of it (12.2 GiB, 0.75 GiB over training's, through the state
    dict and a bool copy of each tensor)."""
    if trained_only:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        named += list(model.named_buffers())
    else:
        named = list(model.state_dict().items())
    bad = [
        name
        for name, tensor in named
        if torch.is_tensor(tensor) and tensor.is_floating_point() and not torch.isfinite(tensor).all()
    ]
    if bad:
        raise FinetuneDivergedError(
            f"{where}: {len(bad)} tensors hold non-finite values (first: {bad[0]}); nothing "
            f"written. Lower optim.lr, keep optim.grad_clip on, or use method=lora"
        )


# ------------------------------------------------------------------------------------------------ the recipe
# `_finetune` reads as the recipe: load -> select -> train -> export, each step a function whose typed result is
# the next step's input. The RNG is seeded once before loading; the steps run in the order the original single
# function ran them, so a seeded run repeats exactly.
def _finetune(
    config: FinetuneConfig, out_dir: Path, *, model, tokenizer, records, sinks, place: RunPlace | None = None
) -> FinetuneResult:
    place = place or RunPlace()
    config.save(out_dir / FINETUNE_CONFIG)
    if place.parallel is not None and place.parallel.sharded:  # before the weights load
        check_experts_split(
            config, model.config if model is not None else base_model_config(config.model.path)
        )
    _seed(config.seed)
    inputs = load_inputs(config, model=model, tokenizer=tokenizer, records=records, announce=place.is_main)
    if (
        place.parallel is not None
        and place.parallel.sharded
        and (inputs.size.export_merged or inputs.size.export_hf)
    ):
        if place.is_main:
            print(
                "moe-lab finetune: experts split over ranks: the adapter alone is written (merge it afterwards)"
            )
        inputs.size = replace(inputs.size, export_merged=False, export_hf=False)
    selected = select_parameters(config, inputs, out_dir)
    trained = run_training(config, inputs, selected, out_dir, sinks, place)
    release_freed_memory()  # the optimizer's state and the last step's buffers, before the exports allocate
    exported = export_outputs(config, inputs, selected, out_dir, place)
    summary = run_summary(config, inputs, selected, trained)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return FinetuneResult(
        out_dir,
        exported.model,
        selected.plan,
        selected.report,
        trained.metrics,
        adapter_dir=exported.adapter_dir,
        merged_dir=exported.merged_dir,
        hf_dir=exported.hf_dir,
        summary=summary,
        skipped_steps=trained.skipped_steps,
        last_step_loss=trained.last_step_loss,
        stopped_by=trained.stopped_by,
        steps_done=trained.steps_done,
    )


# ------------------------------------------------------------------------------------------------ 1. load
@dataclass
class LoadedInputs:
    """What the run starts from: the base model, its tokenizer and the training rows, all checked."""

    model: Any  # our `MoEForCausalLM` (converted when it came from Hugging Face), in train mode
    tokenizer: Any  # its chat template (unless plain framing) and a pad token; fits the model's vocabulary
    records: datasets.Dataset  # at least one row
    task_names: list[str]  # sorted values of ``data.task_column``; [] without one
    framing: PromptFraming  # how the data is framed; saved with every output (`moe_core.data.framing`)
    size: SizeDefaults  # gradient checkpointing and exports, resolved for the base model's size
    rewards: list = field(default_factory=list)  # GRPO's reward functions, checked (`grpo.CheckedReward`)


def load_inputs(
    config: FinetuneConfig, *, model=None, tokenizer=None, records=None, announce: bool = True
) -> LoadedInputs:
    """The base model, tokenizer and data: those given, else the ones ``config.model`` / ``config.data`` name.
    Every check runs before the weights load: the tokenizer, the data, the framing rendered on every example,
    the prompt lengths, then the model's config (read alone: its kind, the vocabulary against the tokenizer's,
    the size that resolves the auto defaults); the weights load last. ``announce``: print the lines that say which
    defaults the size chose and why the base is copied (on several processes rank 0 alone says them)."""
    if model is None and not config.model.path:
        raise FinetuneError("model.path is not set; give our checkpoint or a Hugging Face MoE checkpoint")
    if tokenizer is None:
        # the model's own, or the one `load` gives with it (a fine-tune output's, an adapter's base model's)
        source = config.model.tokenizer or (
            (tokenizer_dir(config.model.path) or config.model.path) if config.model.path else None
        )
        if not source:
            raise FinetuneError(
                "no tokenizer: set model.tokenizer (or model.path to a directory holding one)"
            )
        tokenizer = load_tokenizer(source)
    if records is None:
        records = load_records(config)
    if isinstance(records, list):
        records = datasets.Dataset.from_list(records)
    if len(records) == 0:
        raise FinetuneError("the training data has no rows")
    task_names = task_names_of(records, config.data.task_column)
    tokenizer = frame_with_template(tokenizer, config.data.chat_template)
    framing = framing_for(config.data.chat_template)
    plain = framing.kind == PLAIN
    framed = objective_dataset(config.objective, records, plain=plain)
    if not plain:
        check_chat_template(tokenizer, template_renderings(framed))
    reserved = config.grpo.max_completion_length if config.objective == "grpo" else 0
    check_lengths(tokenizer, framed, config.data.max_length, reserved)
    # GRPO's rewards: imported (and a reward model loaded) before the policy's weights load
    rewards = []
    if config.objective == "grpo":
        # TRL's GRPOTrainer imports MLflow (~50 MB resident): only GRPO runs load it
        from moe_core.finetune import grpo

        rewards = grpo.load_rewards(config, plain)
    config_of_model = (
        model.config if model is not None else base_model_config(config.model.path, config.quantize.base)
    )
    memory_map = model is None and memory_map_base(config, announce)
    quant = base_quant_config(config)
    if quant is not None and quant.bits == 4:
        widths = {"hidden_size": config_of_model.hidden_size}
        if config_of_model.num_experts:
            widths["expert_intermediate_size"] = config_of_model.expert_intermediate_size
        if quantizes_shared_experts(config) and config_of_model.num_shared_experts:
            # the shared experts fused into one FFN (`MoEBlock`): its down projection's input width
            shared = config_of_model.num_shared_experts * config_of_model.shared_expert_intermediate_size
            widths["shared experts' intermediate width"] = shared
        if quantizes_attention(config):
            for name, width in attention_input_widths(config_of_model).items():
                widths.setdefault(f"{name}'s input width", width)
        for name, width in widths.items():
            if width % quant.group_size:
                raise FinetuneError(
                    f"quantize.group_size={quant.group_size} does not divide the model's {name}={width}; "
                    f"{group_size_hint(widths.values())}"
                )
    tokenizer = prepare_tokenizer(tokenizer, config_of_model)
    size = resolve_size_defaults(config, config_of_model)
    on_cuda = torch.cuda.is_available()
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # torchrun's processes on this host
    where = (
        "the GPU" if on_cuda else "this machine" if processes == 1 else f"each of {processes} processes here"
    )
    check_full_training_fits(config, config_of_model, process_memory_bytes(on_cuda, processes), where)
    for note in size.notes if announce else ():  # one line per run, not per rank
        print(f"moe-lab finetune: {note}", flush=True)
    if model is None and quant is not None:
        model = load_quantizing_experts(
            config.model.path,
            quant,
            config.model.dtype,
            shared_experts=quantizes_shared_experts(config),
            attention=quantizes_attention(config),
        )
    elif model is None:
        model = load(config.model.path, dtype=config.model.dtype, memory_map=memory_map).model
    elif quant is not None and not any(isinstance(m, QuantizedExperts) for m in model.modules()):
        quantize_experts(model, quant)  # a model given in memory: its experts quantized in place
        if quantizes_shared_experts(config):
            quantize_shared_experts(model, quant)
        if quantizes_attention(config):
            quantize_attention(model, quant)
    # the tokenizer frames the data: its BOS/EOS/PAD go into the model's config and generation config now
    # (transformers' Trainer would align them with a warning, after `select_parameters` copied the model)
    adopt_special_token_ids(model, special_token_ids(tokenizer), replace=True)
    if config.objective == "reward" and not isinstance(model, MoEForSequenceClassification):
        model = reward_model_from(model)  # the backbone taken over (no copy), a fresh score head
    model.train()
    return LoadedInputs(model, tokenizer, records, task_names, framing, size, rewards)


# ------------------------------------------------------------------------------------------------ 2. select
@dataclass
class SelectedParameters:
    """Which parameters train: the method applied to the base model (full, LoRA on attention and experts, ESFT's
    experts, router-only, task router bias; `freeze` on top), and the frozen DPO/KTO reference where one is needed."""

    train_model: Any  # the model the optimizer sees (a PEFT model for lora)
    plan: MethodPlan  # what the method did: targets, expert selection, task bias
    report: TrainableReport  # trainable counts per group, saved as trainable_parameters.json
    ref_model: (
        Any | None
    )  # DPO/KTO without LoRA: the frozen policy at step 0 (LoRA's reference is the base itself)


def select_parameters(config: FinetuneConfig, inputs: LoadedInputs, out_dir: Path) -> SelectedParameters:
    """Apply ``config.method`` and ``config.freeze``; refuse a run in which nothing (or no asked-for expert
    adapter) trains. Writes ``esft_selection.json`` (ESFT) and ``trainable_parameters.json`` (the counts of the
    whole model, also on several processes: `run_training` splits the experts)."""
    model = inputs.model
    ref_model = None
    if config.objective in ("dpo", "kto") and config.method != "lora":
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)  # before the method changes the model

    selection = None
    continuing = config.method == "lora" and config.lora.init_from is not None
    if continuing:  # ESFT's experts are the ones the adapter went on has
        selection = recorded_selection(Path(config.lora.init_from), config)
    elif config.method == "lora" and config.lora.experts == "esft" and model.config.num_experts:
        frozen = resolve_expert_ids(config.freeze.experts, model.config, "freeze.experts")
        usage, selection = esft_selection(model, inputs.tokenizer, inputs.records, config, frozen)
        (out_dir / "esft_selection.json").write_text(
            json.dumps(
                {
                    "usage": usage.to_dict(),
                    "selection": {str(k): v for k, v in selection.items()},
                    "share": config.lora.esft_share,
                    "score": config.lora.esft_score,
                },
                indent=2,
            )
            + "\n"
        )

    train_model, plan = apply_method(model, config, expert_selection=selection, task_names=inputs.task_names)
    if continuing:  # its factors, trained on from here (the DPO/KTO reference is TRL's frozen copy of them)
        place_adapter(train_model, model, Path(config.lora.init_from) / ADAPTER_DIR, config.model.path)
    report = trainable_parameter_report(train_model, plan)
    report.save(out_dir / "trainable_parameters.json")
    logger.info("%s", report.to_text())
    if config.method == "lora" and config.lora.experts != "none" and model.config.num_experts:
        report.require_expert_adapters()
    if report.trainable_params == 0:
        raise FinetuneError("nothing trains: every parameter is frozen; check method and freeze")
    if config.compile:
        logger.info("compile=true: %d decoder layers compile at the first step", compile_layers(train_model))
    return SelectedParameters(train_model, plan, report, ref_model)


# ------------------------------------------------------------------------------------------------ 3. train
@dataclass
class TrainingOutcome:
    metrics: list[dict[str, Any]]  # every logged row, as written to metrics.jsonl
    skipped_steps: int  # optimizer steps skipped for a non-finite loss or gradient
    last_step_loss: float | None  # the loss of the very last optimizer step
    stopped_by: str | None = None  # the signal that stopped training early
    steps_done: int | None = None  # optimizer steps run


class StopOnSignal(TrainerCallback):
    """Ctrl-C (SIGINT) or SIGTERM while the Trainer runs: a line at once, the optimizer step finishes, training
    stops, and the run goes on to write the outputs of the steps done. A Ctrl-C after that stops at once
    (KeyboardInterrupt: nothing is written); a SIGTERM after it changes nothing. The handlers are in place
    only while `installed` (and only in the main thread, where Python runs them).

    On several processes (``agree``: the world's largest signal number, a collective) every rank stops after the
    same step, whichever got the signal: one rank going on alone would wait for the others forever."""

    def __init__(self, agree=None) -> None:
        self.stopped_by: str | None = None
        self.agree = agree

    @contextlib.contextmanager
    def installed(self):
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {signum: signal.signal(signum, self._on_signal) for signum in STOP_SIGNALS}
        try:
            yield self
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.stopped_by is not None:
            if signum != signal.SIGINT:
                return
            _say(f"moe-lab finetune: {name} again: stopping now; nothing written")
            raise KeyboardInterrupt
        self.stopped_by = name
        _say(
            f"moe-lab finetune: {name}: finishing this step, then writing the outputs of the steps done "
            "(Ctrl-C again stops at once, writing nothing)"
        )

    def on_step_end(self, args, state, control, **kwargs):
        if self.agree is not None:
            signum = self.agree(signal.Signals[self.stopped_by].value if self.stopped_by else 0)
            self.stopped_by = self.stopped_by or (signal.Signals(signum).name if signum else None)
        if self.stopped_by is not None:
            control.should_training_stop = True

    def on_log(self, args, state, control, logs=None, **kwargs):  # a signal while the step's row is logged
        if self.agree is None:  # several processes agree once per step, in `on_step_end`
            self.on_step_end(args, state, control)


def _say(line: str) -> None:
    """One line on stderr, straight to its file descriptor: safe inside a signal handler."""
    os.write(2, (line + "\n").encode())


def run_training(
    config: FinetuneConfig,
    inputs: LoadedInputs,
    selected: SelectedParameters,
    out_dir: Path,
    sinks,
    place: RunPlace | None = None,
) -> TrainingOutcome:
    """The objective through TRL (`objectives`), metrics to ``metrics.jsonl`` and ``sinks``; checkpoints and resume
    as ``place`` says. Raises `FinetuneDivergedError` when the last step was skipped or the trained weights are not
    finite."""
    place = place or RunPlace()
    train_model, plan = selected.train_model, selected.plan
    if place.resume_from is not None and (place.resume_from / "metrics.jsonl").is_file():
        shutil.copyfile(place.resume_from / "metrics.jsonl", out_dir / "metrics.jsonl")  # the rows so far
    jsonl = JsonlSink(out_dir / "metrics.jsonl")
    guard = FiniteStepGuard(config.faults.max_bad_steps_in_a_row)
    stop = StopOnSignal(place.parallel.agree_on_signal if place.parallel is not None else None)
    callbacks = [guard, SinkCallback([jsonl, *sinks]), MoEStepCallback(train_model, plan, guard), stop]
    if config.log.progress != "off" and place.is_main:  # one display per run, not one per rank
        callbacks.append(ProgressCallback(config.log.progress))
    extra_args = {}
    if place.parallel is not None:
        extra_args["max_grad_norm"] = 0.0  # clipped by the global norm (`ExpertGradients`), not one rank's
        extra_args["ddp_find_unused_parameters"] = False  # every trainable replicated tensor gets a gradient
        extra_args["ddp_broadcast_buffers"] = False  # as the engine's DDP: buffers are not trained
    trainer_kwargs = dict(
        args=trainer_args(
            config,
            out_dir / "trainer",
            activation_checkpointing=inputs.size.gradient_checkpointing,
            **extra_args,
        ),
        processing_class=inputs.tokenizer,
        callbacks=callbacks,
        plan=plan,
        log_routing=config.log.routing,
        per_expert=config.log.per_expert,
    )
    trainer = None
    try:
        plain = inputs.framing.kind == PLAIN
        with quiet_datasets(), old_checkpointing_names_quiet():
            dataset = objective_dataset(
                config.objective,
                inputs.records,
                plain=plain,
                task_column=config.data.task_column,
                task_names=inputs.task_names,
            )
            if config.objective == "sft":
                trainer = MoESFTTrainer(train_model, train_dataset=dataset, **trainer_kwargs)
                if config.data.task_column:
                    trainer.data_collator = TaskCollator(trainer.data_collator)
            elif config.objective in ("dpo", "kto"):
                trainer_cls = MoEDPOTrainer if config.objective == "dpo" else MoEKTOTrainer
                trainer = trainer_cls(
                    train_model, ref_model=selected.ref_model, train_dataset=dataset, **trainer_kwargs
                )
            elif config.objective == "orpo":
                trainer = MoEORPOTrainer(train_model, train_dataset=dataset, **trainer_kwargs)
            elif config.objective == "grpo":
                # TRL's GRPOTrainer imports MLflow (~50 MB resident): only GRPO runs load it
                from moe_core.finetune import grpo

                del trainer_kwargs["processing_class"], trainer_kwargs["callbacks"]
                trainer = grpo.grpo_trainer(
                    config,
                    train_model,
                    inputs.tokenizer,
                    dataset,
                    inputs.rewards,
                    callbacks,
                    **trainer_kwargs,
                )
            else:
                trainer = MoERewardTrainer(train_model, train_dataset=dataset, **trainer_kwargs)
        trainer.remove_callback(PrinterCallback)  # metrics go to the sinks; the log line is ours
        if place.parallel is not None and place.parallel.sharded:
            # after the trainer is built: TRL's DPO copies the adapter into a frozen "ref" adapter first, and
            # both are split the same way (its DDP and optimizer come in `train`, after this)
            shard_experts(trainer.model, place.parallel.state, plan)
            leave_experts_to_us(trainer.model)
        if place.parallel is not None:
            trainer.use_parallel_gradients(place.parallel.gradients(trainer.model))
        if place.checkpoints is not None:
            trainer.use_checkpoints(place.checkpoints, out_dir / "metrics.jsonl" if place.is_main else None)
        resume_from = str(place.resume_from) if place.resume_from is not None else None
        with stop.installed(), old_checkpointing_names_quiet():
            trainer.train(resume_from_checkpoint=resume_from)
    finally:
        jsonl.close()
        if isinstance(trainer, MoEORPOTrainer):
            trainer.remove_hooks()
        if config.objective == "grpo" and trainer is not None:
            trainer.close()
    metrics = read_jsonl(out_dir / "metrics.jsonl")
    if guard.last_step_skipped:  # the weights gave a non-finite loss or gradient: not a model to write
        raise FinetuneDivergedError(
            f"the last {guard.bad_in_row} step(s) had a non-finite loss or gradient ({guard.skipped_steps} of "
            f"{config.steps} skipped); nothing written. Lower optim.lr, keep optim.grad_clip on, or use method=lora"
        )
    check_finite_weights(train_model, "fine-tuned model", trained_only=True)
    return TrainingOutcome(
        metrics, guard.skipped_steps, guard.last_step_loss, stop.stopped_by, trainer.state.global_step
    )


# ------------------------------------------------------------------------------------------------ 4. export
@dataclass
class ExportedOutputs:
    model: Any  # the model the result holds: the merged one when merged or HF weights were written
    adapter_dir: Path | None = None
    merged_dir: Path | None = None
    hf_dir: Path | None = None


def export_outputs(
    config: FinetuneConfig,
    inputs: LoadedInputs,
    selected: SelectedParameters,
    out_dir: Path,
    place: RunPlace | None = None,
) -> ExportedOutputs:
    """The adapter (lora), the merged model in our format, and the merged model in the architecture it came from,
    as ``config.export`` asks, its auto fields resolved for the model's size (`inputs.size`: the adapter alone
    for a large LoRA base; hf/ for a Hugging Face base). Each output gets the framing its prompts need
    (``prompt_framing.json``). See `moe_core.finetune.export`. On several processes rank 0 writes them, the
    adapter gathered from every rank (`gathered_adapter`, a collective: every rank comes here)."""
    place = place or RunPlace()
    train_model, plan = selected.train_model, selected.plan
    exported = ExportedOutputs(train_model)
    if config.method == "lora" and config.export.adapters:
        with gathered_adapter(train_model, place.parallel):
            if place.is_main:
                exported.adapter_dir = export.save_adapter(
                    train_model, out_dir / "adapter", plan, inputs.tokenizer
                )
    if not place.is_main:
        return exported
    want_merged, want_hf = inputs.size.export_merged, inputs.size.export_hf
    shard_bytes = config.export.max_shard_mb * 10**6
    if want_merged or want_hf:
        bias = plan.task_bias
        base = unwrap(train_model)
        # a memory-mapped base's experts are merged as they are written, never stacked in memory (a merged copy of
        # the full Qwen1.5-MoE-A2.7B would be 26.7 GiB); the written directory, mapped, is then the merged model
        streamed = type(base) is MoEForCausalLM and any(isinstance(m, MappedExperts) for m in base.modules())
        if streamed:
            # (the weights that trained were checked after training; the rest is the file's, plus their deltas)
            merged, deltas = export.merged_for_writing(train_model, plan)
        else:
            merged, deltas = export.merged_model(train_model, plan), None
            check_finite_weights(merged, "merged model")
        if want_merged:
            exported.merged_dir = export.save_merged(
                merged, out_dir / "merged", inputs.tokenizer, plan, max_shard_bytes=shard_bytes, deltas=deltas
            )
        if want_hf:
            exported.hf_dir = export.save_hf(
                merged, out_dir / "hf", inputs.tokenizer, plan, max_shard_bytes=shard_bytes, deltas=deltas
            )
        exported.model = load_mapped(exported.merged_dir or exported.hf_dir) if streamed else merged
        if bias is not None:
            bias.attach(exported.model)  # the in-memory model keeps routing with the trained task bias
    for directory in (exported.adapter_dir, exported.merged_dir, exported.hf_dir):
        if directory is not None:
            inputs.framing.save(directory)
    return exported


def run_summary(
    config: FinetuneConfig, inputs: LoadedInputs, selected: SelectedParameters, trained: TrainingOutcome
) -> dict[str, Any]:
    """``summary.json``: counts, the data's hash and the final metrics; never text."""
    records, task_column = inputs.records, config.data.task_column
    final = [row for row in trained.metrics if "loss" in row]
    return {
        "examples": len(records),
        "data_sha256": _records_hash(records),
        "tasks": {name: sum(1 for r in records if str(r[task_column]) == name) for name in inputs.task_names},
        "steps": config.steps,
        "steps_done": trained.steps_done,
        "stopped_by": trained.stopped_by,  # a signal that stopped training early, else None
        "skipped_steps": trained.skipped_steps,
        "trainable_params": selected.report.trainable_params,
        "final_metrics": final[-1] if final else {},
        "expert_adapters": {str(k): v for k, v in selected.plan.expert_selection.items()},
        "framing": inputs.framing.kind,  # how prompts were framed (prompt_framing.json beside each output)
        "size_defaults": inputs.size.to_dict(),  # what the auto fields resolved to, and why
    }
