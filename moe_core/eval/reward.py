"""A reward model's pairwise accuracy on held-out preference pairs (``moe-lab eval --preferences FILE``).

    from moe_core import load
    from moe_core.eval.reward import preference_accuracy
    loaded = load("runs/rm")                       # a fine-tune with objective=reward (kind "reward")
    preference_accuracy(loaded.model, loaded.tokenizer, "data/held_out_pairs.jsonl")
    # {"pairs": 200, "pairwise_accuracy": 0.93, "mean_margin": 2.1}

Each pair is framed as the reward model's training framed it (its ``prompt_framing.json``: the chat template or
plain text; `moe_core.finetune.objectives.reward_pair_ids`, TRL RewardTrainer's tokenization) and scored by
`moe_core.reward_model.pairwise_accuracy`: the share of pairs whose chosen answer gets the higher reward.
"""

from __future__ import annotations

from typing import Any

from moe_core.data.framing import PLAIN, PromptFraming
from moe_core.data.sources import load_source
from moe_core.errors import MoELabError
from moe_core.reward_model import MoEForSequenceClassification, pairwise_accuracy


def preference_accuracy(
    model,
    tokenizer,
    source: str,
    *,
    framing: PromptFraming | None = None,
    max_pairs: int | None = None,
    batch_size: int = 16,
) -> dict[str, Any]:
    """Pairwise accuracy and mean margin of reward ``model`` on the preference data at ``source`` (a file or
    hub id with ``prompt``/``chosen``/``rejected``; at most ``max_pairs``)."""
    if not isinstance(model, MoEForSequenceClassification):
        raise MoELabError(
            f"--preferences scores a reward model (a fine-tune with objective=reward); this model is a "
            f"{type(model).__name__}"
        )
    # optional heavy dependency (TRL, through the fine-tuning objectives): only for reward-model evaluation
    from moe_core.finetune.objectives import reward_pair_ids

    records = load_source(source, kind="preference", max_documents=max_pairs).dataset
    plain = framing is not None and framing.kind == PLAIN
    if not plain and getattr(tokenizer, "chat_template", None) is None:
        raise MoELabError(
            "the reward model's tokenizer has no chat template and no prompt_framing.json says 'plain'; pass "
            "the tokenizer it was trained with (--tokenizer)"
        )
    pairs = reward_pair_ids(tokenizer, records, plain=plain)
    return pairwise_accuracy(model, pairs, batch_size=batch_size)
