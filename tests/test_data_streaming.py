"""Streaming preparation: sources read as streams with locations, incremental shards equal to the one-shot
writer, bounded samples, the same shards for any number of workers, resume after a kill, a full disk, and
a malformed record deep in a file."""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import moe_core.data.prepare as prepare_module
import moe_core.data.shards as shards_module
from moe_core.data.errors import DataError
from moe_core.data.prepare import SPLITS, PrepareConfig, prepare
from moe_core.data.shards import PackedTokens, ShardWriter, read_manifest, write_split_shards
from moe_core.data.sources import parse_source
from moe_core.data.stream import BottomK, iter_documents, iter_hub_records, iter_records
from moe_core.data.validation import ValidationConfig, validate_source
from moe_core.fileio import DiskFullError

ROOT = Path(__file__).resolve().parents[1]
WORDS = [f"w{i}" for i in range(3000)] + "the of and to in a is that for it as was with be by on not".split()


def write_corpus(path: Path, n_docs: int, words_per_doc: int = 60, seed: int = 0) -> Path:
    """Unique documents of pseudo-random words, one JSON object per line."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n_docs):
            body = " ".join(rng.choice(WORDS) for _ in range(words_per_doc))
            f.write(json.dumps({"text": f"document {i}. {body}"}) + "\n")
    return path


def splits_of(out: Path) -> dict:
    manifest = read_manifest(out)
    return {
        "splits": manifest["splits"],
        "tokenizer": manifest["tokenizer"]["hash"],
        "counts": manifest["counts"],
    }


SMALL = dict(
    vocab_size=400, seq_len=32, blocks_per_shard=16, val_fraction=0.1, test_fraction=0.1, validate=False
)


# ---------------------------------------------------------------------------------------------- readers
def test_every_format_streams_with_locations(tmp_path):
    rows = [{"body": f"row {i} text", "topic": f"t{i % 2}"} for i in range(7)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pd.DataFrame(rows).to_csv(tmp_path / "a.csv", index=False)
    pd.DataFrame(rows).to_parquet(tmp_path / "a.parquet", row_group_size=3)
    for suffix in ("jsonl", "csv", "parquet"):
        docs = list(
            iter_documents(
                parse_source(str(tmp_path / f"a.{suffix}")), text_column="body", domain_column="topic"
            )
        )
        assert [d.text for d in docs] == [r["body"] for r in rows], suffix
        assert [d.domain for d in docs] == [r["topic"] for r in rows], suffix
    assert [w for _, w in iter_records(parse_source(str(tmp_path / "a.parquet")))][3].endswith(
        "row group 1 row 0"
    )
    assert [w for _, w in iter_records(parse_source(str(tmp_path / "a.csv")))][0].endswith("line 2")
    (tmp_path / "p.txt").write_text("one\ntwo\n\nthree\n")
    spec = parse_source(str(tmp_path / "p.txt"))
    assert [(r["text"], w.split(": ")[-1]) for r, w in iter_records(spec)] == [
        ("one\ntwo", "line 1"),
        ("three\n", "line 4"),
    ]
    assert [r["text"] for r, _ in iter_records(spec, txt_sample_by="line")] == ["one", "two", "", "three"]


def test_hub_streaming_path_reads_local_files_like_the_local_reader(tmp_path):
    path = write_corpus(tmp_path / "c.jsonl", 20)
    local = [r for r, _ in iter_records(parse_source(str(path)))]
    hub = [r for r, _ in iter_hub_records("json", data_files=str(path))]
    assert hub == local


def test_a_hub_source_prepares_the_same_shards_as_the_local_file(tmp_path, monkeypatch):
    import datasets

    path = write_corpus(tmp_path / "c.jsonl", 120)
    real = datasets.load_dataset
    calls = []

    def from_local(name, config=None, **kwargs):  # the hub, served from a local file (no network here)
        calls.append((name, kwargs.get("streaming")))
        return real("json", data_files=str(path), split=kwargs["split"], streaming=kwargs["streaming"])

    monkeypatch.setattr(datasets, "load_dataset", from_local)
    hub = prepare(PrepareConfig(source="hf:someone/corpus", **SMALL), tmp_path / "hub")
    local = prepare(PrepareConfig(source=str(path), **SMALL), tmp_path / "local")
    assert calls and all(streaming for _, streaming in calls)
    assert read_manifest(hub)["splits"] == read_manifest(local)["splits"]


def test_a_malformed_record_deep_in_a_file_is_named_by_line_and_the_old_output_stays(tmp_path):
    path = write_corpus(tmp_path / "c.jsonl", 300)
    out = prepare(PrepareConfig(source=str(path), **SMALL), tmp_path / "out")
    before = splits_of(out)
    lines = path.read_text().splitlines()
    lines[240] = '{"text": "cut off'
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"c\.jsonl: line 241: could not parse as json \(Unterminated string"):
        prepare(PrepareConfig(source=str(path), **SMALL), out, overwrite=True)
    assert splits_of(out) == before and len(PackedTokens(out, "train")) > 0
    assert not list(tmp_path.glob(".out.partial-*"))  # nothing expensive was done; nothing left behind
    lines[240] = json.dumps(["not", "an", "object"])
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match="line 241: a JSON list, expected an object"):
        prepare(PrepareConfig(source=str(path), **SMALL), out, overwrite=True)


# ---------------------------------------------------------------------------------------------- pieces
def test_shard_writer_fed_in_pieces_equals_the_one_shot_writer(tmp_path):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 5000, size=10_000).astype(np.int64)
    domains = rng.integers(0, 3, size=10_000).astype(np.uint8)
    whole = write_split_shards(tmp_path / "a", "train", tokens, domains, 32, "uint16", 7)
    writer = ShardWriter(tmp_path / "b", "train", 32, "uint16", 7)
    cuts = np.sort(rng.choice(10_000, size=40, replace=False))
    for a, b in zip([0, *cuts], [*cuts, 10_000]):
        writer.append(tokens[a:b].astype(np.uint32), domains[a:b])
        if a == cuts[20]:  # a restart half way: state out, state in
            state, pending_t, pending_d = writer.state()
            writer = ShardWriter.from_state(
                tmp_path / "b", "train", 32, "uint16", 7, json.loads(json.dumps(state)), pending_t, pending_d
            )
    assert writer.finish() == whole
    for shard in whole["shards"]:
        for kind in ("tokens", "domains"):
            assert (tmp_path / "a" / shard[kind]).read_bytes() == (tmp_path / "b" / shard[kind]).read_bytes()


def test_bottom_k_sample_is_bounded_and_independent_of_order():
    items = [(random.Random(i).getrandbits(64), i, 10 + i % 7, f"item {i}") for i in range(500)]

    def sample(order):
        s = BottomK(max_items=60, max_bytes=400)
        for key, i, size, item in order:
            s.add(key, i, size, item)
        return s

    a = sample(items)
    b = sample(random.Random(1).sample(items, len(items)))
    assert a.items() == b.items() and 0 < len(a) <= 60 and a.bytes <= 400
    smallest = sorted(items)[: len(a)]
    assert sorted(i for i, _ in a.items()) == sorted(i for _, i, _, _ in smallest)


def test_validate_source_checks_a_bounded_sample_of_a_stream(tmp_path):
    path = tmp_path / "v.jsonl"
    rows = [{"text": f"row {i}"} for i in range(200)]
    rows[150] = {"text": "bad\x00row"}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    full = validate_source(str(path), config=ValidationConfig())
    assert full.rows_checked == 200 and not full.success
    part = validate_source(str(path), config=ValidationConfig(), max_rows=50)
    assert part.rows_checked == 50 and part.rows_total == 200
    control = next(o for o in part.outcomes if o.check == "no control characters")
    assert control.row_indices in ([], [150])  # positions in the stream, not in the sample


# ---------------------------------------------------------------------------------------------- prepare
def test_tokenizer_sample_is_bounded_and_recorded(tmp_path):
    path = write_corpus(tmp_path / "c.jsonl", 400)
    out = prepare(PrepareConfig(source=str(path), tokenizer_sample_bytes=20_000, **SMALL), tmp_path / "out")
    manifest = read_manifest(out)
    sample = manifest["tokenizer"]["sample"]
    assert sample["max_bytes"] == 20_000 and 0 < sample["bytes"] <= 20_000
    assert 0 < sample["documents"] < manifest["splits"]["train"]["documents"]
    assert manifest["config"]["tokenizer_sample_bytes"] == 20_000


@pytest.mark.slow
def test_the_shards_do_not_depend_on_the_number_of_workers(tmp_path, monkeypatch):
    path = write_corpus(tmp_path / "c.jsonl", 1500)
    in_process = prepare(PrepareConfig(source=str(path), **SMALL), tmp_path / "here")
    monkeypatch.setattr(prepare_module, "IN_PROCESS_BYTES", 0)  # spawn the pool even for this little text
    monkeypatch.setattr(prepare_module, "CHUNK_BYTES", 16 << 10)  # many chunks in flight
    one = prepare(PrepareConfig(source=str(path), num_proc=1, **SMALL), tmp_path / "one")
    two = prepare(PrepareConfig(source=str(path), num_proc=2, **SMALL), tmp_path / "two")
    assert splits_of(one) == splits_of(two) == splits_of(in_process)
    for split in SPLITS:
        for shard in read_manifest(one)["splits"][split]["shards"]:
            assert (one / shard["tokens"]).read_bytes() == (two / shard["tokens"]).read_bytes()
    assert len(read_manifest(one)["splits"]["train"]["shards"]) > 3


RESUMABLE = """
import sys
import moe_core.data.prepare as p
p.CHUNK_BYTES = 16 << 10
config = p.PrepareConfig(source=sys.argv[1], vocab_size=400, seq_len=64, blocks_per_shard=16, validate=False)
p.prepare(config, sys.argv[2])
"""


@pytest.mark.slow
def test_a_killed_prepare_resumes_and_gives_the_uninterrupted_shards(tmp_path):
    path = write_corpus(tmp_path / "c.jsonl", 3000)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MOE_LAB_PROGRESS": "off"}
    cmd = [sys.executable, "-c", RESUMABLE, str(path), str(out)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while not list(tmp_path.glob(".out.partial-*/progress.json")) and proc.poll() is None:
        assert time.monotonic() < deadline, "no checkpoint was written"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists(), "the run finished before it could be killed; use a larger corpus"
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    resumed_at = [line for line in done.stderr.splitlines() if "resuming" in line and "at document" in line]
    assert resumed_at and int(resumed_at[0].split("at document ")[1].split()[0]) > 0
    reference = prepare(
        PrepareConfig(source=str(path), vocab_size=400, seq_len=64, blocks_per_shard=16, validate=False),
        tmp_path / "reference",
    )
    assert splits_of(out) == splits_of(reference)
    assert not list(tmp_path.glob(".out.partial-*")) and not list(out.glob("pending-*"))


def fill_disk_after(monkeypatch, saves: int):
    """The shard writer's ``np.save`` fails with ENOSPC (a full disk) after ``saves`` calls; returns the function
    that frees the disk again."""
    real_save, calls = np.save, [0]

    def save_until_full(file, arr, *args, **kwargs):
        calls[0] += 1
        if calls[0] > saves:
            raise OSError(errno.ENOSPC, "No space left on device", str(file))
        return real_save(file, arr, *args, **kwargs)

    monkeypatch.setattr(shards_module.np, "save", save_until_full)
    return lambda: monkeypatch.setattr(shards_module.np, "save", real_save)


def test_a_full_disk_mid_way_keeps_the_old_output_and_the_rerun_continues(tmp_path, monkeypatch):
    path = write_corpus(tmp_path / "c.jsonl", 800)
    config = PrepareConfig(source=str(path), **SMALL)
    out = prepare(PrepareConfig(source=str(path), **{**SMALL, "seq_len": 16}), tmp_path / "out")
    before = splits_of(out)
    monkeypatch.setattr(prepare_module, "CHUNK_BYTES", 8 << 10)
    disk_freed = fill_disk_after(monkeypatch, saves=12)
    with pytest.raises(DiskFullError, match=r"needs about .* free there.*same command continues"):
        prepare(config, out, overwrite=True)
    assert splits_of(out) == before  # the last complete shard set is intact
    disk_freed()
    prepare(config, out, overwrite=True)
    reference = prepare(config, tmp_path / "reference")
    assert splits_of(out) == splits_of(reference)


def test_too_little_space_is_said_before_tokenizing(tmp_path, small_disk):
    path = write_corpus(tmp_path / "c.jsonl", 8000)  # about 3.5 MB of text: shards of several MB
    with pytest.raises(DiskFullError, match=r"needs about \d+\.\d MiB, .* free there"):
        prepare(PrepareConfig(source=str(path), **SMALL), small_disk / "out")
    assert not (small_disk / "out").exists()
