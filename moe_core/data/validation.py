"""Data validation with great-expectations (GX Core 1.x, ephemeral context, nothing written to disk).

One named expectation suite per data kind (`SUITES`), run on a pandas frame built from the records:

    text         moe_lab.text         not null, not empty, length bounds, no invalid UTF-8 (U+FFFD or lone
                                      surrogates), no control characters, exact-duplicate ratio (hash column),
                                      minimum rows and whitespace tokens
    instruction  moe_lab.instruction  alpaca: instruction/output present and non-empty; chat: at least one
                                      turn, valid roles, non-empty contents, an assistant turn
    preference   moe_lab.preference   prompt/chosen/rejected present and non-empty, chosen differs from rejected

The frame holds derived columns (hashes, lengths, roles) beside the text so GX sees everything it checks,
but the `ValidationResult` keeps only counts, row indices and row hashes (first 16 hex chars of the
sha256 of the row): never the text. ``result.to_markdown()`` is the human-readable report.

On a deterministic sample (``ValidationConfig.sample_rows``) the row and token minimums are scaled by the
sampled fraction, so they still speak about the whole data.
"""

from __future__ import annotations

# Lazy: pandas and great_expectations (heavy, seconds) load inside the functions that validate; the
# flows and `moe-lab run --help-config` import this module for `ValidationConfig`.
import hashlib
import math
import numbers
import re
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from moe_core.data.errors import DataError, DataValidationError
from moe_core.data.sources import (
    DEFAULT_MAX_LINE_BYTES,
    canonical_json,
    parse_source,
    refuse_kind_the_source_lacks,
)
from moe_core.data.stream import BottomK, iter_records, missing_columns
from moe_core.progress import Progress

SUITES = {"text": "moe_lab.text", "instruction": "moe_lab.instruction", "preference": "moe_lab.preference"}
CONTROL_CHARS = r"[\x00-\x08\x0B\x0C\x0E-\x1F\x7F]"  # tab, newline and carriage return are allowed
INVALID_UTF8 = r"[\uFFFD\uD800-\uDFFF]"  # replacement character (bytes lost in decoding) or lone surrogates
CHAT_ROLES = ("system", "user", "assistant", "tool")
DEFAULT_MAX_ROWS = (
    100_000  # `validate_source` checks a deterministic sample of this many rows of a larger source
)


@dataclass
class ValidationConfig:
    """Bounds of the suites. `sample_rows=None` validates every row; a number validates that many rows
    chosen deterministically from `seed`."""

    min_rows: int = 1
    min_tokens: int = 1  # whitespace-separated tokens over all rows (text kind)
    min_chars: int = 1
    max_chars: int = 1_000_000
    max_duplicate_ratio: float = 0.1
    roles: tuple[str, ...] = CHAT_ROLES
    sample_rows: int | None = None
    seed: int = 0
    max_listed_rows: int = 20  # offending rows listed per expectation in the report

    def __post_init__(self) -> None:
        def bad(name: str, msg: str) -> ValueError:
            return ValueError(f"ValidationConfig.{name}={getattr(self, name)!r}: {msg}")

        for name in ("min_rows", "min_tokens", "min_chars", "max_listed_rows"):
            if getattr(self, name) < 0:
                raise bad(name, "must be >= 0")
        if self.max_chars < max(self.min_chars, 1):
            raise bad("max_chars", f"must be >= min_chars={self.min_chars} and >= 1")
        if not 0.0 <= self.max_duplicate_ratio <= 1.0:
            raise bad("max_duplicate_ratio", "must be between 0 and 1")
        if self.sample_rows is not None and self.sample_rows <= 0:
            raise bad("sample_rows", "must be positive, or None for the whole data")
        self.roles = tuple(self.roles)


@dataclass
class ExpectationOutcome:
    """How one expectation went. `row_indices` are positions in the validated records (all of them when
    the expectation failed row-wise); `row_hashes` name those rows without their content."""

    check: str
    expectation: str
    column: str | None
    success: bool
    unexpected_count: int | None = None
    observed_value: float | int | None = None
    row_indices: list[int] = field(default_factory=list)
    row_hashes: list[str] = field(default_factory=list)
    error: str | None = None


