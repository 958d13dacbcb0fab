"""Shared fixtures for the fine-tuning tests: a tiny instruction set, a tokenizer trained on it, tiny models."""

from __future__ import annotations

import torch

from moe_core.config import get_config
from moe_core.model import MoEForCausalLM

COLORS = ["red", "blue", "green", "black", "white", "gold", "pink", "gray"]
ANIMALS = ["cat", "dog", "fox", "owl", "cow", "bee", "ant", "elk"]
# a few LoRA steps on every expert of a tiny checkpoint, framed by ChatML: the fine-tune of the QLoRA and the
# as-trained loading tests (model.path and the rest added by each)
SMALL_LORA_RUN = {
    "lora": {"r": 4, "experts": "all"},
    "steps": 3,
    "batch_size": 4,
    "data": {"max_length": 64, "chat_template": "chatml"},
    "optim": {"lr": 5e-3},
    "log": {"progress": "off"},
}


def instruction_records(n: int = 16, task: bool = False) -> list[dict]:
    """Alpaca-style rows with a learnable mapping (the answer repeats a word of the instruction)."""
    rows = []
    for i in range(n):
        color, animal = COLORS[i % 8], ANIMALS[(3 * i) % 8]
        if i % 2 == 0:
            row = {
                "instruction": f"Name the color in: the {color} {animal}.",
                "input": "",
                "output": f"The color is {color}.",
            }
            kind = "color"
        else:
            row = {
                "instruction": f"Name the animal in: the {color} {animal}.",
                "input": "",
                "output": f"The animal is {animal}.",
            }
            kind = "animal"
        if task:
            row["task"] = kind
        rows.append(row)
    return rows


def preference_records(n: int = 8) -> list[dict]:
    return [
        {
            "prompt": f"Name the color in: the {COLORS[i % 8]} {ANIMALS[i % 8]}.",
            "chosen": f"The color is {COLORS[i % 8]}.",
            "rejected": f"I do not know the {ANIMALS[i % 8]}.",
        }
        for i in range(n)
    ]


def tiny_tokenizer():
    from moe_core.data.sources import to_messages
    from moe_core.data.tokenizer import render_chat, train_tokenizer

    texts = [render_chat(to_messages(r)) for r in instruction_records(16)] * 4
    texts += [f"{r['prompt']} {r['chosen']} {r['rejected']}" for r in preference_records(8)] * 4
    return train_tokenizer(texts, vocab_size=300, min_frequency=2)


def tiny_model(
    preset: str = "mixtral-tiny", vocab_size: int = 300, seed: int = 0, **overrides
) -> MoEForCausalLM:
    torch.manual_seed(seed)
    fields = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        expert_intermediate_size=32,
        intermediate_size=64,
        max_position_embeddings=128,
    )
    fields.update(overrides)
    return MoEForCausalLM(get_config(preset, **fields))


def state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_lora_step(
    ours, reference, input_ids: torch.Tensor, adapted: str, tol: float = 1e-5, **forward
):
    """One training step's loss backward on both models (``forward``: extra arguments to ``ours``, such as
    ``expert_impl``), then the same logits and the same gradient on every trainable parameter (within ``tol``);
    ``adapted`` names a part (``.experts.``, ``.self_attn.o_proj.lora_A``) some trained parameter must be in."""
    ours(input_ids=input_ids, labels=input_ids, **forward).loss.backward()
    reference(input_ids=input_ids, labels=input_ids).loss.backward()
    with torch.no_grad():
        torch.testing.assert_close(
            ours(input_ids=input_ids, **forward).logits,
            reference(input_ids=input_ids).logits,
            atol=tol,
            rtol=tol,
        )
    grads = {n: p.grad for n, p in ours.named_parameters() if p.requires_grad}
    expected = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    assert grads.keys() == expected.keys() and any(adapted in n for n in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], atol=tol, rtol=tol, msg=name)
    return grads


class Crash(RuntimeError):
    """What `CrashAt` raises: a run killed part way."""


class CrashAt:
    """A metrics sink that fails the run when step ``step`` logs its loss (the checkpoint of the step before is
    complete): a crash to resume from."""

    def __init__(self, step: int) -> None:
        self.step = step

    def log(self, step, metrics) -> None:
        if step == self.step and "loss" in metrics:
            raise Crash
