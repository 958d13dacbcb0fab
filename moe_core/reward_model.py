"""A reward model: the MoE decoder (`moe_core.model.MoEModel`) with a scalar head on its last token.

As transformers' ``*ForSequenceClassification`` with ``num_labels=1`` (what TRL's `RewardTrainer` trains, the
Bradley-Terry pairwise loss of Ouyang et al. 2022, InstructGPT §3.5): the reward of a sequence is the score
head applied to the final-norm hidden state of its last non-padding token. The backbone is the causal LM's own
(`reward_model_from` takes it over without a copy; its LM head is dropped), so LoRA targets, router losses and
routing telemetry are those of `MoEForCausalLM`.

Router losses: as in `MoEForCausalLM.forward`, the load-balancing and z-losses over the non-padding tokens
(`moe_core.router_losses.router_loss`, the one home of their coefficients) are returned as ``router_loss`` by a
forward under autograd; the trainer adds them to the pairwise loss (`moe_core.finetune.objectives`).

Saved with ``save_pretrained``: ``config.json`` (model_type ``moe_lab``, ``architectures:
["MoEForSequenceClassification"]``, ``num_labels: 1``) and ``model.safetensors`` (``model.*`` and ``score.weight``).
`moe_core.load` reads the architecture from config.json and returns this class (kind ``reward``).

Legend: B = batch, S = sequence length, D = model dim.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn
from transformers.utils import ModelOutput

from moe_core.config import MoEConfig
from moe_core.model import MoEModel, MoEPreTrainedModel, RouterAccess
from moe_core.router_losses import LoadBalance, RouterLosses, layer_losses, router_loss
from moe_core.routing import RoutingRecord

REWARD_ARCHITECTURE = "MoEForSequenceClassification"


@dataclass
class MoERewardOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None  # [B, 1]: the reward of each sequence
    aux_loss: torch.Tensor | None = None  # layer mean of the load-balancing loss (reported)
    z_loss: torch.Tensor | None = None  # layer mean of the z-loss (reported)
    router_loss: torch.Tensor | None = None  # what the router losses add to the objective
    router_losses: RouterLosses | None = None
    routing: tuple[RoutingRecord, ...] | None = None


def last_token_index(attention_mask_BS: torch.Tensor | None, input_ids_BS: torch.Tensor) -> torch.Tensor:
    """Position of each sequence's last real token, for right padding (TRL's collators pad right); no mask:
    the last position."""
    B, S = input_ids_BS.shape
    if attention_mask_BS is None:
        return torch.full((B,), S - 1, dtype=torch.long, device=input_ids_BS.device)
    # the last 1 in each row (left padding included): S-1 minus the first 1 counted from the end
    flipped_BS = attention_mask_BS.flip(-1).long()
    return (S - 1 - flipped_BS.argmax(-1)).to(input_ids_BS.device)


class MoEForSequenceClassification(RouterAccess, MoEPreTrainedModel):
    """MoE backbone + ``score`` (D -> num_labels, no bias); a reward model when ``config.num_labels == 1``."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__(config)
        self.model = MoEModel(config)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.load_balance: LoadBalance | None = None  # as `MoEForCausalLM.load_balance`
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_routing: bool = False,
        expert_impl: str | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> MoERewardOutput:
        h_BSD, _, records = self.model(
            input_ids, attention_mask, position_ids, None, None, False, expert_impl
        )
        last_B = last_token_index(attention_mask, input_ids)
        h_BD = h_BSD[torch.arange(h_BSD.shape[0], device=h_BSD.device), last_B]
        logits_B1 = self.score(h_BD.to(self.score.weight.dtype)).float()
        losses = extra = None
        if records and (self.training or torch.is_grad_enabled()):  # as MoEForCausalLM: not in eval no_grad
            balancing = [router.balancing for router in self.routers()]
            losses = layer_losses(
                records, balancing, attention_mask, self.load_balance if self.training else None
            )
            extra = router_loss(self.config, losses)
        return MoERewardOutput(
            logits=logits_B1,
            aux_loss=None if losses is None else losses.aux,
            z_loss=None if losses is None else losses.z,
            router_loss=extra,
            router_losses=losses,
            routing=tuple(records) if output_routing else None,
        )


def reward_model_from(causal_lm) -> MoEForSequenceClassification:
    """A reward model on ``causal_lm``'s backbone (the same modules, not a copy; the LM head is left behind) and
    a fresh score head (normal, the config's ``initializer_range``), in the backbone's dtype and device."""
    config = copy.deepcopy(causal_lm.config)
    config.num_labels = 1
    config.architectures = [REWARD_ARCHITECTURE]
    with torch.device("meta"):
        reward = MoEForSequenceClassification(config)
    reward.model = causal_lm.model
    weight = causal_lm.model.embed_tokens.weight
    score = nn.Linear(config.hidden_size, 1, bias=False, device=weight.device, dtype=weight.dtype)
    nn.init.normal_(score.weight, 0.0, config.initializer_range)
    reward.score = score
    reward.train(causal_lm.training)
    return reward


@torch.no_grad()
def pairwise_accuracy(model, pairs_ids: list[tuple[list[int], list[int]]], batch_size: int = 16) -> dict:
    """Share of pairs whose chosen sequence gets the higher reward (ties count as wrong), and the mean margin.
    ``pairs_ids``: (chosen token ids, rejected token ids), each the whole framed sequence."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    pad = model.config.pad_token_id or 0
    correct, margins = 0, []
    try:
        for start in range(0, len(pairs_ids), batch_size):
            chunk = pairs_ids[start : start + batch_size]
            seqs = [c for c, _ in chunk] + [r for _, r in chunk]
            S = max(len(s) for s in seqs)
            ids_BS = torch.full((len(seqs), S), pad, dtype=torch.long)
            mask_BS = torch.zeros((len(seqs), S), dtype=torch.long)
            for b, s in enumerate(seqs):
                ids_BS[b, : len(s)] = torch.tensor(s)
                mask_BS[b, : len(s)] = 1
            rewards_B = model(input_ids=ids_BS.to(device), attention_mask=mask_BS.to(device)).logits[:, 0]
            chosen, rejected = rewards_B[: len(chunk)], rewards_B[len(chunk) :]
            correct += int((chosen > rejected).sum())
            margins.extend((chosen - rejected).tolist())
    finally:
        model.train(was_training)
    n = len(pairs_ids)
    return {
        "pairs": n,
        "pairwise_accuracy": correct / n if n else float("nan"),
        "mean_margin": sum(margins) / n if n else float("nan"),
    }
