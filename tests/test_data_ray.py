"""Preparation on Ray (``engine="ray"``: each part of the source read, scanned and tokenized by a task): the
same shards and manifest, byte for byte, as one local process, on a local Ray cluster of two workers (the
session's, `local_ray` in conftest.py: preparation joins a cluster the process already has, as with
``RAY_ADDRESS``): the built-in corpus (one part), many files, and one JSON-lines file cut into byte ranges,
with exact and near-duplicates planted across the cuts."""

from __future__ import annotations

import json
import random
import time
from dataclasses import replace as dataclasses_replace
from pathlib import Path

import pytest

from moe_core.data import prepare as prepare_module
from moe_core.data import stream as stream_module
from moe_core.data.errors import DataError
from moe_core.data.prepare import PrepareConfig, prepare
from moe_core.data.shards import MANIFEST, read_manifest
from moe_core.fileio import DiskFullError
from tests.test_data_streaming import fill_disk_after

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


WORDS = [f"w{i}" for i in range(400)] + "the of and to in a is that for it as was with be by on not".split()


def corpus_with_duplicates(n_docs: int, seed: int = 0) -> list[str]:
    """Documents of random words; every 7th repeats an earlier one exactly, every 5th repeats one with a word
    changed (a near-duplicate), some are blank: far apart, so they fall in other parts than their originals."""
    rng = random.Random(seed)
    docs: list[str] = []
    for i in range(n_docs):
        if i % 13 == 6:
            docs.append("   ")
        elif i > 20 and i % 7 == 0:
            docs.append(docs[rng.randrange(i // 2)])
        elif i > 20 and i % 5 == 0:
            words = docs[rng.randrange(i // 2)].split() or ["x"]
            words[rng.randrange(len(words))] = "changed"
            docs.append(" ".join(words))
        else:
            docs.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60))))
    return docs


def write_jsonl(path, docs):
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def same_preparation(local, on_ray):
    """The shards and the manifest byte for byte; the manifest's config differs only in the engine."""
    ours, theirs = json.loads((local / MANIFEST).read_text()), json.loads((on_ray / MANIFEST).read_text())
    for m in (ours, theirs):
        m["config"].pop("engine"), m["config"].pop("num_proc")
    assert theirs == ours
    assert shard_digests(on_ray) == shard_digests(local)
    for shard in sorted(p.relative_to(local) for p in local.rglob("*") if p.is_file() and p.name != MANIFEST):
        assert (on_ray / shard).read_bytes() == (local / shard).read_bytes(), shard


CUT = dict(
    vocab_size=300,
    seq_len=32,
    val_fraction=0.1,
    test_fraction=0.1,
    blocks_per_shard=16,
    near_dedup=0.7,
    minhash_num_perm=32,
    validation={"max_duplicate_ratio": 0.3},  # the planted duplicates
)


@pytest.mark.slow
def test_ray_reads_and_scans_a_file_cut_into_byte_ranges_to_the_same_shards(tmp_path, monkeypatch, local_ray):
    monkeypatch.setattr(stream_module, "PART_BYTES", 4000)  # ~14 parts, duplicates across the cuts
    source = write_jsonl(tmp_path / "c.jsonl", corpus_with_duplicates(300))
    config = dict(CUT, source=str(source))
    local = prepare(PrepareConfig(**config), tmp_path / "local")
    counts = read_manifest(local)["counts"]
    assert counts["duplicates_removed"] > 10 and counts["near_duplicates_removed"] > 10
    chunks = prepare_module._chunks
    monkeypatch.setattr(prepare_module, "_chunks", None)  # on Ray this process reads no document in pass 2
    on_ray = prepare(PrepareConfig(**config, num_proc=2, engine="ray"), tmp_path / "ray")
    monkeypatch.setattr(prepare_module, "_chunks", chunks)
    same_preparation(local, on_ray)
    limited = dict(config, max_documents=170)  # the stream ends inside a part
    same_preparation(
        prepare(PrepareConfig(**limited), tmp_path / "local-170"),
        prepare(PrepareConfig(**limited, engine="ray"), tmp_path / "ray-170"),
    )


@pytest.mark.slow
def test_ray_prepares_many_files_as_one_process_does(tmp_path, local_ray):
    docs = corpus_with_duplicates(240, seed=1)
    (tmp_path / "src").mkdir()
    for k in range(4):
        write_jsonl(tmp_path / "src" / f"{k}.jsonl", docs[k * 60 : (k + 1) * 60])
    config = dict(
        CUT, source=str(tmp_path / "src"), validation={"sample_rows": 50, "max_duplicate_ratio": 0.3}
    )
    local = prepare(PrepareConfig(**config), tmp_path / "local")
    same_preparation(local, prepare(PrepareConfig(**config, engine="ray"), tmp_path / "ray"))


@pytest.mark.slow
def test_a_bad_record_in_a_later_part_stops_ray_with_its_line_in_the_file(tmp_path, monkeypatch, local_ray):
    monkeypatch.setattr(stream_module, "PART_BYTES", 2000)
    path = write_jsonl(tmp_path / "c.jsonl", corpus_with_duplicates(200))
    lines = path.read_text().splitlines(keepends=True)
    lines[150] = '{"text": 5}\n'
    path.write_text("".join(lines))
    with pytest.raises(DataError) as local:
        prepare(PrepareConfig(**CUT, source=str(path)), tmp_path / "local")
    with pytest.raises(DataError) as on_ray:
        prepare(PrepareConfig(**CUT, source=str(path), engine="ray"), tmp_path / "ray")
    assert "line 151:" in str(local.value) and str(on_ray.value) == str(local.value)
    assert not (tmp_path / "ray").exists() and not list(tmp_path.glob(".ray.partial-*"))


def _finish_after(marker: str, seconds: float) -> str:
    time.sleep(seconds)
    Path(marker).write_text("done")
    return marker


@pytest.mark.slow
def test_tasks_in_flight_when_the_driver_stops_early_finish_and_none_is_cancelled(
    tmp_path, monkeypatch, local_ray
):
    """`_in_order` stopped after its first result (a bad record, ``max_documents``): the tasks still in flight
    are waited for, never `ray.cancel`led (in Ray 2.60 a cancel racing a task's completion aborts the driver)."""
    monkeypatch.setattr(
        local_ray, "cancel", lambda *a, **k: pytest.fail("ray.cancel can abort the driver (Ray 2.60)")
    )
    task = local_ray.remote(num_cpus=1)(_finish_after)
    markers = [tmp_path / f"part-{i}" for i in range(4)]  # all in flight: two per CPU of the 2-CPU cluster
    calls = ((i, lambda m=m, i=i: task.remote(str(m), 0.5 * i)) for i, m in enumerate(markers))
    results = prepare_module._in_order(local_ray, calls)
    assert next(results) == (0, str(markers[0]))
    results.close()  # the caller stops here; parts 1-3 are still running
    assert [m.is_file() for m in markers] == [True] * 4


def test_an_unknown_engine_is_refused_by_name():
    with pytest.raises(ValueError, match=r"PrepareConfig.engine='spark': choose one of \('local', 'ray'\)"):
        PrepareConfig(engine="spark")


def crowded_corpus(seed: int = 0) -> list[str]:
    """Originals, then mostly near-duplicates of them (removed, but a part cannot know that and keeps them in
    its own sample) among a few new documents: the new documents the global sample takes are often crowded
    out of their part's sample, and the driver reads them again."""
    rng = random.Random(seed)
    originals = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(30, 50))) for _ in range(20)]
    later = []
    for i in range(160):
        if i % 25 == 0:
            later.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(30, 50))))
        else:
            words = rng.choice(originals).split()
            words[rng.randrange(len(words))] = "changed"
            later.append(" ".join(words))
    return originals + later