@dataclass
class ValidationResult:
    suite: str
    kind: str
    source: str
    success: bool
    rows_total: int
    rows_checked: int
    outcomes: list[ExpectationOutcome]
    max_listed_rows: int = 20

    @property
    def failed(self) -> list[ExpectationOutcome]:
        return [o for o in self.outcomes if not o.success]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        parts = []
        for o in self.failed:
            detail = (
                f"{o.unexpected_count} row(s)"
                if o.unexpected_count
                else f"observed {o.observed_value}"
                if o.observed_value is not None
                else o.error or "failed"
            )
            parts.append(f"{o.check} [{o.expectation}]: {detail}")
        return "; ".join(parts)

    def to_markdown(self) -> str:
        status = "PASSED" if self.success else "FAILED"
        scope = "whole data" if self.rows_checked == self.rows_total else "deterministic sample"
        lines = [
            f"## Data validation: `{self.suite}` {status}",
            "",
            f"source: `{self.source}` · kind: {self.kind} · rows checked: {self.rows_checked} of "
            f"{self.rows_total} ({scope}) · expectations: {len(self.outcomes) - len(self.failed)}"
            f"/{len(self.outcomes)} passed",
            "",
            "| check | expectation | result | unexpected rows | observed | offending rows (index:hash) |",
            "|---|---|---|---|---|---|",
        ]
        for o in self.outcomes:
            rows = ", ".join(
                f"{i}:{h}"
                for i, h in zip(o.row_indices[: self.max_listed_rows], o.row_hashes[: self.max_listed_rows])
            )
            if len(o.row_indices) > self.max_listed_rows:
                rows += f", ... ({len(o.row_indices) - self.max_listed_rows} more)"
            observed = "" if o.observed_value is None else f"{o.observed_value:.4g}"
            result = "pass" if o.success else ("ERROR: " + o.error if o.error else "**FAIL**")
            count = "" if o.unexpected_count is None else str(o.unexpected_count)
            lines.append(f"| {o.check} | `{o.expectation}` | {result} | {count} | {observed} | {rows} |")
        return "\n".join(lines) + "\n"

    def raise_for_failure(self) -> None:
        if not self.success:
            raise DataValidationError(
                f"{self.source}: data validation suite {self.suite} failed: {self.summary()}. "
                "Offending rows are listed by index and hash in the report; fix the data or relax "
                "the ValidationConfig bounds.",
                self,
            )


# ---------------------------------------------------------------------------------------------- frames
def row_hash(value: Any) -> str:
    """First 16 hex chars of the sha256 of a row (its text, or the canonical JSON of a record)."""
    text = value if isinstance(value, str) else canonical_json(value)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def _as_str(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, float) and math.isnan(value):
        return None
    return canonical_json(value)


def _columns(records: Any, indices: list[int] | None) -> tuple[dict[str, list[Any]], int]:
    """Columns (name -> values) of the selected rows, from a datasets.Dataset, DataFrame or list of dicts."""
    import pandas as pd

    if isinstance(records, pd.DataFrame):
        frame = records.reset_index(drop=True)
        total = len(frame)
        if indices is not None:
            frame = frame.iloc[indices]
        return {c: frame[c].tolist() for c in frame.columns}, total
    if isinstance(records, list):
        total = len(records)
        rows = records if indices is None else [records[i] for i in indices]
        names = list(dict.fromkeys(k for r in rows for k in r))
        return {c: [r.get(c) for r in rows] for c in names}, total
    total = len(records)  # datasets.Dataset
    selected = records if indices is None else records.select(indices)
    return selected.to_dict(), total


def _text_frame(cols: dict[str, list[Any]], text_column: str) -> Any:
    import pandas as pd

    if text_column not in cols:
        raise DataError(f"text data has no column {text_column!r} (found {sorted(cols)}); pass text_column")
    texts = [_as_str(t) for t in cols[text_column]]
    return pd.DataFrame(
        {
            "text": texts,
            "hash": [row_hash(t) if t is not None else "null" for t in texts],
            "n_words": [len(t.split()) if t else 0 for t in texts],
        }
    )


