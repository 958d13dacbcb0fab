"""Fine-tuning defaults that follow the base model's size, decided from its config before any weight loads.

Three fields of `FinetuneConfig` are ``None`` ("auto") by default and resolved here; a value the user set wins:

- ``gradient_checkpointing``: on when the base model has more than `LARGE_MODEL_PARAMS` parameters or its
  activations for one micro-batch (``batch_size`` x ``data.max_length``) are estimated above
  `LARGE_ACTIVATION_BYTES`; off otherwise, and off with the task-conditioned router bias (the recomputed forward
  has no task ids: an explicit ``true`` is refused there, see `FinetuneConfig`).
- ``export.merged`` / ``export.hf``: a LoRA fine-tune of a large base model writes the adapter only (each merged
  copy is as large as the checkpoint: 2 x 93 GB for Mixtral-8x7B, for a 30 MB adapter); at smaller sizes
  merged/ is written, and hf/ when the model came from Hugging Face, as before. Methods without an adapter
  (full, router, router_bias) always write merged/ by default: it is their only output.

`resolve_size_defaults` returns the values with one line per decision, printed by `finetune` and saved in
``summary.json`` (``size_defaults``).
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from moe_core.config import MoEConfig, ffn_params, parameter_counts
from moe_core.finetune.config import FinetuneConfig, FinetuneError

# Above 1 B parameters the defaults change. Why there: the frozen weights alone are >= 2 GB in bf16 (4 GB fp32),
# so on the 16-32 GB machines and 24-80 GB GPUs people fine-tune on, the activations of every layer kept for
# backward (tens of MB per layer per 1k tokens) are what stands between a step and an out-of-memory kill, and
# recomputing them costs ~30% of a step; and a merged copy is then a multi-GB write per export, where the
# adapter is MBs. The toy and lab-sized models (a few M to a few hundred M) keep the old defaults.
LARGE_MODEL_PARAMS = 1_000_000_000
# Activations above 4 GiB for one micro-batch also turn checkpointing on (long sequences on a mid-sized model).
LARGE_ACTIVATION_BYTES = 4 * 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def activation_bytes(model_config: MoEConfig, batch_size: int, seq_len: int, dtype: str) -> int:
    """An estimate of the activations one micro-batch keeps for backward. Per layer, Korthikanti et al. 2022
    ("Reducing Activation Recomputation in Large Transformer Models", eq. 1) count s*b*h*(34 + 5*a*s/h) bytes in
    16-bit for attention plus a 4h MLP; here the MLP's share (19*s*b*h of the 34) is replaced by what the routed
    experts keep: k experts per token, each ~3 [s*b, F] tensors (gate, up, their product), plus the router's
    [s*b, E] logits and probabilities. Scaled by the dtype's bytes over 2."""
    s, b, h = seq_len, batch_size, model_config.hidden_size
    a = model_config.num_attention_heads
    per_layer_16bit = s * b * h * 15 + 5 * a * s * s * b
    total = 0
    for layer in range(model_config.num_hidden_layers):
        if model_config.is_moe_layer(layer):
            ffn = 3 * model_config.num_experts_per_tok * s * b * model_config.expert_intermediate_size * 2
            ffn += 2 * s * b * model_config.num_experts * 4  # router logits and probabilities, fp32
        else:
            ffn = 19 * s * b * h
        total += per_layer_16bit + ffn
    return int(total * DTYPE_BYTES[dtype] / 2)


@dataclass(frozen=True)
class SizeDefaults:
    """What the ``None`` fields resolved to for this base model, and why (one line each, for people)."""

    gradient_checkpointing: bool
    export_merged: bool
    export_hf: bool
    parameters: int  # the base model's parameter count (from its config)
    activation_bytes: int  # the estimate for one micro-batch (`activation_bytes`)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _size(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.1f} M"


