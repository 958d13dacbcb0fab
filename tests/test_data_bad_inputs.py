"""Bad input: each case is a DataError naming the file and the problem, a non-zero CLI exit, no output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_core.data.errors import DataError
from moe_core.data.prepare import PrepareConfig, prepare
from moe_core.data.sources import DEFAULT_MAX_LINE_BYTES, load_source


def _empty(d: Path) -> Path:
    (d / "empty.txt").write_bytes(b"")
    return d / "empty.txt"


def _blank(d: Path) -> Path:
    (d / "blank.txt").write_text("\n\n   \n")
    return d / "blank.txt"


def _binary(d: Path) -> Path:
    (d / "image.txt").write_bytes(bytes(range(256)) * 4)
    return d / "image.txt"


def _invalid_utf8(d: Path) -> Path:
    (d / "latin1.txt").write_bytes("first line ok\nna\u00efve caf\u00e9\n".encode("latin-1"))  # 0xEF at 16
    return d / "latin1.txt"


def _missing_column(d: Path) -> Path:
    (d / "docs.jsonl").write_text(json.dumps({"content": "the text is under another name"}) + "\n")
    return d / "docs.jsonl"


def _broken_json(d: Path) -> Path:
    (d / "broken.jsonl").write_text('{"text": "fine"}\n{"text": "unterminated\n')
    return d / "broken.jsonl"


def _enormous_line(d: Path) -> Path:
    (d / "huge.txt").write_bytes(b"short line\n" + b"x" * (DEFAULT_MAX_LINE_BYTES + 10) + b"\n")
    return d / "huge.txt"


def _no_matching_files(d: Path) -> Path:
    (d / "corpus").mkdir()
    (d / "corpus" / "notes.docx").write_bytes(b"PK\x03\x04")
    return d / "corpus"


def _unknown_format(d: Path) -> Path:
    (d / "table.xlsx").write_bytes(b"PK\x03\x04 not really")
    return d / "table.xlsx"


def _fake_parquet(d: Path) -> Path:
    (d / "data.parquet").write_text("this is not parquet")
    return d / "data.parquet"


CASES = {
    "empty file": (_empty, "empty file"),
    "whitespace-only file": (_blank, "empty file"),
    "binary file": (_binary, "binary file"),
    "invalid UTF-8": (_invalid_utf8, "invalid UTF-8 at byte offset 16 (line 2)"),
    "missing column": (_missing_column, "missing column"),
    "broken JSON": (_broken_json, "could not parse as json"),
    "one enormous line": (_enormous_line, "line 2 is over"),
    "directory with no matching files": (_no_matching_files, "no files of a supported format"),
    "unknown format": (_unknown_format, "unknown format '.xlsx'"),
    "not really parquet": (_fake_parquet, "not a parquet file"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_a_clear_error(tmp_path, case):
    make, problem = CASES[case]
    path = make(tmp_path)
    with pytest.raises(DataError) as err:
        load_source(str(path))
    msg = str(err.value)
    assert problem in msg
    assert str(path) in msg  # names the file (or directory)


@pytest.mark.parametrize("case", ["binary file", "broken JSON", "unknown format", "missing column"])
def test_bad_input_cli_exits_non_zero_and_writes_nothing(tmp_path, case, capsys):
    from moe_core.cli import main

    make, problem = CASES[case]
    path = make(tmp_path)
    out = tmp_path / "out" / "prepared"
    assert main(["data", "prepare", str(path), "--out", str(out), "--vocab-size", "300"]) == 2
    err = capsys.readouterr().err
    assert problem in err and str(path) in err
    assert not out.exists() and not list((tmp_path / "out").glob(".*"))  # no partial output
    assert main(["data", "validate", str(path)]) != 0


def test_glob_without_matches(tmp_path):
    with pytest.raises(DataError, match="matches no files"):
        load_source(str(tmp_path / "*.jsonl"))


def test_failed_validation_stops_prepare_before_any_output(tmp_path):
    path = tmp_path / "dups.jsonl"
    path.write_text("\n".join(json.dumps({"text": "the same line"}) for _ in range(10)) + "\n")
    out = tmp_path / "prepared"
    from moe_core.data.errors import DataValidationError

    with pytest.raises(DataValidationError, match="exact-duplicate") as err:
        prepare(PrepareConfig(source=str(path), vocab_size=300), out)
    assert "the same line" not in str(err.value)
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["dups.jsonl"]


def test_bad_config_values_are_named():
    with pytest.raises(ValueError, match="seq_len"):
        PrepareConfig(seq_len=0)
    with pytest.raises(ValueError, match="kind"):
        PrepareConfig(kind="preference")
    with pytest.raises(ValueError, match="val_fraction"):
        PrepareConfig(val_fraction=1.5)
