"""ResumableSampler: deterministic from (seed, epoch, position), disjoint across ranks, exact resume."""

from __future__ import annotations

import itertools

import pytest
import torch

from moe_core.data.sampler import ResumableSampler, iterate_batches


class FakeBlocks:
    """Block i is a [4] tensor filled with i, so a batch tells which blocks it holds."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((4,), i, dtype=torch.long)

    def domains(self, i: int) -> torch.Tensor:
        return torch.full((4,), i % 2, dtype=torch.long)


def test_deterministic_and_epochs_differ():
    a, b = ResumableSampler(50, seed=1), ResumableSampler(50, seed=1)
    assert list(a) == list(b)
    a.set_epoch(1)
    epoch1 = list(a)
    assert sorted(epoch1) == list(range(50)) and epoch1 != list(b.epoch_order(0))
    assert list(ResumableSampler(50, seed=2)) != list(b.epoch_order(0))
    assert list(ResumableSampler(10, shuffle=False)) == list(range(10))


@pytest.mark.parametrize("num_blocks", [40, 43])
def test_two_ranks_see_every_block_exactly_once_per_epoch(num_blocks):
    for epoch in range(3):
        seen = []
        for rank in range(2):
            sampler = ResumableSampler(num_blocks, seed=7, rank=rank, world_size=2)
            sampler.set_epoch(epoch)
            seen.append(list(sampler))
        assert not set(seen[0]) & set(seen[1])  # no overlap
        assert len(seen[0]) == len(seen[1]) == num_blocks // 2
        union = seen[0] + seen[1]
        assert len(union) == len(set(union))  # each at most once
        assert len(union) == num_blocks - num_blocks % 2  # all of them (drop_last leaves out the odd one)
    keep_all = [
        list(ResumableSampler(num_blocks, seed=7, rank=r, world_size=2, drop_last=False)) for r in range(2)
    ]
    assert set(keep_all[0]) | set(keep_all[1]) == set(range(num_blocks))


def test_two_ranks_resume_at_the_same_block_after_restart():
    runs = {}
    for rank in range(2):
        full = ResumableSampler(30, seed=3, rank=rank, world_size=2)
        reference = list(itertools.islice(iter(full), 15))  # one whole epoch of this rank
        sampler = ResumableSampler(30, seed=3, rank=rank, world_size=2)
        it = iter(sampler)
        head = [next(it) for _ in range(6)]
        state = sampler.state_dict()
        assert state["position"] == 6 and state["epoch"] == 0 and state["seed"] == 3
        restarted = ResumableSampler(30, seed=3, rank=rank, world_size=2)
        restarted.load_state_dict(state)
        restarted.set_epoch(0)  # a training loop calling set_epoch on the current epoch keeps the position
        tail = list(restarted)
        assert head + tail == reference
        runs[rank] = head + tail
    assert sorted(runs[0] + runs[1]) == list(range(30))


def test_load_state_dict_rejects_other_settings():
    state = ResumableSampler(30, seed=3, world_size=2).state_dict()
    with pytest.raises(ValueError, match="seed"):
        ResumableSampler(30, seed=4, world_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="world_size"):
        ResumableSampler(30, seed=3, world_size=3).load_state_dict(state)
    with pytest.raises(ValueError, match="rank"):
        ResumableSampler(30, rank=2, world_size=2)


def test_iterate_batches_rolls_over_epochs_and_resumes_exactly():
    data = FakeBlocks(10)
    sampler = ResumableSampler(10, seed=0)
    batches = [
        b[:, 0].tolist() for b in itertools.islice(iterate_batches(data, sampler, 4), 6)
    ]  # 24 = 2.4 epochs
    flat = sum(batches, [])
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))
    assert flat[:10] != flat[10:20]
    assert sampler.state_dict()["epoch"] == 2 and sampler.state_dict()["position"] == 4

    first = ResumableSampler(10, seed=0)
    gen = iterate_batches(data, first, 4)
    head = [next(gen)[:, 0].tolist() for _ in range(3)]
    state = first.state_dict()  # saved between batches, mid-epoch (position 2 of epoch 1)
    second = ResumableSampler(10, seed=0)
    second.load_state_dict(state)
    tail = [b[:, 0].tolist() for b in itertools.islice(iterate_batches(data, second, 4), 3)]
    assert head + tail == batches
    tokens, domains = next(iterate_batches(data, ResumableSampler(10), 2, with_domains=True))
    assert tokens.shape == domains.shape == (2, 4)
