"""Prepared data read by URL (`moe_core.data.shards.prepared_dir`): ``file://`` in place, any other fsspec
protocol fetched into the lab's data directory file by file, each checked against the manifest before it is
renamed into place. fsspec's in-process ``memory://`` filesystem stands in for object storage (s3fs and gcsfs
are the same interface over the network)."""

from __future__ import annotations

import uuid

import fsspec
import pytest
import torch
from safetensors.torch import load_file

from moe_core.data.errors import DataError
from moe_core.data.prepare import PrepareConfig, prepare
from moe_core.data.shards import PackedTokens, prepared_dir, read_manifest
from moe_core.train import TrainConfig, train

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

SMALL = dict(max_documents=24, vocab_size=300, seq_len=32, num_proc=1, val_fraction=0.1, test_fraction=0.1)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    return prepare(PrepareConfig(**SMALL), tmp_path_factory.mktemp("prep") / "data")


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_LAB_DATA_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def upload(local) -> str:
    """The prepared directory copied to a fresh in-memory bucket; its URL."""
    root = f"/bucket-{uuid.uuid4().hex[:8]}/data"
    fsspec.filesystem("memory").put(str(local), root, recursive=True)
    return f"memory://{root}"


def blocks(data) -> torch.Tensor:
    return torch.stack([data[i] for i in range(len(data))])


def test_a_url_reads_the_same_blocks_fetching_only_the_splits_asked_for(prepared, cache):
    url = upload(prepared)
    manifest = read_manifest(url)  # the manifest and tokenizer only
    local = prepared_dir(url, splits=[])
    assert manifest == read_manifest(prepared) and (local / "tokenizer").is_dir()
    assert not (local / "train").exists()
    remote = PackedTokens(url, "validation")
    assert remote.data_dir == local and not (local / "train").exists()
    assert torch.equal(blocks(remote), blocks(PackedTokens(prepared, "validation")))
    assert torch.equal(blocks(PackedTokens(url, "train")), blocks(PackedTokens(prepared, "train")))
    assert not list(local.rglob(".*.partial-*"))
    # a second reader (another rank on the node) reuses the fetched files: nothing is read remotely but the manifest
    opened = []
    memory = fsspec.filesystem("memory")
    original = memory.open
    memory.open = lambda path, *a, **k: opened.append(path) or original(path, *a, **k)
    try:
        PackedTokens(url, "train")
    finally:
        del memory.open
    assert opened == []


def test_a_file_url_is_read_in_place(prepared, cache):
    assert prepared_dir(f"file://{prepared}") == prepared
    assert len(PackedTokens(f"file://{prepared}", "train")) == len(PackedTokens(prepared, "train"))
    assert not cache.exists()


def test_training_on_a_url_equals_training_on_the_directory(prepared, cache, tmp_path):
    def run(path, out):
        config = TrainConfig.build(
            {
                "model": {"preset": "switch-tiny"},
                "steps": 2,
                "batch_size": 2,
                "data": {"path": str(path), "seq_len": 32},
                "log": {"every": 1, "progress": "off"},
                "checkpoint": {"every": 10},
                "eval": {"batches": 1},
            }
        )
        return load_file(train(config, tmp_path / out).export_dir / "model.safetensors")

    here, there = run(prepared, "local"), run(upload(prepared), "remote")
    assert here.keys() == there.keys() and all(torch.equal(here[k], there[k]) for k in here)


def test_a_corrupt_remote_shard_is_named_and_nothing_is_kept(prepared, cache):
    url = upload(prepared)
    shard = read_manifest(prepared)["splits"]["train"]["shards"][0]["tokens"]
    memory = fsspec.filesystem("memory")
    remote = f"{url.removeprefix('memory://')}/{shard}"
    raw = bytearray(memory.cat_file(remote))
    raw[-1] ^= 0xFF
    memory.pipe_file(remote, bytes(raw))
    with pytest.raises(DataError, match="checksum mismatch") as err:
        PackedTokens(url, "train")
    assert f"{url}/{shard}" in str(err.value)
    local = prepared_dir(url, splits=[])
    assert not (local / shard).exists() and not list(local.rglob(".*.partial-*"))


def test_what_a_url_cannot_give_is_said_before_training(cache, tmp_path):
    empty = f"memory:///bucket-{uuid.uuid4().hex[:8]}/nothing"
    fsspec.filesystem("memory").pipe_file(f"{empty.removeprefix('memory://')}/readme.txt", b"x")
    with pytest.raises(DataError, match="no manifest.json; this is not a prepared-data directory"):
        PackedTokens(empty, "train")
    with pytest.raises(DataError, match="install the fsspec implementation"):
        read_manifest("nosuchprotocol://bucket/data")
