"""Fine-tuning outputs: the adapter alone (PEFT format), merged weights, and the Hugging Face architecture.

<out>/adapter/   adapter_config.json + adapter_model.safetensors, PEFT's format, with the tokenizer and
                 moe_expert_selection.json (the experts with a non-zero adapter per layer). For a base model
                 converted from Hugging Face (``config.hf_origin``) it names the HF architecture's own modules
                 in transformers 5 (`moe_core.finetune.hf_adapter`: LoRA on the fused experts through
                 target_parameters, the router as ``mlp.gate``), so stock PEFT loads it onto the HF model with
                 our logits:
                 ``PeftModel.from_pretrained(OlmoeForCausalLM.from_pretrained(src), "<out>/adapter")``; for
                 our own models it names ours: ``PeftModel.from_pretrained(MoEForCausalLM.from_pretrained(base),
                 "<out>/adapter")``. ``moe_core.load("<out>/adapter")`` reads either onto our model.
                 A trained router's selection bias (DeepSeek-V3 / GLM-4.5 ``expert_bias``, moved by aux-loss-free
                 balancing) is saved with it in either names (`moe_core.finetune.selection_bias`).
<out>/merged/    our format (config.json + model.safetensors + tokenizer), adapter folded into the weights
<out>/hf/        the architecture the model came from (any `moe_core.convert` writes) via moe_core.convert.to_hf,
                 loadable by transformers' AutoModelForCausalLM; written when the base model had HF origin
task_router_bias.{safetensors,json} beside each, when trained: no HF architecture has a per-task bias, so it
                 stays a separate file (`TaskRouterBias.load(dir).attach(model)`)
prompt_framing.json beside each: how prompts were framed (`moe_core.data.framing`), for generate and eval

Memory: no export holds a second copy of the model. ``merged_model`` folds the adapter into the weights in
place (PEFT ``merge_and_unload``: one adapted tensor's delta at a time); ``save_merged`` (transformers'
``save_pretrained``) and ``save_hf`` (`moe_core.convert.to_hf`) hand safetensors the model's own tensors (views,
no clone, no cast), shard by shard of at most ``max_shard_bytes``, and safetensors writes them from their
memory. tests/test_finetune_at_size.py holds the peak memory of merge + both saves well under one model copy.
Over a memory-mapped base no copy of the experts is made at all: ``merged_for_writing`` merges everything else
and leaves the experts the file's, with what the adapter adds to each projection, and the writers add it to each
expert as its shard is written (`moe_core.mapped.stacked_tensors`): the full OLMoE-1B-7B's merged/ and hf/
peaked at 9.4 GiB against 22.5 GiB stacking the experts in memory, the same bytes written (benchmarks/README.md).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from moe_core.convert import to_hf
from moe_core.fileio import atomic_directory
from moe_core.finetune.config import FinetuneError
from moe_core.finetune.hf_adapter import save_hf_adapter
from moe_core.finetune.methods import MethodPlan, lora_wrappers, unwrap
from moe_core.finetune.selection_bias import add_router_biases
from moe_core.mapped import ExpertDeltas, MappedExperts, densify_experts, save_streaming, stacked_tensors
from moe_core.model import MoEForCausalLM
from moe_core.reward_model import MoEForSequenceClassification


def is_peft(model) -> bool:
    return callable(getattr(model, "merge_and_unload", None))


def save_adapter(model, out_dir: str | Path, plan: MethodPlan | None = None, tokenizer=None) -> Path:
    """The PEFT adapter alone (LoRA factors, plus a trained router copy when the router trained), with the
    tokenizer the data was framed with (its chat template: what generate and eval frame prompts with). In the HF
    architecture's module names when the base model came from Hugging Face, else in ours (module docstring).
    Written into a temporary directory renamed into place (an earlier ``out_dir`` is replaced)."""
    if not is_peft(model):
        raise FinetuneError(
            "save_adapter: the model has no PEFT adapter (method is not 'lora'); export merged "
            "weights instead"
        )
    with atomic_directory(out_dir, overwrite=True, error_cls=FinetuneError) as tmp:
        _write_adapter(model, tmp, plan, tokenizer)
    return Path(out_dir)


def _write_adapter(model, out_dir: Path, plan: MethodPlan | None, tokenizer) -> None:
    # a reward model's adapter (LoRA + its score head) is in our names: no HF architecture has that head
    if unwrap(model).config.hf_origin and not isinstance(unwrap(model), MoEForSequenceClassification):
        save_hf_adapter(model, out_dir)
    else:
        model.save_pretrained(str(out_dir))
        add_router_biases(model, out_dir / "adapter_model.safetensors")  # a trained router's selection bias
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out_dir))
    if plan is not None:
        (out_dir / "moe_expert_selection.json").write_text(
            json.dumps(
                {
                    "expert_adapters": {str(k): v for k, v in plan.expert_selection.items()},
                    "frozen_experts": {str(k): v for k, v in plan.frozen_experts.items()},
                    "router_trained": plan.train_router,
                },
                indent=2,
            )
            + "\n"
        )
        if plan.task_bias is not None:
            plan.task_bias.save(out_dir)


def merged_model(model, plan: MethodPlan | None = None):
    """Our `MoEForCausalLM` with the adapter folded in (PEFT ``merge_and_unload``), frozen-expert hooks removed and
    the task bias detached (it is saved on its own). Modifies ``model`` in place; returns the plain model. A base
    memory-mapped from its files (`moe_core.mapped`) is never written through: under an adapter its per-expert
    tensors are stacked into ordinary memory first (`densify_experts`), and a merge into another mapped weight
    lands in pages the mapping copies on write (private to the process); with no adapter (``method=router`` or
    ``router_bias``: nothing to merge) they stay the file's, and `save_merged` writes them a shard at a time.
    A writer that need not hold the merged model takes `merged_for_writing` instead."""
    _detach_plan(model, plan)
    if is_peft(model):  # experts memory-mapped one tensor per expert: stacked, so merges add into a copy
        densify_experts(model)
    merged = model.merge_and_unload() if is_peft(model) else model
    for param in merged.parameters():
        param.requires_grad_(False)
    return merged.eval()


def merged_for_writing(model, plan: MethodPlan | None = None) -> tuple[MoEForCausalLM, ExpertDeltas]:
    """`merged_model` for the writers (`save_merged`, `save_hf`) alone: the adapter merged into everything but the
    memory-mapped experts (attention into copy-on-write pages, a trained router's copy put in place), which stay
    the file's, never stacked or copied; what merging adds to each of their projections is returned as
    ``deltas`` (`moe_core.mapped.ExpertDeltas`: made a projection at a time as it is written, the adapter's
    factors kept for it). The model's experts so lack their deltas: write it with them, then drop it (the
    written directory, memory-mapped, is the merged model: `merged_model` is what holds it in memory)."""
    from moe_core.finetune.expert_lora import merge_deltas  # peft's, with the wrappers

    _detach_plan(model, plan)
    deltas: dict = {}
    if is_peft(model):
        base = unwrap(model)
        for name, wrapper in list(lora_wrappers(base)):
            experts = wrapper.get_base_layer()
            if name.endswith(".base_layer") or not isinstance(experts, MappedExperts):
                continue  # a nested wrapper (its outermost one holds the experts' place), or a stack in memory
            deltas[experts] = {w.parameter_name: functools.partial(merge_deltas, w) for w in wrapper.nest()}
            parent_name, _, child = name.rpartition(".")
            setattr(base.get_submodule(parent_name), child, experts)  # out of PEFT's merge
    merged = model.merge_and_unload() if is_peft(model) else model
    for param in merged.parameters():
        param.requires_grad_(False)
    return merged.eval(), deltas


def _detach_plan(model, plan: MethodPlan | None) -> None:
    """The method's hooks removed and the task bias detached (saved on its own), before a merge."""
    if plan is None:
        return
    if plan.lora_mask is not None:
        plan.lora_mask.remove()
    if plan.expert_freeze is not None:
        plan.expert_freeze.remove()
    if plan.task_bias is not None:
        plan.task_bias.detach(model)


