"""Reward functions for GRPO (``objective=grpo``, ``grpo.rewards: ["moe_core.finetune.rewards:sum_of_two"]``).

A reward function has TRL's signature: ``f(prompts, completions, **columns) -> list[float]``, one reward per
completion; ``prompts`` and ``completions`` are strings (plain framing) or chat turns (a chat template: a list of
``{"role", "content"}``), and every other column of the prompt data arrives as a keyword, one value per completion.

`sum_of_two` is a verifiable reward (the answer is checked, not judged): the prompt asks for the sum of two
integers (``examples/sums.jsonl``: "What is 3 + 4?"), and the reward is 1 for the right sum as the completion's
first number, partial credit for a near miss (0.5 minus 0.1 per unit away, never below 0: something to climb
for a policy that starts far off), and 0 for a completion without a number.
"""

from __future__ import annotations

import re
from typing import Any

_SUM = re.compile(r"(-?\d+)\s*\+\s*(-?\d+)")
_NUMBER = re.compile(r"-?\d+")


def text_of(message: Any) -> str:
    """A prompt or completion as text: a string as it is, chat turns as the last turn's content."""
    if isinstance(message, str):
        return message
    if isinstance(message, list) and message:
        return str(message[-1].get("content") or "")
    raise TypeError(f"expected text or chat turns, got {type(message).__name__}")


def sum_of_two(prompts: list, completions: list, **_columns) -> list[float]:
    """1 for the right sum of the prompt's ``a + b`` as the completion's first number, 0.5 - 0.1 |error| (at
    least 0) for a wrong one, 0 without a number. A prompt without ``a + b`` is an error (it cannot be scored)."""
    rewards = []
    for prompt, completion in zip(prompts, completions, strict=True):
        found = _SUM.search(text_of(prompt))
        if found is None:
            raise ValueError("the prompt holds no 'a + b' to check the answer against")
        target = int(found[1]) + int(found[2])
        answer = _NUMBER.search(text_of(completion))
        if answer is None:
            rewards.append(0.0)
        elif int(answer[0]) == target:
            rewards.append(1.0)
        else:
            rewards.append(max(0.0, 0.5 - 0.1 * abs(int(answer[0]) - target)))
    return rewards
