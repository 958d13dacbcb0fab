"""A resumable, rank-aware sampler over packed blocks.

The order of epoch `e` is a permutation drawn from ``numpy.random.default_rng([seed, e])``, so it depends
only on (seed, epoch). Rank `r` of `w` takes ``order[r::w]`` (the DistributedSampler split): the ranks never
overlap, and together they cover every block once per epoch (with ``drop_last=True`` the last
``num_blocks % w`` blocks of the permutation, different ones each epoch, are left out so every rank has as
many; with ``drop_last=False`` the order is padded by wrapping around, so a few blocks repeat).

`position` counts the blocks this rank has taken from the current epoch. Saving ``state_dict()`` and
loading it into a fresh sampler resumes at the same next block. The position advances when a block is
yielded, so a consumer that prefetches (a DataLoader with workers) should checkpoint the position of what
it consumed; `iterate_batches` consumes exactly what it yields.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch


class ResumableSampler(torch.utils.data.Sampler[int]):
    def __init__(
        self,
        num_blocks: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        drop_last: bool = True,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(
                f"ResumableSampler: num_blocks={num_blocks} must be positive (is the split empty?)"
            )
        if world_size <= 0 or not 0 <= rank < world_size:
            raise ValueError(f"ResumableSampler: rank={rank} must be in [0, world_size={world_size})")
        if drop_last and num_blocks < world_size:
            raise ValueError(
                f"ResumableSampler: {num_blocks} blocks cannot give each of {world_size} ranks one "
                "with drop_last=True; use drop_last=False or more data"
            )
        self.num_blocks = num_blocks
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0
        self._cache: tuple[int, np.ndarray] | None = None

    @property
    def num_samples(self) -> int:
        """Blocks this rank takes per epoch."""
        if self.drop_last:
            return self.num_blocks // self.world_size
        return -(-self.num_blocks // self.world_size)

    def __len__(self) -> int:
        return self.num_samples

    def epoch_order(self, epoch: int | None = None) -> np.ndarray:
        """The block indices of this rank for `epoch` (default: the current one), from the start."""
        epoch = self.epoch if epoch is None else epoch
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.num_blocks)
        else:
            order = np.arange(self.num_blocks)
        total = self.num_samples * self.world_size
        if total > len(order):  # drop_last=False: wrap around to give every rank as many
            order = np.concatenate([order, order[: total - len(order)]])
        order = order[:total][self.rank :: self.world_size]
        self._cache = (epoch, order)
        return order

    def set_epoch(self, epoch: int) -> None:
        """Move to `epoch`, starting at its beginning; the current epoch keeps its position (so a loop that
        calls set_epoch(e) after load_state_dict resumes mid-epoch)."""
        if epoch != self.epoch:
            self.epoch = epoch
            self.position = 0

    def __iter__(self) -> Iterator[int]:
        order = self.epoch_order()
        while self.position < len(order):
            index = int(order[self.position])
            self.position += 1
            yield index

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_blocks": self.num_blocks,
            "rank": self.rank,
            "world_size": self.world_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seed", "num_blocks", "world_size", "shuffle", "drop_last"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"ResumableSampler.load_state_dict: saved {key}={state[key]!r} but this sampler has "
                    f"{getattr(self, key)!r}; resume with the same data and settings "
                    "(changing world_size mid-epoch is not supported: resume at an epoch boundary)"
                )
        position = int(state["position"])
        if not 0 <= position <= self.num_samples:
            raise ValueError(
                f"ResumableSampler.load_state_dict: position={position} outside [0, {self.num_samples}]"
            )
        self.epoch = int(state["epoch"])
        self.position = position


def iterate_batches(
    dataset: Any, sampler: ResumableSampler, batch_size: int, with_domains: bool = False
) -> Iterator[Any]:
    """Endless LongTensor [batch_size, seq_len] batches in the sampler's order, rolling over epochs (a batch
    may span the boundary). The sampler's state after each yield resumes at the next batch. With
    `with_domains` it yields (tokens, per-token domain ids) pairs."""
    if batch_size <= 0:
        raise ValueError(f"iterate_batches: batch_size={batch_size} must be positive")
    if len(dataset) != sampler.num_blocks:
        raise ValueError(
            f"iterate_batches: the sampler covers {sampler.num_blocks} blocks but the dataset has "
            f"{len(dataset)}; build the sampler with num_blocks=len(dataset)"
        )
    while True:
        indices: list[int] = []
        while len(indices) < batch_size:
            if sampler.position >= sampler.num_samples:
                sampler.set_epoch(sampler.epoch + 1)
            order = sampler.epoch_order()
            take = min(batch_size - len(indices), len(order) - sampler.position)
            indices.extend(order[sampler.position : sampler.position + take].tolist())
            sampler.position += take
        tokens = torch.stack([dataset[i] for i in indices])
        if with_domains:
            yield tokens, torch.stack([dataset.domains(i) for i in indices])
        else:
            yield tokens