@pytest.mark.slow
def test_sample_documents_crowded_out_of_their_part_are_read_again(tmp_path, monkeypatch, local_ray):
    monkeypatch.setattr(stream_module, "PART_BYTES", 8000)
    reread = []
    read_documents = prepare_module._read_documents
    monkeypatch.setattr(
        prepare_module, "_read_documents", lambda *a: reread.append(list(a[-1])) or read_documents(*a)
    )
    source = write_jsonl(tmp_path / "c.jsonl", crowded_corpus())
    config = dict(CUT, source=str(source), tokenizer_sample_bytes=1000)  # a sample of a few documents
    local = prepare(PrepareConfig(**config), tmp_path / "local")
    assert not reread  # one process reads every document: nothing to read again
    same_preparation(local, prepare(PrepareConfig(**config, engine="ray"), tmp_path / "ray"))
    assert reread and all(i >= 20 for i in reread[0])  # new documents after the originals' part


@pytest.mark.slow
def test_a_ray_preparation_stopped_by_a_full_disk_continues_to_the_same_shards(
    tmp_path, monkeypatch, local_ray
):
    monkeypatch.setattr(stream_module, "PART_BYTES", 3000)
    source = write_jsonl(tmp_path / "c.jsonl", corpus_with_duplicates(300, seed=2))
    config = PrepareConfig(**dict(CUT, source=str(source), blocks_per_shard=4), engine="ray")
    disk_freed = fill_disk_after(monkeypatch, saves=30)
    with pytest.raises(DiskFullError, match="same command continues"):
        prepare(config, tmp_path / "ray")
    disk_freed()
    (work,) = tmp_path.glob(".ray.partial-*")
    done = json.loads((work / "progress.json").read_text())["documents_done"]
    local = prepare(dataclasses_replace(config, engine="local"), tmp_path / "l")
    assert 0 < done < read_manifest(local)["counts"]["documents_loaded"]  # stopped part way through pass 2
    same_preparation(local, prepare(config, tmp_path / "ray"))


