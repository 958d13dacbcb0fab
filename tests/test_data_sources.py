"""Sources: the built-in stdlib corpus, local files of every format through `datasets`, hub ids offline."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from moe_core.data.errors import DataError
from moe_core.data.sources import (
    builtin_corpus,
    load_source,
    parse_source,
    split_python_source,
    to_messages,
)

ROWS = [{"body": f"document number {i} about topic {i % 3}", "topic": f"t{i % 3}"} for i in range(6)]


def test_builtin_corpus_is_deterministic_and_labelled():
    first, second = builtin_corpus(12), builtin_corpus(12)
    assert [d.source for d in first] == [d.source for d in second]
    assert [d.text for d in first] == [d.text for d in second]
    assert len(first) == 12
    assert {d.domain for d in first} == {"code", "prose"}
    assert all(d.source.startswith("stdlib:") and d.text.strip() for d in first)
    code = next(d for d in first if d.domain == "code")
    assert "def " in code.text or "import " in code.text or "=" in code.text


def test_split_python_source_separates_docstrings_and_comments_from_code():
    src = '''"""Module doc."""
import os  # why we need os


def f(x):
    """Return x doubled."""
    # a full-line comment
    return 2 * x
'''
    code, prose = split_python_source(src)
    assert "Module doc." in prose and "Return x doubled." in prose
    assert "a full-line comment" in prose and "why we need os" in prose
    assert "Module doc" not in code and "#" not in code and "doubled" not in code
    assert "import os" in code and "return 2 * x" in code and "def f(x):" in code
    compile(code, "<code>", "exec")  # what is left is still Python


@pytest.mark.parametrize("suffix", ["jsonl", "json", "csv", "parquet"])
def test_local_formats_with_text_column(tmp_path, suffix):
    path = tmp_path / f"data.{suffix}"
    frame = pd.DataFrame(ROWS)
    if suffix == "jsonl":
        path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    elif suffix == "json":
        path.write_text(json.dumps(ROWS))
    elif suffix == "csv":
        frame.to_csv(path, index=False)
    else:
        frame.to_parquet(path)
    ds = load_source(str(path), text_column="body", domain_column="topic").dataset
    assert ds.column_names == ["text", "domain", "source"]
    assert ds["text"] == [r["body"] for r in ROWS]
    assert ds["domain"] == [r["topic"] for r in ROWS]
    assert set(ds["source"]) == {str(path)}


def test_txt_paragraphs_directory_and_glob(tmp_path):
    (tmp_path / "a.txt").write_text("first paragraph\nsame paragraph\n\nsecond paragraph\n")
    (tmp_path / "b.txt").write_text("third paragraph\n")
    (tmp_path / "notes.csv.bak").write_text("ignored: unsupported suffix in a directory")
    ds = load_source(str(tmp_path)).dataset
    assert ds["text"] == ["first paragraph\nsame paragraph", "second paragraph\n", "third paragraph\n"]
    assert ds["source"] == [str(tmp_path / "a.txt")] * 2 + [str(tmp_path / "b.txt")]
    assert len(load_source(str(tmp_path / "b*.txt")).dataset) == 1
    lines = load_source(str(tmp_path / "a.txt"), txt_sample_by="line").dataset
    assert len(lines) == 4  # line mode keeps the blank line as a row
    assert len(load_source(str(tmp_path), max_documents=2).dataset) == 2


def test_instruction_and_preference_sources(tmp_path):
    alpaca = tmp_path / "alpaca.jsonl"
    alpaca.write_text(json.dumps({"instruction": "Add", "input": "2 and 3", "output": "5"}) + "\n")
    chat = tmp_path / "chat.jsonl"
    chat.write_text(
        json.dumps(
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
        )
        + "\n"
    )
    pref = tmp_path / "pref.jsonl"
    pref.write_text(json.dumps({"prompt": "p", "chosen": "good", "rejected": "bad"}) + "\n")
    rec = load_source(str(alpaca), kind="instruction").dataset[0]
    assert to_messages(rec) == [
        {"role": "user", "content": "Add\n\n2 and 3"},
        {"role": "assistant", "content": "5"},
    ]
    rec = load_source(str(chat), kind="instruction").dataset[0]
    assert [m["role"] for m in to_messages(rec)] == ["user", "assistant"]
    assert load_source(str(pref), kind="preference").dataset[0]["chosen"] == "good"
    with pytest.raises(DataError, match="prompt"):
        load_source(str(alpaca), kind="preference")


def test_source_strings_resolve():
    assert parse_source("builtin").type == "builtin"
    assert parse_source("hf:Salesforce/wikitext").location == "Salesforce/wikitext"
    assert parse_source("Salesforce/wikitext").type == "hub"  # no such local path: a hub id
    with pytest.raises(DataError, match="no such file"):
        parse_source("missing/file.jsonl")


def test_hub_id_unreachable_gives_clear_error(monkeypatch):
    import datasets
    import huggingface_hub

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError) as err:
        load_source("hf:moe-lab-test/does-not-exist", hub_config="x", split="train")
    msg = str(err.value)
    assert "moe-lab-test/does-not-exist" in msg and "builtin" in msg


def test_a_reader_killed_while_loading_leaves_no_copy_of_the_corpus(tmp_path, monkeypatch):
    """Local files are read through a scratch `datasets` cache (an Arrow copy of the text); a process killed
    while reading left it under the lab's data directory forever. The next read removes it."""
    import os
    import signal
    import subprocess
    import sys

    from moe_core.data.sources import load_source

    monkeypatch.setenv("MOE_LAB_DATA_CACHE", str(tmp_path / "cache"))
    scratch_root = tmp_path / "cache" / "hf-datasets"
    reader = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\n"
            "from moe_core.data.sources import _scratch_datasets_cache\n"
            "with _scratch_datasets_cache() as scratch:\n"
            "    open(scratch + '/copy.arrow', 'w').write('private text')\n"
            "    print(scratch, flush=True)\n"
            "    time.sleep(60)\n",
        ],
        env={**os.environ, "MOE_LAB_DATA_CACHE": str(tmp_path / "cache")},
        stdout=subprocess.PIPE,
        text=True,
    )
    left = reader.stdout.readline().strip()
    reader.send_signal(signal.SIGKILL)
    reader.wait()
    assert left and os.path.isfile(os.path.join(left, "copy.arrow"))  # what a kill leaves

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"text": "one document"}) + "\n")
    assert len(load_source(str(corpus)).dataset) == 1
    assert not os.path.exists(left)
    assert list(scratch_root.iterdir()) == []
