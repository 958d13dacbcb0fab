"""Preparation with its tokenize stage on Ray (``engine="ray"``): the same shards, byte for byte, as one
local process, on a local Ray cluster of two workers (the session's, `local_ray` in conftest.py: preparation
joins a cluster the process already has, as with ``RAY_ADDRESS``)."""

from __future__ import annotations

import pytest

from moe_core.data import prepare as prepare_module
from moe_core.data.prepare import PrepareConfig, prepare
from moe_core.data.shards import read_manifest

SMALL = dict(
    max_documents=60, vocab_size=300, seq_len=32, val_fraction=0.1, test_fraction=0.1, blocks_per_shard=16
)


def shard_digests(data_dir) -> dict:
    manifest = read_manifest(data_dir)
    return {
        "fingerprint": manifest["fingerprint"],
        "tokenizer": manifest["tokenizer"]["files"],
        "shards": {
            split: [s["sha256"] for s in info["shards"]] for split, info in manifest["splits"].items()
        },
    }


@pytest.mark.slow
def test_ray_tasks_give_the_shards_of_one_local_process(tmp_path, monkeypatch, local_ray):
    monkeypatch.setattr(prepare_module, "CHUNK_DOCUMENTS", 4)  # many tasks, whose results must come in order
    local = prepare(PrepareConfig(**SMALL, num_proc=1), tmp_path / "local")
    on_ray = prepare(PrepareConfig(**SMALL, num_proc=2, engine="ray"), tmp_path / "ray")
    assert sum(len(s) for s in shard_digests(local)["shards"].values()) > 3  # several shards per run
    assert len(read_manifest(local)["splits"]["train"]["shards"]) > 1
    assert shard_digests(on_ray) == shard_digests(local)


def test_an_unknown_engine_is_refused_by_name():
    with pytest.raises(ValueError, match=r"PrepareConfig.engine='spark': choose one of \('local', 'ray'\)"):
        PrepareConfig(engine="spark")
