"""Greedy and sampled generations for the project's prompt set (`moe_core.eval.prompts`).

Sampling is seeded per prompt (``seed + prompt index``) inside a forked RNG, so a run repeats exactly and
leaves the caller's global RNG untouched. Generations are model output for project-owned prompts: fine to
store in a file; they are not logged.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from moe_core.data.framing import PromptFraming
from moe_core.eval.prompts import PROMPT_SET_VERSION, PROMPTS, Prompt


@dataclass(frozen=True)
class PromptSetConfig:
    """How the prompt set is sampled for a quality read-out: each prompt in each of ``modes``, greedy and/or
    sampled (temperature 0.8, top-k 50, top-p 0.95 by default), through transformers' ``generate``.

    Not the serving engine's `moe_core.inference.generate.PromptSetConfig`, which decodes batches of user
    prompts one way (greedy unless ``temperature`` > 0) with a batch size, EOS/pad ids and compilation."""

    max_new_tokens: int = 48
    temperature: float = 0.8
    top_k: int = 50
    top_p: float = 0.95
    seed: int = 0
    modes: tuple[str, ...] = ("greedy", "sampled")

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"PromptSetConfig.max_new_tokens={self.max_new_tokens}: must be >= 1")
        if self.temperature <= 0:
            raise ValueError(f"PromptSetConfig.temperature={self.temperature}: must be > 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"PromptSetConfig.top_p={self.top_p}: must be in (0, 1]")
        bad = set(self.modes) - {"greedy", "sampled"}
        if bad or not self.modes:
            raise ValueError(f"PromptSetConfig.modes={self.modes}: choose from 'greedy', 'sampled'")


@dataclass(frozen=True)
class Generation:
    prompt: str  # the prompt's name
    domain: str
    mode: str  # "greedy" or "sampled"
    prompt_text: str
    completion: str
    new_tokens: int
    seed: int | None


@torch.no_grad()
def generate_samples(
    model,
    tokenizer,
    prompts: Sequence[Prompt] = PROMPTS,
    config: PromptSetConfig | None = None,
    framing: PromptFraming | None = None,
) -> list[Generation]:
    """One generation per prompt and mode; the model's train/eval mode is restored afterwards. ``framing``: a
    fine-tune's (`moe_core.data.framing.read_framing`), so each prompt is framed as its training framed them;
    None: the prompt's text as it is."""
    config = config or PromptSetConfig()
    device = next(model.parameters()).device
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    out: list[Generation] = []
    was_training = model.training
    model.eval()
    try:
        for i, prompt in enumerate(prompts):
            ids = (
                framing.encode_prompt(tokenizer, prompt.text)
                if framing is not None
                else tokenizer.encode(prompt.text, add_special_tokens=False)
            )
            ids_1S = torch.tensor([ids], device=device)
            for mode in config.modes:
                sampled = mode == "sampled"
                kwargs = dict(
                    max_new_tokens=config.max_new_tokens,
                    do_sample=sampled,
                    eos_token_id=eos,
                    pad_token_id=pad,
                    attention_mask=torch.ones_like(ids_1S),
                )
                if sampled:
                    kwargs.update(temperature=config.temperature, top_k=config.top_k, top_p=config.top_p)
                else:  # neutral values, so generation_config does not warn about unused sampling settings
                    kwargs.update(temperature=None, top_k=None, top_p=None)
                devices = [device] if device.type == "cuda" else []
                with torch.random.fork_rng(devices=devices):
                    torch.manual_seed(config.seed + i)
                    seq = model.generate(ids_1S, **kwargs)[0, ids_1S.shape[1] :]
                out.append(
                    Generation(
                        prompt.name,
                        prompt.domain,
                        mode,
                        prompt.text,
                        tokenizer.decode(seq, skip_special_tokens=True),
                        int(seq.numel()),
                        config.seed + i if sampled else None,
                    )
                )
    finally:
        model.train(was_training)
    return out


def write_generations(generations: Sequence[Generation], path: str | Path) -> Path:
    """JSONL, one generation a line, each tagged with the prompt-set version."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for g in generations:
            f.write(json.dumps({"prompt_set_version": PROMPT_SET_VERSION, **asdict(g)}) + "\n")
    return path