def _instruction_frame(cols: dict[str, list[Any]]) -> tuple[Any, str]:
    import pandas as pd

    n = len(next(iter(cols.values()), []))
    records = [{k: v[i] for k, v in cols.items() if k != "source"} for i in range(n)]
    hashes = [row_hash(r) for r in records]
    if "messages" in cols:
        roles, n_turns, min_content, has_assistant = [], [], [], []
        for messages in cols["messages"]:
            turns = messages if isinstance(messages, list) else []
            ok = all(isinstance(m, dict) for m in turns)
            roles.append(
                "|".join(str(m.get("role")) for m in turns)
                if ok and turns
                else "<none>"
                if ok
                else "<invalid>"
            )
            n_turns.append(len(turns) if ok else 0)
            min_content.append(
                min((len(str(m.get("content") or "").strip()) for m in turns), default=0) if ok else 0
            )
            has_assistant.append(ok and any(m.get("role") == "assistant" for m in turns))
        frame = pd.DataFrame(
            {
                "roles": roles,
                "n_turns": n_turns,
                "min_content_chars": min_content,
                "has_assistant_turn": has_assistant,
                "hash": hashes,
            }
        )
        return frame, "chat"
    if "instruction" not in cols or "output" not in cols:
        raise DataError(
            f"instruction data needs a chat `messages` column or alpaca `instruction` and `output` "
            f"columns; found {sorted(cols)}"
        )
    frame = pd.DataFrame(
        {
            "instruction": [_as_str(v) for v in cols["instruction"]],
            "output": [_as_str(v) for v in cols["output"]],
            "hash": hashes,
        }
    )
    return frame, "alpaca"


def _preference_frame(cols: dict[str, list[Any]]) -> Any:
    import pandas as pd

    missing = [c for c in ("prompt", "chosen", "rejected") if c not in cols]
    if missing:
        raise DataError(f"preference data is missing column(s) {missing}; found {sorted(cols)}")
    frame = pd.DataFrame({c: [_as_str(v) for v in cols[c]] for c in ("prompt", "chosen", "rejected")})
    frame["chosen_equals_rejected"] = frame["chosen"] == frame["rejected"]
    frame["hash"] = [
        row_hash([p, c, r]) for p, c, r in zip(frame["prompt"], frame["chosen"], frame["rejected"])
    ]
    return frame


# ---------------------------------------------------------------------------------------------- suites
def _checks(kind: str, variant: str, cfg: ValidationConfig, scale: float) -> list[tuple[str, Any]]:
    """(label, GX expectation) pairs of a suite; `scale` (sampled fraction) scales the table minimums."""
    import great_expectations as gx

    E = gx.expectations
    min_rows = math.ceil(cfg.min_rows * scale)
    dup = [
        (
            f"exact-duplicate ratio <= {cfg.max_duplicate_ratio:g}",
            E.ExpectColumnProportionOfUniqueValuesToBeBetween(
                column="hash", min_value=1.0 - cfg.max_duplicate_ratio
            ),
        )
    ]
    rows = [(f"at least {cfg.min_rows} rows", E.ExpectTableRowCountToBeBetween(min_value=min_rows))]

    def present(col: str) -> list[tuple[str, Any]]:
        return [
            (f"{col} present (not null)", E.ExpectColumnValuesToNotBeNull(column=col)),
            (f"{col} not empty", E.ExpectColumnValuesToMatchRegex(column=col, regex=r"\S")),
        ]

    if kind == "text":
        return [
            *present("text"),
            (
                f"text length {cfg.min_chars}..{cfg.max_chars} chars",
                E.ExpectColumnValueLengthsToBeBetween(
                    column="text", min_value=cfg.min_chars, max_value=cfg.max_chars
                ),
            ),
            (
                "no invalid UTF-8 (U+FFFD, lone surrogates)",
                E.ExpectColumnValuesToNotMatchRegex(column="text", regex=INVALID_UTF8),
            ),
            (
                "no control characters",
                E.ExpectColumnValuesToNotMatchRegex(column="text", regex=CONTROL_CHARS),
            ),
            *dup,
            *rows,
            (
                f"at least {cfg.min_tokens} whitespace tokens",
                E.ExpectColumnSumToBeBetween(column="n_words", min_value=math.ceil(cfg.min_tokens * scale)),
            ),
        ]
    if kind == "instruction" and variant == "chat":
        role_re = "|".join(re.escape(r) for r in cfg.roles)
        return [
            ("at least one turn", E.ExpectColumnValuesToBeBetween(column="n_turns", min_value=1)),
            (
                f"roles in {{{', '.join(cfg.roles)}}}",
                E.ExpectColumnValuesToMatchRegex(
                    column="roles", regex=rf"^(?:{role_re})(?:\|(?:{role_re}))*$"
                ),
            ),
            (
                "every turn has content",
                E.ExpectColumnValuesToBeBetween(column="min_content_chars", min_value=1),
            ),
            (
                "has an assistant turn",
                E.ExpectColumnValuesToBeInSet(column="has_assistant_turn", value_set=[True]),
            ),
            *dup,
            *rows,
        ]
    if kind == "instruction":
        return [*present("instruction"), *present("output"), *dup, *rows]
    return [
        *present("prompt"),
        *present("chosen"),
        *present("rejected"),
        (
            "chosen differs from rejected",
            E.ExpectColumnValuesToBeInSet(column="chosen_equals_rejected", value_set=[False]),
        ),
        *dup,
        *rows,
    ]