def resolve_size_defaults(config: FinetuneConfig, model_config: MoEConfig) -> SizeDefaults:
    """Resolve ``gradient_checkpointing``, ``export.merged`` and ``export.hf`` for ``model_config`` (see the
    module docstring); a field the user set is kept as is."""
    params = parameter_counts(model_config)["total"]
    acts = activation_bytes(model_config, config.batch_size, config.data.max_length, config.model.dtype)
    large = params > LARGE_MODEL_PARAMS
    notes: list[str] = []

    checkpointing = config.gradient_checkpointing
    if checkpointing is None:
        why = (
            f"the base model has {_size(params)} parameters (above {_size(LARGE_MODEL_PARAMS)})"
            if large
            else f"one micro-batch ({config.batch_size} x {config.data.max_length} tokens) keeps an estimated "
            f"{acts / 2**30:.1f} GiB of activations (above {LARGE_ACTIVATION_BYTES / 2**30:.0f} GiB)"
            if acts > LARGE_ACTIVATION_BYTES
            else None
        )
        checkpointing = why is not None and not config.uses_task_bias
        if why and config.uses_task_bias:
            notes.append(
                f"gradient checkpointing left off although {why}: it does not work with the task-conditioned "
                "router bias (the recomputed forward has no task ids)"
            )
        elif why:
            notes.append(
                f"gradient checkpointing on: {why}; activations are recomputed in backward (slower steps, far "
                "less memory); --set gradient_checkpointing=false turns it off"
            )

    merged, hf = config.export.merged, config.export.hf
    if hf and not model_config.hf_origin:  # save_hf would refuse it after training: say so before
        raise FinetuneError(
            "export.hf=true, but the base model did not come from a Hugging Face architecture (its config has "
            "no hf_origin); leave export.hf unset, or convert merged/ afterwards with "
            "`moe-lab convert to-hf OUT/merged --arch mixtral --out OUT/hf` (or olmoe, qwen2_moe)"
        )
    has_adapter = config.method == "lora" and config.export.adapters
    quantized = config.quantize.base is not None  # merging goes into the full-precision model, not the codes
    if merged is None:
        merged = not (large and has_adapter) and not quantized
    if hf is None:
        # a reward model (objective=reward) has no Hugging Face MoE architecture to be written as
        hf = bool(model_config.hf_origin) and not large and not quantized and config.objective != "reward"
    if quantized and (config.export.merged is None or config.export.hf is None):
        notes.append(
            f"quantize.base={config.quantize.base}: only the adapter is written; `moe-lab generate OUT` and "
            "moe_core.load('OUT') run it on the base quantized again as it trained, moe_core.load('OUT/adapter') "
            "merges it into the full-precision base"
        )
    skipped = [
        name
        for name, asked, resolved in (
            ("merged/", config.export.merged, merged),
            ("hf/", config.export.hf, hf if model_config.hf_origin else True),
        )
        if asked is None and not resolved
    ]
    if large and skipped:
        copy = params * DTYPE_BYTES[config.model.dtype] / 2**30
        flags = " ".join(f"--set export.{name.rstrip('/')}=true" for name in skipped)
        notes.append(
            f"not writing {' and '.join(skipped)}: the base model has {_size(params)} parameters (above "
            f"{_size(LARGE_MODEL_PARAMS)}) and each is a full copy (~{copy:.1f} GiB)"
            + (", the adapter is written" if has_adapter else "")
            + f"; {flags} writes {'them' if len(skipped) > 1 else 'it'}"
            + (
                " (moe-lab generate OUT and moe_core.load('OUT') run the adapter unmerged on the base as it trained)"
                if has_adapter
                else ""
            )
        )
    return SizeDefaults(bool(checkpointing), bool(merged), bool(hf), params, acts, notes)


def full_training_floor(config: FinetuneConfig, model_config: MoEConfig) -> int:
    """The fewest bytes ``method=full`` can train ``model_config`` in: every weight in ``model.dtype`` and, for the
    routed experts' stacks (trained whatever ``freeze.experts`` holds still: a frozen expert is a masked row of a
    trained stack), a gradient and AdamW's two moments in that dtype too (torch's AdamW keeps its state in the
    parameter's dtype). Activations, the attention's and embeddings' own gradients and state, and everything else
    come on top. 0 for the methods that keep the base frozen."""
    if config.method != "full":
        return 0
    counts = parameter_counts(model_config)
    experts = 0
    if model_config.num_experts:
        per_expert = ffn_params(model_config, model_config.expert_intermediate_size)
        moe_layers = sum(model_config.is_moe_layer(i) for i in range(model_config.num_hidden_layers))
        experts = moe_layers * model_config.num_experts * per_expert
    return (counts["total"] + 3 * experts) * DTYPE_BYTES[config.model.dtype]


def check_full_training_fits(
    config: FinetuneConfig, model_config: MoEConfig, memory: int | None, where: str
) -> None:
    """Refuse ``method=full`` before any weight loads when `full_training_floor` alone exceeds ``memory`` (the
    bytes one process may hold on ``where``: the host's memory, or the GPU's): it could only end in an
    out-of-memory kill after the model loaded. None: unknown, nothing checked."""
    floor = full_training_floor(config, model_config)
    if memory is None or floor <= memory:
        return
    params = parameter_counts(model_config)["total"]
    raise FinetuneError(
        f"method=full trains every weight of this {_size(params)}-parameter model: its weights, and the experts' "
        f"gradients and AdamW state, need at least {floor / 2**30:.1f} GiB in {config.model.dtype}, more than "
        f"the {memory / 2**30:.1f} GiB {where} holds; use method=lora (LoRA on the attention and every expert, "
        "the base frozen and memory-mapped) or method=qlora (the base in 4 bits)"
    )


def read_dtype(path, command: str | None, base=None, *, doing: str = "read", hint: str = ""):
    """The dtype a command reads a checkpoint in when none is asked (eval and analyze, and quantize and prune,
    which rewrite its weights): float32 up to `LARGE_MODEL_PARAMS` parameters (every model compared in one
    precision), above it None, the dtype its files hold, said in one line (``doing``, ``hint``: that line's verb
    and its way out). A float32 copy of the 12.9 GiB bf16 OLMoE-1B-7B is 25.8 GiB: ``moe-lab quantize`` of it read
    it so and was killed for memory (``prune`` read it so too), and a fine-tune's output over a memory-mapped base
    (`moe_core.finetune.as_trained`) maps only in its files' dtype. Quantization's codes are the same either way
    (computed in float32 from the stored values). ``base``: an adapter-only output's base where it is now."""
    import torch  # lazy: this module is configs only, imported where torch is not needed

    from moe_core.loading import model_config  # lazy: the loader, with the modeling stack behind it

    params = parameter_counts(model_config(path, base))["total"]
    if params <= LARGE_MODEL_PARAMS:
        return torch.float32
    print(
        f"moe-lab{' ' + command if command else ''}: {path}: {params / 1e9:.2f} B parameters (above "
        f"{LARGE_MODEL_PARAMS / 1e9:g} B): {doing} in the dtype its checkpoint holds, not float32 (a copy of twice "
        f"its size){hint}",
        file=sys.stderr,
        flush=True,
    )
    return None
