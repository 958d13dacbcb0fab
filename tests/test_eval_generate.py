"""Generations for the project's prompt set: greedy equals a hand-rolled argmax loop; sampling repeats
exactly with its seed and leaves the global RNG alone."""

from __future__ import annotations

import pytest
import torch

from moe_core import MoEForCausalLM, get_config
from moe_core.data.tokenizer import train_tokenizer
from moe_core.eval.generate import PromptSetConfig, generate_samples, write_generations
from moe_core.eval.prompts import PROMPTS

TEXTS = [p.text for p in PROMPTS] * 2 + [
    "def add(a, b):\n    return a + b\n",
    "Return the sum of the numbers.",
]


def tiny_tokenizer():
    return train_tokenizer(TEXTS, vocab_size=300, min_frequency=1)


@pytest.fixture(scope="module")
def setup():
    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    model = MoEForCausalLM(get_config("mixtral-tiny", vocab_size=len(tokenizer)))
    return model, tokenizer


def test_prompt_set_is_fixed_and_covers_both_domains():
    assert len({p.name for p in PROMPTS}) == len(PROMPTS)
    assert {p.domain for p in PROMPTS} == {"code", "prose"}


def test_greedy_is_the_argmax_continuation(setup):
    model, tokenizer = setup
    prompt = PROMPTS[0]
    (greedy,) = generate_samples(
        model, tokenizer, [prompt], PromptSetConfig(max_new_tokens=6, modes=("greedy",))
    )
    ids = tokenizer.encode(prompt.text, add_special_tokens=False)
    new = []
    model.eval()
    with torch.no_grad():
        for _ in range(6):
            next_id = int(model(torch.tensor([ids + new]), use_cache=False).logits[0, -1].argmax())
            new.append(next_id)
            if next_id == tokenizer.eos_token_id:
                break
    assert greedy.completion == tokenizer.decode(new, skip_special_tokens=True)
    assert greedy.new_tokens == len(new) and greedy.seed is None


def test_sampling_is_seeded_and_leaves_global_rng(setup, tmp_path):
    model, tokenizer = setup
    config = PromptSetConfig(max_new_tokens=5, modes=("sampled",), seed=3)
    state = torch.get_rng_state()
    first = generate_samples(model, tokenizer, PROMPTS[:2], config)
    assert torch.equal(state, torch.get_rng_state())
    assert first == generate_samples(model, tokenizer, PROMPTS[:2], config)
    other = generate_samples(
        model, tokenizer, PROMPTS[:1], PromptSetConfig(max_new_tokens=5, modes=("sampled",), seed=4)
    )
    assert other[0].completion != first[0].completion
    assert [g.seed for g in first] == [3, 4]
    path = write_generations(first, tmp_path / "gen.jsonl")
    assert len(path.read_text().splitlines()) == 2


def test_generation_config_checks_itself():
    with pytest.raises(ValueError, match="modes"):
        PromptSetConfig(modes=("beam",))
    with pytest.raises(ValueError, match="temperature"):
        PromptSetConfig(temperature=0.0)
