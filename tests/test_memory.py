"""`moe_core.memory.release_freed_memory`: freed tensors the C heap kept are given back to the operating system
(a fine-tune calls it between training and its exports)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from moe_core.memory import _malloc_trim, release_freed_memory


def anon_mib() -> float:
    return int(re.search(r"RssAnon:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024


@pytest.mark.skipif(not sys.platform.startswith("linux") or _malloc_trim() is None, reason="glibc only")
def test_freed_tensors_the_heap_kept_are_given_back():
    # freeing a mapped 24 MiB block raises glibc's mmap threshold past 4 MiB
    big = torch.ones(24 * 2**20 // 4)
    del big
    kept, freed = [], []
    # 512 MiB of 4 MiB tensors, now from the heap; every 16th stays, pinning the heap's top
    for i in range(128):
        (kept if i % 16 == 15 else freed).append(torch.ones(2**20))
    del freed
    before = anon_mib()
    assert release_freed_memory()
    assert before - anon_mib() > 0.5 * 112 * 4, (before, anon_mib())  # most of the 448 MiB freed
    assert all(t.sum() == t.numel() for t in kept)  # what is alive is untouched


def test_without_malloc_trim_it_only_collects(monkeypatch):
    from moe_core import memory

    monkeypatch.setattr(memory, "_malloc_trim", lambda: None)
    assert memory.release_freed_memory() is False