def _context() -> Any:
    """An ephemeral GX context with analytics and progress bars off."""
    import great_expectations as gx
    from great_expectations.data_context.types.base import (
        DataContextConfig,
        InMemoryStoreBackendDefaults,
        ProgressBarsConfig,
    )

    config = DataContextConfig(
        store_backend_defaults=InMemoryStoreBackendDefaults(),
        analytics_enabled=False,
        progress_bars=ProgressBarsConfig(globally=False),
    )
    return gx.get_context(mode="ephemeral", project_config=config)


def _number(value: Any) -> float | int | None:
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
        return None
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def validate(
    records: Any,
    kind: str = "text",
    config: ValidationConfig | None = None,
    text_column: str = "text",
    source: str = "<records>",
    positions: list[int] | None = None,
    rows_total: int | None = None,
) -> ValidationResult:
    """Run the suite of `kind` on `records` (a `datasets.Dataset`, pandas DataFrame or list of dicts).
    Returns the result whether it passed or not; call ``result.raise_for_failure()`` to stop on failure.

    ``positions`` and ``rows_total``: `records` is already a sample (a stream's, `validate_stream`) of
    ``rows_total`` rows, taken at these positions; they are the row indices reported, and the table minimums
    are scaled by the sampled fraction. ``config.sample_rows`` then does not sample again."""
    if kind not in SUITES:
        raise DataError(f"unknown data kind {kind!r}; choose one of {tuple(SUITES)}")
    if (positions is None) != (rows_total is None) or (
        positions is not None and len(positions) != len(records)
    ):
        raise ValueError("validate: pass positions (one per record) together with rows_total, or neither")
    with Progress(3, "validate data", unit="stage") as bar:  # GX's own bars are off (see _context)
        return _validate(
            records, kind, config or ValidationConfig(), text_column, source, bar, positions, rows_total
        )


