"""Partitions of a source (`partition_source`): parts read on their own, one after another, give exactly the
stream `iter_documents` gives the whole source, for every format, with records straddling the cut points,
empty documents and runs of blank lines at the cuts; a malformed record in a later part is named by its line
in the file, not in the part."""

from __future__ import annotations

import json
import random

import pandas as pd
import pytest

from moe_core.data.errors import DataError
from moe_core.data.sources import parse_source
from moe_core.data.stream import Partition, iter_documents, partition_source

WORDS = "the of and to in a is that for it as was with be by on not alpha beta gamma delta".split()


def read_in_parts(spec, parts, **kw):
    """Each part on its own (its line numbers counted from the file's start), concatenated in order."""
    return [doc for part in parts for doc in iter_documents(spec, part=part, **kw)]


def sentence(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def jsonl_corpus(path, n=300, seed=0):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            if i % 37 == 5:
                f.write("\n")  # a blank line between records
            text = "" if i % 29 == 3 else sentence(rng, rng.randint(1, 40))  # empty documents too
            f.write(json.dumps({"text": text, "id": i}) + ("\r\n" if i % 11 == 0 else "\n"))
    return path


def text_corpus(path, n=300, seed=0):
    rng = random.Random(seed)
    pieces = []
    for _ in range(n):
        pieces.append(sentence(rng, rng.randint(0, 30)) + "\n" * rng.choice([1, 2, 2, 3, 4, 5]))
    path.write_text("".join(pieces))
    return path


def assert_parts_equal_the_stream(spec, part_bytes, min_parts, **kw):
    parts = partition_source(spec, txt_sample_by=kw.get("txt_sample_by", "paragraph"), part_bytes=part_bytes)
    assert len(parts) >= min_parts
    whole = list(iter_documents(spec, **kw))
    assert read_in_parts(spec, parts, **kw) == whole
    return parts, whole


@pytest.mark.parametrize("part_bytes", [200, 997, 4000])
def test_a_jsonl_file_cut_into_byte_ranges_reads_as_the_whole_file(tmp_path, part_bytes):
    spec = parse_source(str(jsonl_corpus(tmp_path / "c.jsonl")))
    parts, whole = assert_parts_equal_the_stream(spec, part_bytes, 3)
    assert all(p.path == spec.files[0] for p in parts) and parts[0].start == 0 and parts[-1].stop is None
    assert [p.stop for p in parts[:-1]] == [p.start for p in parts[1:]]  # adjacent, nothing skipped
    assert any(not d.text for d in whole)


@pytest.mark.parametrize("sample_by", ["paragraph", "line"])
@pytest.mark.parametrize("part_bytes", [50, 333, 2000])
def test_a_text_file_cut_at_paragraph_or_line_breaks_reads_as_the_whole_file(tmp_path, sample_by, part_bytes):
    spec = parse_source(str(text_corpus(tmp_path / "c.txt")))
    _, whole = assert_parts_equal_the_stream(spec, part_bytes, 3, txt_sample_by=sample_by)
    assert any(not d.text.strip() for d in whole)  # runs of blank lines around the cuts give empty pieces


def test_many_files_are_one_part_each_or_more(tmp_path):
    for k in range(3):
        jsonl_corpus(tmp_path / f"{k}.jsonl", n=40 + 30 * k, seed=k)
    spec = parse_source(str(tmp_path / "*.jsonl"))
    parts, _ = assert_parts_equal_the_stream(spec, 10**9, 3)
    assert parts == [Partition(f, 0, None) for f in spec.files]
    assert_parts_equal_the_stream(spec, 500, 6)


def test_parquet_is_cut_between_row_groups(tmp_path):
    rng = random.Random(1)
    rows = [{"text": sentence(rng, rng.randint(0, 20)), "domain": f"d{i % 3}"} for i in range(100)]
    pd.DataFrame(rows).to_parquet(tmp_path / "a.parquet", row_group_size=7)
    spec = parse_source(str(tmp_path / "a.parquet"))
    parts, _ = assert_parts_equal_the_stream(spec, 1, 10, domain_column="domain")
    assert parts[1] == Partition(spec.files[0], 1, 2)


def test_sources_that_cannot_be_cut_are_one_part(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([{"text": f"doc {i} " * 50} for i in range(50)]))
    (tmp_path / "b.csv").write_text("text\n" + "".join(f"row {i} " * 20 + "\n" for i in range(50)))
    (tmp_path / "c.txt").write_text("one document\n\n" * 200)
    assert partition_source(parse_source("builtin"), part_bytes=10) == [Partition()]
    for name, sample_by in (("a.json", "paragraph"), ("b.csv", "paragraph"), ("c.txt", "document")):
        spec = parse_source(str(tmp_path / name))
        assert_parts_equal_the_stream(spec, 10, 1, txt_sample_by=sample_by)
        assert len(partition_source(spec, txt_sample_by=sample_by, part_bytes=10)) == 1
    docs = read_in_parts(parse_source("builtin"), [Partition()], max_documents=5)
    assert docs == list(iter_documents(parse_source("builtin"), max_documents=5))


def test_a_malformed_record_in_a_later_part_is_named_by_its_line_in_the_file(tmp_path):
    path = jsonl_corpus(tmp_path / "c.jsonl", n=300)
    lines = path.read_text().splitlines(keepends=True)
    lines[250] = '{"text": "cut short\n'
    path.write_text("".join(lines))
    spec = parse_source(str(path))
    with pytest.raises(DataError) as whole:
        list(iter_documents(spec))
    assert "line 251:" in str(whole.value)
    parts = partition_source(spec, part_bytes=500)
    bad = next(
        i for i, p in enumerate(parts) if p.start > 0 and (p.stop or 10**9) > len("".join(lines[:250]))
    )
    assert bad > 2
    for part in parts[:bad]:
        list(iter_documents(spec, part=part))
    with pytest.raises(DataError) as in_part:
        list(iter_documents(spec, part=parts[bad]))
    assert str(in_part.value) == str(whole.value)
