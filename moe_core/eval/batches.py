"""Evaluation batches from a prepared-data directory: the first blocks of a split, in order, so every
evaluation of the same data sees the same tokens.

Legend: B = batch, S = sequence (the prepared ``seq_len``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from moe_core.data.shards import PackedTokens, read_manifest


def split_batches(
    data_dir: str | Path,
    split: str,
    batch_size: int = 8,
    max_batches: int | None = None,
    with_domains: bool = False,
    verify: bool = True,
) -> Iterator[torch.Tensor | tuple[torch.Tensor, torch.Tensor]]:
    """Yield LongTensor ``[B, S]`` batches of a split (``(ids_BS, domains_BS)`` with ``with_domains``).

    Reads `moe_core.data.shards.PackedTokens`; the last batch may be smaller.
    """
    if batch_size < 1:
        raise ValueError(f"split_batches: batch_size={batch_size} must be >= 1")
    data = PackedTokens(data_dir, split, verify=verify)
    n = len(data)
    if max_batches is not None:
        n = min(n, max_batches * batch_size)
    for start in range(0, n, batch_size):
        indices = list(range(start, min(start + batch_size, n)))
        ids_BS = data.get_batch(indices)
        if with_domains:
            yield ids_BS, torch.stack([data.domains(i) for i in indices])
        else:
            yield ids_BS


def domain_names(data_dir: str | Path) -> list[str]:
    """The domain names of a prepared directory (index = the per-token domain id)."""
    return list(read_manifest(data_dir)["domains"])
