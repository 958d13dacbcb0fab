"""Helpers shared by test modules (fixtures live in conftest.py)."""

import torch

from moe_core import MoEForCausalLM, get_config


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Weights at a scale that makes logits O(1); norm weights near, not at, one."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.2 * noise)


def tiny_mixtral(**overrides) -> MoEForCausalLM:
    """mixtral-tiny with a 128-token vocabulary and weights N(0, 0.1) (norms left at one), in eval mode: the
    scale the quantization and pruning tests' tolerances were set for."""
    torch.manual_seed(0)
    model = MoEForCausalLM(get_config("mixtral-tiny", vocab_size=128, **overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0.0, 0.1)
    return model


def token_ids(batch=2, seq=16, seed=1, vocab=128) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))