def _validate(
    records: Any,
    kind: str,
    cfg: ValidationConfig,
    text_column: str,
    source: str,
    bar,
    positions: list[int] | None = None,
    rows_total: int | None = None,
) -> ValidationResult:
    bar.stage("columns")
    total = len(records)
    indices = None
    if positions is None and cfg.sample_rows is not None and cfg.sample_rows < total:
        rng = np.random.default_rng(cfg.seed)
        indices = np.sort(rng.choice(total, size=cfg.sample_rows, replace=False)).tolist()
    cols, total = _columns(records, indices)
    if positions is not None:
        indices, total = list(positions), int(rows_total)
    variant = kind
    if kind == "text":
        frame = _text_frame(cols, text_column)
    elif kind == "instruction":
        frame, variant = _instruction_frame(cols)
    else:
        frame = _preference_frame(cols)
    frame.index = indices if indices is not None else range(len(frame))  # GX reports these row indices
    scale = len(frame) / total if total else 1.0
    checks = _checks(kind, variant, cfg, scale)

    import great_expectations as gx

    bar.stage(f"{len(checks)} expectations")
    context = _context()
    batch = (
        context.data_sources.add_pandas("records")
        .add_dataframe_asset("rows")
        .add_batch_definition_whole_dataframe("all")
    )
    suite = gx.ExpectationSuite(name=SUITES[kind])
    for i, (label, expectation) in enumerate(checks):
        expectation.meta = {"check": label, "order": i}
        suite.add_expectation(expectation)
    suite = context.suites.add(suite)
    definition = context.validation_definitions.add(
        gx.ValidationDefinition(name=SUITES[kind], data=batch, suite=suite)
    )
    run = definition.run(batch_parameters={"dataframe": frame}, result_format={"result_format": "COMPLETE"})

    bar.stage("report")
    outcomes: list[tuple[int, ExpectationOutcome]] = []
    hashes = frame["hash"]
    duplicated = frame.index[hashes.duplicated(keep="first").to_numpy()].tolist()
    for er in run.results:
        cfg_e = er.expectation_config
        meta = cfg_e.meta or {}
        res = er.result or {}
        rows = [int(i) for i in res.get("unexpected_index_list") or []]
        if cfg_e.type == "expect_column_proportion_of_unique_values_to_be_between" and not er.success:
            rows = duplicated
        error = None
        if er.exception_info and er.exception_info.get("raised_exception"):
            error = str(er.exception_info.get("exception_message", "error")).splitlines()[0][:200]
        outcomes.append(
            (
                int(meta.get("order", len(outcomes))),
                ExpectationOutcome(
                    check=str(meta.get("check", cfg_e.type)),
                    expectation=cfg_e.type,
                    column=cfg_e.kwargs.get("column"),
                    success=bool(er.success),
                    unexpected_count=res.get("unexpected_count")
                    if "unexpected_count" in res
                    else (len(rows) or None),
                    observed_value=_number(res.get("observed_value")),
                    row_indices=rows,
                    row_hashes=[str(hashes.loc[i]) for i in rows],
                    error=error,
                ),
            )
        )
    ordered = [o for _, o in sorted(outcomes, key=lambda p: p[0])]
    bar.advance_to(3)
    return ValidationResult(
        SUITES[kind],
        kind,
        source,
        all(o.success for o in ordered),
        total,
        len(frame),
        ordered,
        cfg.max_listed_rows,
    )


def validate_source(
    source: str,
    kind: str = "text",
    config: ValidationConfig | None = None,
    text_column: str = "text",
    *,
    domain_column: str | None = None,
    hub_config: str | None = None,
    split: str = "train",
    max_documents: int | None = None,
    txt_sample_by: str = "paragraph",
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    max_rows: int = DEFAULT_MAX_ROWS,
) -> ValidationResult:
    """Validate a source read as a stream (`moe_core.data.stream`): every row when it has at most
    ``config.sample_rows`` (else ``max_rows``) rows, otherwise a deterministic sample of that many chosen by
    row hash (`BottomK`), so memory does not grow with the source. Row indices are positions in the stream."""
    cfg = config or ValidationConfig()
    spec = parse_source(source)
    sample = BottomK(max_items=cfg.sample_rows or max_rows)
    total = 0
    refuse_kind_the_source_lacks(spec, kind)
    records = iter_records(
        spec,
        hub_config=hub_config,
        split=split,
        txt_sample_by=txt_sample_by,
        max_line_bytes=max_line_bytes,
        columns=(text_column,) if kind == "text" else None,
    )
    column = "text" if spec.type == "builtin" else text_column
    for n, (record, where) in enumerate(records):
        if max_documents is not None and n >= max_documents:
            break
        if kind != "text":
            row = {k: v for k, v in record.items() if k != "source"}
        elif column in record:
            row = {"text": record[column]}
        else:
            raise missing_columns(
                where, record, [column], "Pass the text column with text_column / --text-column."
            )
        key = row_hash(row["text"] if kind == "text" else row) if row.get("text", "") is not None else "0"
        sample.add(int(key, 16), total, 0, row)
        total += 1
    if total == 0:
        raise DataError(f"{spec.name}: no rows; check the file(s) or split")
    chosen = sample.items()
    return validate(
        [r for _, r in chosen],
        kind,
        cfg,
        text_column="text" if kind == "text" else text_column,
        source=spec.name,
        positions=[i for i, _ in chosen],
        rows_total=total,
    )
