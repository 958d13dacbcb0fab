"""Helpers shared by test modules (fixtures live in conftest.py)."""

import torch


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Weights at a scale that makes logits O(1); norm weights near, not at, one."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.2 * noise)
