"""great-expectations suites: pass/fail per expectation, offending rows by index and hash (never text)."""

from __future__ import annotations

import json

import pytest

from moe_core.data.errors import DataValidationError
from moe_core.data.validation import SUITES, ValidationConfig, row_hash, validate

SECRET = "zebra-quokka-7731"  # a marker that must never appear in a report


def outcome(result, expectation_prefix: str, column: str | None = None):
    matches = [
        o
        for o in result.outcomes
        if o.check.startswith(expectation_prefix) and (column is None or o.column == column)
    ]
    assert len(matches) == 1, [o.check for o in result.outcomes]
    return matches[0]


def test_clean_text_passes():
    result = validate([{"text": f"{SECRET} row {i}"} for i in range(10)])
    assert result.success and not result.failed
    assert result.suite == SUITES["text"] and result.rows_checked == 10
    assert "PASSED" in result.to_markdown()
    result.raise_for_failure()  # no error


def test_text_suite_finds_each_problem_by_row():
    rows = [
        {"text": f"{SECRET} fine"},  # 0
        {"text": None},  # 1 null
        {"text": "   "},  # 2 empty
        {"text": f"{SECRET} bell\x07"},  # 3 control character
        {"text": f"{SECRET} lost \ufffd byte"},  # 4 invalid UTF-8 replaced upstream
        {"text": f"{SECRET} fine"},  # 5 duplicate of 0
        {"text": "x" * 50},  # 6 too long
    ]
    cfg = ValidationConfig(max_duplicate_ratio=0.0, max_chars=40, min_rows=100, min_tokens=1000)
    result = validate(rows, config=cfg, source="unit")
    assert not result.success
    assert outcome(result, "text present").row_indices == [1]
    assert outcome(result, "text not empty").row_indices == [2]
    assert outcome(result, "no control").row_indices == [3]
    assert outcome(result, "no invalid UTF-8").row_indices == [4]
    assert outcome(result, "text length").row_indices == [6]
    dup = outcome(result, "exact-duplicate")
    assert not dup.success and dup.row_indices == [5] and dup.row_hashes == [row_hash(rows[5]["text"])]
    assert not outcome(result, "at least 100 rows").success
    assert not outcome(result, "at least 1000 whitespace").success
    report = result.to_markdown() + json.dumps(result.to_dict())
    assert SECRET not in report and "bell" not in report  # hashes and indices only
    with pytest.raises(DataValidationError) as err:
        result.raise_for_failure()
    assert "no control characters" in str(err.value) and "exact-duplicate" in str(err.value)
    assert SECRET not in str(err.value)
    assert err.value.result is result


def test_sample_is_deterministic_and_reports_original_indices():
    rows = [{"text": f"row {i}"} for i in range(200)]
    rows[137] = {"text": "bad\x00row"}
    cfg = ValidationConfig(sample_rows=150, seed=3)
    a, b = validate(rows, config=cfg), validate(rows, config=cfg)
    assert a.rows_checked == 150 and a.rows_total == 200
    assert a.to_dict() == b.to_dict()
    control = outcome(a, "no control")
    assert control.row_indices in ([], [137])  # indices refer to the full data, not the sample
    full = validate(rows, config=ValidationConfig(min_rows=180))
    assert outcome(full, "no control").row_indices == [137]
    # on a sample the row minimum is scaled by the sampled fraction, so it still speaks about the whole data
    assert outcome(
        validate(rows, config=ValidationConfig(sample_rows=20, min_rows=180)), "at least 180 rows"
    ).success
    assert not outcome(
        validate(rows[:100], config=ValidationConfig(sample_rows=20, min_rows=180)), "at least 180 rows"
    ).success


def test_instruction_suites():
    alpaca = [
        {"instruction": "Add", "input": "", "output": "5"},
        {"instruction": "", "input": "", "output": "x"},
        {"instruction": "Sub", "input": "", "output": None},
    ]
    result = validate(alpaca, "instruction")
    assert outcome(result, "instruction not empty").row_indices == [1]
    assert outcome(result, "output present").row_indices == [2]
    chat = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "zap"}]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}]},
        {"messages": []},
    ]
    result = validate(chat, "instruction")
    assert outcome(result, "roles in").row_indices == [1, 3]
    assert outcome(result, "every turn has content").row_indices == [2, 3]
    assert outcome(result, "at least one turn").row_indices == [3]
    assert outcome(result, "has an assistant turn").row_indices == [1, 3]
    assert validate(chat[:1], "instruction").success


def test_preference_suite_chosen_differs_from_rejected():
    rows = [
        {"prompt": "p", "chosen": "a", "rejected": "b"},
        {"prompt": "q", "chosen": "same", "rejected": "same"},
    ]
    result = validate(rows, "preference")
    assert not result.success
    assert outcome(result, "chosen differs").row_indices == [1]
    assert validate(rows[:1], "preference").success


def test_cli_validate_exit_codes(tmp_path, capsys):
    from moe_core.cli import main

    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(json.dumps({"text": f"{SECRET} {i}"}) for i in range(5)) + "\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(json.dumps({"text": t}) for t in ["ok", "ok", "ok", "tab\x0b"]) + "\n")
    report = tmp_path / "report.md"
    assert main(["data", "validate", str(good), "--report", str(report)]) == 0
    assert "PASSED" in capsys.readouterr().out and "PASSED" in report.read_text()
    assert main(["data", "validate", str(bad)]) != 0
    out = capsys.readouterr().out
    assert "FAILED" in out and "no control characters" in out and SECRET not in out
    pref = tmp_path / "pref.jsonl"
    pref.write_text(json.dumps({"prompt": "p", "chosen": "a", "rejected": "a"}) + "\n")
    assert main(["data", "validate", str(pref), "--kind", "preference"]) != 0
