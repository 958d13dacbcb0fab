"""Token-to-expert routing of short project-owned texts: which experts each token goes to, per MoE layer.

    from moe_core.analytics.token_routing import prompt_set_routing, route_tokens
    records = route_tokens(model, ids_T)                 # one RoutingRecord per MoE layer, T tokens
    view = prompt_set_routing(loaded.model, loaded.tokenizer)   # every `moe_core.eval.prompts` prompt

`plot_token_routing` (plots.py) draws one text from `route_tokens`; the dashboard's token-to-expert view serves
`prompt_set_routing`. Give only texts the project owns (the prompt set): the tokens are shown as labels.
Legend: T = tokens, E = experts, K = experts per token.
"""

from __future__ import annotations

import torch

from moe_core.errors import MoELabError
from moe_core.eval.prompts import PROMPT_SET_VERSION, PROMPTS, Prompt
from moe_core.routing import RoutingRecord

MAX_TOKENS = 64  # the prompts are a line or two; a longer text is cut here


class TokenRoutingError(MoELabError):
    """The prompt set cannot be routed through this model (no tokenizer, a token id past the vocabulary)."""


@torch.no_grad()
def route_tokens(
    model, token_ids: list[int] | torch.Tensor, max_tokens: int = MAX_TOKENS
) -> list[RoutingRecord]:
    """One forward pass over ``token_ids`` (the first ``max_tokens``) in eval mode: the router's record of each
    MoE layer, in `model.config.moe_layer_ids` order (T = the tokens routed)."""
    ids_T = torch.as_tensor(token_ids, dtype=torch.long).flatten()[:max_tokens]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        return list(model(ids_T[None].to(device), output_routing=True, use_cache=False).routing)
    finally:
        model.train(was_training)


def prompt_set_routing(model, tokenizer, prompts: tuple[Prompt, ...] = PROMPTS) -> dict:
    """For each prompt of the project's prompt set: its tokens (decoded one by one) and, per MoE layer, each
    token's top-k experts (``experts`` [T][K]), their combine weights and router probabilities, and which
    slots were kept (not dropped over capacity). Numbers and the prompt set's own text only."""
    if tokenizer is None:
        raise TokenRoutingError(
            "this model names no tokenizer (a run on synthetic data has none), so the prompt set cannot be "
            "encoded; save a tokenizer beside the model (tokenizer.save_pretrained(model_dir))"
        )
    vocab = model.config.vocab_size
    layer_ids = [int(i) for i in model.config.moe_layer_ids]
    out = []
    for prompt in prompts:
        ids_T = torch.tensor(
            tokenizer.encode(prompt.text, add_special_tokens=False)[:MAX_TOKENS], dtype=torch.long
        )
        if len(ids_T) and int(ids_T.max()) >= vocab:
            raise TokenRoutingError(
                f"prompt {prompt.name!r}: token id {int(ids_T.max())} is past the model's vocabulary ({vocab}); "
                "the tokenizer beside the model is not the one it was trained with"
            )
        records = route_tokens(model, ids_T) if len(ids_T) else []
        layers = []
        for layer_id, record in zip(layer_ids, records):
            ids_TK = record.expert_ids_TK.cpu()
            layers.append(
                {
                    "layer": layer_id,
                    "experts": ids_TK.tolist(),
                    "weights": _rounded(record.weights_TK),  # the combine weights (0 where dropped)
                    "probs": _rounded(record.probs_TE.float().cpu().gather(1, ids_TK)),  # router probability
                    "kept": (~record.dropped_TK.cpu()).tolist(),
                }
            )
        tokens = [tokenizer.decode([int(t)]) for t in ids_T]
        out.append({"name": prompt.name, "domain": prompt.domain, "tokens": tokens, "layers": layers})
    return {
        "prompt_set_version": PROMPT_SET_VERSION,
        "experts": int(model.config.num_experts),
        "top_k": int(model.config.num_experts_per_tok),
        "layers": layer_ids,
        "prompts": out,
    }


def _rounded(values_TK: torch.Tensor) -> list[list[float]]:
    return [[round(v, 4) for v in row] for row in values_TK.detach().float().cpu().tolist()]
