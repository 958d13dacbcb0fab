"""prepare(): manifest, tokenizer, packed shards, hash split, dedup, reuse, checksums, atomic output."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from transformers import AutoTokenizer

from moe_core.data.errors import DataError
from moe_core.data.prepare import SPLITS, PrepareConfig, assign_splits, prepare
from moe_core.data.shards import PackedTokens, read_manifest
from moe_core.data.sources import builtin_corpus
from moe_core.data.tokenizer import load_tokenizer

SMALL = dict(max_documents=24, vocab_size=300, seq_len=32, num_proc=1, val_fraction=0.1, test_fraction=0.1)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    return prepare(PrepareConfig(**SMALL), tmp_path_factory.mktemp("prep") / "data")


def test_layout_manifest_and_tokenizer(prepared):
    manifest = read_manifest(prepared)
    assert manifest["seq_len"] == 32 and manifest["dtype"] == "uint16"
    assert manifest["domains"] == ["code", "prose"]
    assert manifest["source"]["type"] == "builtin" and len(manifest["source"]["fingerprint"]) == 64
    assert manifest["tokenizer"]["vocab_size"] == 300 and len(manifest["tokenizer"]["hash"]) == 64
    assert manifest["validation"]["success"] is True and (prepared / "validation.md").is_file()
    counts = manifest["counts"]
    assert counts["documents_loaded"] == 24
    assert sum(manifest["splits"][s]["documents"] for s in SPLITS) == counts["documents_kept"]
    tok = AutoTokenizer.from_pretrained(prepared / "tokenizer")
    assert tok.eos_token_id == manifest["tokenizer"]["eos_token_id"]
    for split in SPLITS:
        entry = manifest["splits"][split]
        assert entry["num_blocks"] > 0, split  # small corpora still get evaluation blocks
        assert entry["num_tokens"] == entry["num_blocks"] * 32
        assert all(len(s["sha256"]["tokens"]) == 64 for s in entry["shards"])
    assert not list(prepared.parent.glob(".*tmp*"))  # the temporary directory was renamed away


def test_blocks_are_train_documents_joined_by_eos(prepared):
    manifest = read_manifest(prepared)
    config = PrepareConfig(**SMALL)
    docs = builtin_corpus(24)
    split_ids, _ = assign_splits(config, [d.text for d in docs])
    tok = load_tokenizer(prepared)
    names = manifest["domains"]
    expected, expected_dom = [], []
    for doc, sid in zip(docs, split_ids):
        if sid == 0:
            ids = tok(doc.text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            expected += ids
            expected_dom += [names.index(doc.domain)] * len(ids)
    train = PackedTokens(prepared, "train")
    n = len(train) * train.seq_len
    assert n <= len(expected) < n + train.seq_len  # only the tail that does not fill a block is dropped
    got = np.concatenate([train[i].numpy() for i in range(len(train))])
    got_dom = np.concatenate([train.domains(i).numpy() for i in range(len(train))])
    assert got.tolist() == expected[:n]
    assert got_dom.tolist() == expected_dom[:n]
    assert train[0].dtype.is_floating_point is False and train[0].shape == (32,)
    assert train[-1].tolist() == train[len(train) - 1].tolist()
    assert train.get_batch([0, 2]).shape == (2, 32)
    assert train.block_domain(0) in (0, 1)
    with pytest.raises(IndexError):
        train[len(train)]


def test_split_is_by_document_hash_not_order():
    config = PrepareConfig(**SMALL)
    texts = [f"document {i} " * 50 for i in range(200)]
    ids, _ = assign_splits(config, texts)
    order = list(range(200))
    random.Random(0).shuffle(order)
    shuffled, _ = assign_splits(config, [texts[i] for i in order])
    assert [ids[i] for i in order] == shuffled
    assert {0, 1, 2} <= set(ids)
    dup_ids, counts = assign_splits(config, texts + texts[:5])
    assert counts["duplicates_removed"] == 5 and dup_ids[-5:] == [-1] * 5


def test_rerun_reuses_and_other_inputs_need_overwrite(prepared):
    stamp = (prepared / "manifest.json").stat().st_mtime_ns
    assert prepare(PrepareConfig(**{**SMALL, "num_proc": 2}), prepared) == prepared  # same inputs: reused
    assert (prepared / "manifest.json").stat().st_mtime_ns == stamp
    with pytest.raises(DataError, match="other inputs"):
        prepare(PrepareConfig(**{**SMALL, "seq_len": 16}), prepared)
    assert (prepared / "manifest.json").stat().st_mtime_ns == stamp  # untouched


def test_corrupt_shard_is_detected_and_overwrite_repairs(tmp_path):
    config = PrepareConfig(**{**SMALL, "max_documents": 8, "val_fraction": 0.0, "test_fraction": 0.0})
    out = prepare(config, tmp_path / "data")
    shard = out / read_manifest(out)["splits"]["train"]["shards"][0]["tokens"]
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(DataError, match="checksum mismatch") as err:
        PackedTokens(out, "train")
    assert shard.name in str(err.value) and "--overwrite" in str(err.value)
    with pytest.raises(DataError, match="checksum mismatch"):
        prepare(config, out)  # reuse verifies too
    assert len(PackedTokens(out, "train", verify=False)) > 0
    prepare(config, out, overwrite=True)
    assert len(PackedTokens(out, "train")) > 0
    with pytest.raises(DataError, match="no split"):
        PackedTokens(out, "dev")
    (out / "tokenizer" / "tokenizer.json").write_text("{}")
    with pytest.raises(DataError, match="tokenizer.json"):
        PackedTokens(out, "train")


def test_the_encoder_gives_the_tokenizer_s_ids(prepared):
    """`Encoder` tokenizes with ``encode_batch_fast`` (no offsets): the ids of the transformers tokenizer a model
    trains with, on text with unicode, runs of spaces, tabs and newlines, and an empty document."""
    from moe_core.data.encode import Encoder

    tok = AutoTokenizer.from_pretrained(prepared / "tokenizer")
    texts = ["def f(x):\n\treturn x  # é ü 中文", "", "   leading and trailing   ", "line\n\n\nbreaks\r\n"]
    encoder = Encoder((prepared / "tokenizer" / "tokenizer.json").read_text(), tok.eos_token_id, True)
    (tokens, _, documents), *_ = encoder.encode(texts, [0] * len(texts), [0] * len(texts))
    want = [i for ids in tok(texts, add_special_tokens=False)["input_ids"] for i in [*ids, tok.eos_token_id]]
    assert documents == len(texts) and tokens.tolist() == want


def test_local_jsonl_dedup_uint32_and_existing_tokenizer(tmp_path, prepared):
    path = tmp_path / "docs.jsonl"
    rows = [{"body": f"local document {i} " + "words " * 40} for i in range(20)]
    rows += rows[:2]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    config = PrepareConfig(
        source=str(path),
        text_column="body",
        tokenizer=str(prepared / "tokenizer"),
        seq_len=16,
        dtype="uint32",
        val_fraction=0.0,
        test_fraction=0.0,
        validation={"max_duplicate_ratio": 0.2},
    )
    out = prepare(config, tmp_path / "local")
    manifest = read_manifest(out)
    assert manifest["counts"]["duplicates_removed"] == 2 and manifest["splits"]["train"]["documents"] == 20
    assert manifest["dtype"] == "uint32" and manifest["domains"] == ["text"]
    assert manifest["tokenizer"]["hash"] == read_manifest(prepared)["tokenizer"]["hash"]
    assert np.load(out / manifest["splits"]["train"]["shards"][0]["tokens"], mmap_mode="r").dtype == np.uint32


def test_instruction_data_is_rendered_with_the_chat_template(tmp_path):
    path = tmp_path / "chat.jsonl"
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"question {i} " * 5},
                {"role": "assistant", "content": f"answer {i} " * 5},
            ]
        }
        for i in range(30)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = prepare(
        PrepareConfig(
            source=str(path),
            kind="instruction",
            vocab_size=300,
            seq_len=32,
            val_fraction=0.0,
            test_fraction=0.0,
        ),
        tmp_path / "sft",
    )
    tok = load_tokenizer(out)
    blocks = PackedTokens(out, "train")
    flat = sum((blocks[i].tolist() for i in range(len(blocks))), [])
    assert tok.convert_tokens_to_ids("<|assistant|>") in flat and tok.bos_token_id in flat
    assert read_manifest(out)["domains"] == ["instruction"]


def test_cli_prepare(tmp_path, capsys):
    from moe_core.cli import main

    out = tmp_path / "cli"
    argv = [
        "data",
        "prepare",
        "builtin",
        "--out",
        str(out),
        "--max-documents",
        "8",
        "--vocab-size",
        "300",
        "--seq-len",
        "32",
        "--val-fraction",
        "0",
        "--test-fraction",
        "0",
    ]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["splits"]["train"]["num_blocks"] == len(PackedTokens(out, "train")) > 0
    assert main(argv) == 0  # re-run reuses


@pytest.mark.slow
def test_several_processes_give_identical_shards(tmp_path, prepared):
    out = prepare(PrepareConfig(**{**SMALL, "num_proc": 2}), tmp_path / "two")
    one, two = read_manifest(prepared), read_manifest(out)
    assert one["fingerprint"] == two["fingerprint"]
    for split in SPLITS:
        assert one["splits"][split] == two["splits"][split]  # same shards, same sha256
