"""Batched generation with padding-aware scheduling and streamed output.

Legend: B = batch, S = sequence, L = key length, V = vocab.

    from moe_core.inference import batch_generate, GenerationConfig
    result = batch_generate(model, prompts, GenerationConfig(max_new_tokens=32, batch_size=8),
                            tokenizer=tokenizer, on_token=lambda i, token_id, text: print(i, text))
    result.texts, result.report        # in prompt order; tokens/s, padding fraction, batches

Scheduling: prompts are sorted by length and cut into batches of ``batch_size``, so each batch holds
prompts of similar length and little padding (the report gives the padded fraction of prefill positions).
Each batch is left-padded (new tokens line up at the right), prefilled once, then decoded step by step with
the KV cache; position ids count real tokens only, so a padded prompt sees the positions it would see alone.
A row stops at EOS (then only pads) and a batch stops when every row has. ``on_token(prompt_index,
token_id, text)`` is called for every new token of every row as it is produced: streaming.

Greedy (``temperature=0``) equals `model.generate(do_sample=False)` on each prompt alone (a test holds them
equal); sampling uses ``temperature`` and optional ``top_k`` with a seeded generator. ``compile=True`` runs
decode through `moe_core.inference.compile.compile_steps` on a static KV cache (fullgraph; keys and values
preallocated once for the longest prompt plus ``max_new_tokens`` and written in place, so no step rebuilds
the cache or guards on its length; prefill stays on the eager sorted path, faster than the all-experts
static graph): the first batch pays the compilation (half a minute or more on a CPU, once more for a
second batch size), long generations win it back.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moe_core.data.framing import read_framing
from moe_core.errors import MoELabError
from moe_core.inference.compile import ModelStructure, compile_steps, eager_steps
from moe_core.inference.expert_cache import offload_experts
from moe_core.inference.fast_decode import enable_fast_decode
from moe_core.inference.monitor import InferenceMonitor
from moe_core.loading import load


class GenerationError(MoELabError):
    """Bad generation input (no prompts, no tokenizer for text prompts, ...)."""


@dataclass(frozen=True)
class GenerationConfig:
    """How `batch_generate` (``moe-lab generate``, serving) decodes user prompts: greedy unless
    ``temperature`` > 0, in batches of ``batch_size``. The evaluation's prompt-set read-out, one greedy and one
    sampled generation per prompt, has its own `moe_core.eval.generate.PromptSetConfig`."""

    max_new_tokens: int = 64
    batch_size: int = 8
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no top-k filter
    seed: int = 0
    eos_token_id: int | None = None  # default: the model config's
    pad_token_id: int | None = None  # default: the model config's, else eos, else 0
    compile: bool = False  # torch.compile the decode step on a static cache (compile_steps); prefill eager

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1 or self.batch_size < 1:
            raise GenerationError("GenerationConfig: max_new_tokens and batch_size must be >= 1")
        if self.temperature < 0 or self.top_k < 0:
            raise GenerationError("GenerationConfig: temperature and top_k must be >= 0")


@dataclass
class GenerationResult:
    token_ids: list[list[int]]  # new tokens per prompt, in prompt order
    texts: list[str] | None
    report: dict = field(default_factory=dict)


def schedule(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Prompt indices grouped into batches of similar length (longest first)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def _pick(logits_BV: torch.Tensor, config: GenerationConfig, generator: torch.Generator) -> torch.Tensor:
    if config.temperature == 0:
        return logits_BV.argmax(-1)
    logits_BV = logits_BV.float() / config.temperature
    if config.top_k:
        kth = logits_BV.topk(min(config.top_k, logits_BV.shape[-1]), dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth, float("-inf"))
    return torch.multinomial(logits_BV.softmax(-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def batch_generate(
    model,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    config: GenerationConfig | None = None,
    *,
    tokenizer=None,
    on_token: Callable[[int, int, str | None], None] | None = None,
) -> GenerationResult:
    """Generate for many prompts (strings with a ``tokenizer``, or token-id lists); see the module doc."""
    config = config or GenerationConfig()
    if not prompts:
        raise GenerationError("no prompts given")
    if isinstance(prompts[0], str):
        if tokenizer is None:
            raise GenerationError("text prompts need a tokenizer; pass tokenizer= or give token-id lists")
        prompt_ids = [tokenizer(p, add_special_tokens=True)["input_ids"] for p in prompts]
    else:
        prompt_ids = [list(map(int, p)) for p in prompts]
    if any(len(p) == 0 for p in prompt_ids):
        raise GenerationError("an empty prompt has nothing to condition on; give at least one token")
    mc = model.config
    eos = config.eos_token_id if config.eos_token_id is not None else mc.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    pad = next(
        x for x in (config.pad_token_id, mc.pad_token_id, next(iter(eos_ids), None), 0) if x is not None
    )
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(config.seed)
    was_training = model.training
    model.eval()
    max_cache_len = max(len(p) for p in prompt_ids) + config.max_new_tokens
    prefill, decode = _steps(model, config.compile, max_cache_len)

    outputs: list[list[int]] = [[] for _ in prompt_ids]
    padded_positions = prompt_positions = 0
    t0 = time.perf_counter()
    prefill_s = 0.0
    batches = schedule([len(p) for p in prompt_ids], config.batch_size)
    try:
        for batch in batches:
            S = max(len(prompt_ids[i]) for i in batch)
            input_ids_BS = torch.full((len(batch), S), pad, dtype=torch.long, device=device)
            mask_BS = torch.zeros((len(batch), S), dtype=torch.long, device=device)
            for row, i in enumerate(batch):
                n = len(prompt_ids[i])
                input_ids_BS[row, S - n :] = torch.tensor(prompt_ids[i], device=device)
                mask_BS[row, S - n :] = 1
            padded_positions += int((mask_BS == 0).sum())
            prompt_positions += mask_BS.numel()
            position_ids_BS = (mask_BS.cumsum(-1) - 1).clamp_min(0)
            tp = time.perf_counter()
            logits_BV, cache = prefill(input_ids_BS, mask_BS, position_ids_BS)
            prefill_s += time.perf_counter() - tp
            done_B = torch.zeros(len(batch), dtype=torch.bool, device=device)
            next_pos_B1 = position_ids_BS[:, -1:] + 1
            for _step in range(config.max_new_tokens):
                next_B = _pick(logits_BV, config, generator).masked_fill(done_B, pad)
                for row, i in enumerate(batch):
                    if not done_B[row]:
                        token = int(next_B[row])
                        outputs[i].append(token)
                        if on_token is not None:
                            on_token(i, token, tokenizer.decode([token]) if tokenizer is not None else None)
                if eos_ids:
                    done_B = done_B | torch.tensor([int(t) in eos_ids for t in next_B], device=device)
                if bool(done_B.all()):
                    break
                mask_BS = torch.cat([mask_BS, (~done_B).long()[:, None]], dim=1)
                logits_BV, cache = decode(next_B[:, None], cache, mask_BS, next_pos_B1)
                next_pos_B1 = next_pos_B1 + 1
    finally:
        model.train(was_training)
    seconds = time.perf_counter() - t0
    new_tokens = sum(len(o) for o in outputs)
    report = {
        "prompts": len(prompt_ids),
        "batches": len(batches),
        "batch_size": config.batch_size,
        "new_tokens": new_tokens,
        "seconds": seconds,
        "tokens_per_s": new_tokens / seconds if seconds else 0.0,
        "prefill_s": prefill_s,
        "padding_fraction": padded_positions / prompt_positions if prompt_positions else 0.0,
        "decode_cache": "static" if config.compile else "dynamic",
    }
    texts = (
        [tokenizer.decode(o, skip_special_tokens=True) for o in outputs] if tokenizer is not None else None
    )
    return GenerationResult(outputs, texts, report)


class _CompiledMemo(dict):
    """A model's compiled generation steps, by static-cache length: ``{slots: (CompiledSteps, ModelStructure)}``.

    Held on the model (``model._generation_steps``), so it lives and dies with it; a copy or a pickle of the
    model starts with an empty one (compiled functions neither copy nor pickle)."""

    def __reduce__(self):
        return (_CompiledMemo, ())


def _steps(model, compile: bool, max_cache_len: int):
    """``prefill(ids, mask, positions)`` and ``decode(ids, cache, mask, positions)``, each -> (logits, cache).

    Compiled: decode only (the eager sorted prefill is the faster one), on one static cache for every batch;
    its decode ignores the mask (the cache state holds it). The cache length is rounded up to a power of two
    (at least 64 slots) and the steps are kept on the model, so later calls with similar lengths reuse the
    compiled graphs instead of compiling again (each `compile_steps` call compiles anew); a model changed since
    (a pruned expert stack, a cast, a swapped module, an edited config: `ModelStructure`) is compiled again."""
    if not compile:
        steps = eager_steps(model)
        return steps.prefill, steps.decode
    slots = max(64, 1 << (max_cache_len - 1).bit_length())
    memo = model.__dict__.setdefault("_generation_steps", _CompiledMemo())
    if slots not in memo or not memo[slots][1].matches():
        steps = compile_steps(model, compile_prefill=False, cache="static", max_cache_len=slots)
        memo[slots] = (steps, ModelStructure(model))
    steps = memo[slots][0]
    return steps.prefill, steps.decode


def generate_cli(
    model_dir,
    prompts: list[str],
    config: GenerationConfig,
    *,
    stream: bool = True,
    out=None,
    events_dir=None,
    expert_cache: int | None = None,
    json_lines: bool = True,
    base=None,
) -> dict:
    """`moe-lab generate`: load a checkpoint (plain or `moe-lab quantize` output) and its tokenizer, stream.
    ``base``: for a fine-tune's output holding its adapter alone, its base where it is now (`moe_core.load`).
    A fine-tune's prompts are framed the way its training framed them (``prompt_framing.json`` beside its
    tokenizer: its chat template, or plain text; `moe_core.data.framing`); other models get the text as given.
    ``expert_cache``: keep only this many experts in memory (offloaded to a temporary directory);
    ``events_dir``: write live figures there for the dashboard (`monitor.InferenceMonitor`);
    ``json_lines``: JSON lines (``{"prompt": i, "text": piece}`` while streaming, then one ``completion`` line
    per prompt) for programs; False writes text for people: the first prompt's completion streamed as it is
    decoded, each prompt followed by its completion."""
    out = out or sys.stdout
    if not prompts:
        raise GenerationError("no prompts: give --prompt TEXT (repeatable) or --prompts-file FILE")
    model_dir = Path(model_dir)
    loaded = load(model_dir, base=base)  # any checkpoint kind: plain, quantized, pruned, fine-tuned, a run
    model, tokenizer = loaded.model, loaded.tokenizer
    if tokenizer is None:
        raise GenerationError(
            f"{model_dir}: no tokenizer in or beside the {loaded.kind} checkpoint; save one next to it "
            "(tokenizer.save_pretrained)"
        )
    with contextlib.ExitStack() as stack:
        cache = None
        if expert_cache is not None:
            cache = offload_experts(model, stack.enter_context(tempfile.TemporaryDirectory()), expert_cache)
        enable_fast_decode(model)
        monitor = InferenceMonitor(events_dir, cache) if events_dir else None
        if monitor is not None:
            stack.callback(monitor.close)

        def emit(i: int, token: int, text: str | None) -> None:
            if monitor is not None:
                monitor.on_token(i, token, None)  # counts only: the text never reaches the event file
            if stream and json_lines:
                out.write(json.dumps({"prompt": i, "text": text}) + "\n")
                out.flush()
            elif stream and i == 0 and text:  # people read one stream at a time: the first prompt's, live
                out.write(text)
                out.flush()

        if config.compile:
            print(
                "moe-lab generate: compiling the decode step (torch.compile); the first batch is slow",
                file=sys.stderr,
                flush=True,
            )
        if stream and not json_lines:
            out.write(prompts[0])
            out.flush()
        framing = read_framing(loaded.tokenizer_dir)
        inputs = [framing.encode_prompt(tokenizer, p) for p in prompts] if framing is not None else prompts
        result = batch_generate(
            model, inputs, config, tokenizer=tokenizer, on_token=emit if (stream or monitor) else None
        )
        if cache is not None:
            result.report["expert_cache"] = cache.stats.to_dict()
    for i, text in enumerate(result.texts or []):
        if json_lines:
            out.write(json.dumps({"prompt": i, "completion": text, "done": True}) + "\n")
        elif i == 0 and stream:
            out.write("\n")
        else:
            out.write(("\n" if i else "") + prompts[i] + text + "\n")
    out.flush()
    return result.report