@pytest.mark.slow
def test_a_source_that_changes_between_the_scan_and_pass_2_is_refused_on_ray(
    tmp_path, monkeypatch, local_ray
):
    monkeypatch.setattr(stream_module, "PART_BYTES", 3000)
    monkeypatch.setattr(prepare_module, "source_fingerprint", lambda *a: "unchanged")  # as if not noticed
    docs = corpus_with_duplicates(300, seed=3)
    source = write_jsonl(tmp_path / "c.jsonl", docs)
    config = PrepareConfig(**dict(CUT, source=str(source)), engine="ray")
    monkeypatch.setattr(prepare_module, "_tokenize_and_pack", lambda *a: (_ for _ in ()).throw(DiskFullError))
    with pytest.raises(DiskFullError):  # stopped after the scan, its checkpoint kept
        prepare(config, tmp_path / "ray")
    monkeypatch.undo()
    monkeypatch.setattr(stream_module, "PART_BYTES", 3000)
    monkeypatch.setattr(prepare_module, "source_fingerprint", lambda *a: "unchanged")
    write_jsonl(source, docs[:-40])  # the last parts lost documents
    with pytest.raises(DataError, match="changed while it was being prepared") as err:
        prepare(config, tmp_path / "ray")
    assert str(err.value).startswith(f"{source} (1 file(s)): changed") and "Traceback" not in str(err.value)


@pytest.mark.slow
def test_instruction_data_on_ray_gives_the_local_shards(tmp_path, monkeypatch, local_ray):
    monkeypatch.setattr(stream_module, "PART_BYTES", 2000)  # the records validated come from the parts
    rng = random.Random(4)
    rows = [
        {"instruction": " ".join(rng.choice(WORDS) for _ in range(8)), "output": f"answer {i} " * 4}
        for i in range(80)
    ]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = dict(source=str(tmp_path / "sft.jsonl"), kind="instruction", vocab_size=300, seq_len=32)
    local = prepare(PrepareConfig(**config), tmp_path / "local")
    assert read_manifest(local)["validation"]["rows_checked"] == 80
    same_preparation(local, prepare(PrepareConfig(**config, engine="ray"), tmp_path / "ray"))