def save_merged(
    model,
    out_dir: str | Path,
    tokenizer=None,
    plan: MethodPlan | None = None,
    *,
    max_shard_bytes: int = 5 * 10**9,
    deltas: ExpertDeltas | None = None,
) -> Path:
    """The merged model in our format (``save_pretrained``, safetensors shards of at most ``max_shard_bytes``);
    experts still memory-mapped are written a shard at a time (`save_streaming`), ``deltas`` (`merged_for_writing`)
    added to them as they are."""
    out_dir = Path(out_dir)
    base = unwrap(model)
    if any(isinstance(m, MappedExperts) for m in base.modules()):
        save_streaming(base, out_dir, max_shard_bytes, deltas)
    else:
        base.save_pretrained(str(out_dir), max_shard_size=max_shard_bytes)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out_dir))
    if plan is not None and plan.task_bias is not None:
        plan.task_bias.save(out_dir)
    return out_dir


def save_hf(
    model,
    out_dir: str | Path,
    tokenizer=None,
    plan: MethodPlan | None = None,
    *,
    max_shard_bytes: int = 5 * 10**9,
    deltas: ExpertDeltas | None = None,
) -> Path:
    """The merged model as its Hugging Face architecture (``config.hf_origin``), through `moe_core.convert.to_hf`
    (safetensors shards of at most ``max_shard_bytes``); experts still memory-mapped are written from the file's
    views, ``deltas`` (`merged_for_writing`) added to them as they are (`stacked_tensors`), never stacked."""
    base = unwrap(model)
    if not base.config.hf_origin:
        raise FinetuneError(
            "save_hf: the model did not come from a Hugging Face architecture (config.hf_origin "
            "is empty); use moe_core.convert.to_hf(model, dir, architecture=...) to pick one"
        )
    tensors = (
        stacked_tensors(base, deltas) if any(isinstance(m, MappedExperts) for m in base.modules()) else None
    )
    out_dir = Path(to_hf(base, out_dir, overwrite=True, max_shard_size=max_shard_bytes, tensors=tensors))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out_dir))
    if plan is not None and plan.task_bias is not None:
        plan.task_bias.save(out_dir)
    return out_dir
