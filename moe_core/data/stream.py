"""Sources read as streams: one record at a time, with where it came from, never the whole corpus in memory.

    for record, where in iter_records(parse_source("corpus/*.jsonl")):
        ...  # record: a dict of the row's columns; where: "corpus/a.jsonl: line 5012"

`iter_records` reads every source `moe_core.data.sources.parse_source` resolves, in a fixed order (files sorted
as the spec lists them, rows in file order):

    .jsonl / .json   JSON lines, parsed line by line (a .json file holding one JSON array is read whole:
                     convert large corpora to JSON lines)
    .txt/.text/.md   ``txt_sample_by``: "paragraph" (split on blank lines, as `datasets`' text builder does),
                     "line" or "document" (the whole file)
    .csv             `csv.DictReader`, row by row
    .parquet         one row group at a time (`pyarrow.parquet.ParquetFile`)
    builtin          `moe_core.data.sources.iter_builtin_corpus`
    hub              ``datasets.load_dataset(..., streaming=True)``: rows arrive as the hub sends them

`iter_documents` turns records into `Document`s of one data kind (text: the text column and the domain column;
instruction: the chat rendered with the lab's template). A malformed record is a `DataError` naming the file,
the line (or row group and row) and the reason; nothing read before it is lost to the caller, who has already
consumed those documents.

`BottomK` keeps a bounded, deterministic sample of a stream: the items with the smallest keys (keys derived from
the document's hash), so the sample depends on the content and not on the order or the size of the stream.
"""

from __future__ import annotations

# Lazy: `datasets` (hub streaming) and `pyarrow.parquet` load inside the readers that need them.
import codecs
import csv
import heapq
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_core.data.errors import DataError
from moe_core.data.sources import (
    DEFAULT_MAX_LINE_BYTES,
    SourceSpec,
    check_file,
    iter_builtin_corpus,
    refuse_kind_the_source_lacks,
    to_messages,
)
from moe_core.data.tokenizer import render_chat
from moe_core.paths import lab_data_dir

READ_BYTES = 1 << 20  # text files are decoded in pieces of this size


@dataclass(frozen=True)
class StreamDocument:
    """One document of a stream: its text, domain label, and where it came from (a name, never content)."""

    text: str
    domain: str
    where: str
    record: dict[str, Any] | None = None  # the raw record (instruction data is validated on it)


# ---------------------------------------------------------------------------------------------- records
def iter_records(
    spec: SourceSpec,
    *,
    hub_config: str | None = None,
    split: str = "train",
    txt_sample_by: str = "paragraph",
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    columns: tuple[str, ...] | None = None,
    check: bool = True,
) -> Iterator[tuple[dict[str, Any], str]]:
    """(record, where) of every row of the source, in a fixed order. ``columns``: parquet reads only these
    (when present). Local files are checked first (`check_file`: empty, binary, invalid UTF-8, enormous
    lines), one at a time as the stream reaches them, unless ``check=False`` (a second pass over files a
    first pass checked)."""
    if spec.type == "builtin":
        for doc in iter_builtin_corpus():
            yield {"text": doc.text, "domain": doc.domain, "source": doc.source}, doc.source
        return
    if spec.type == "hub":
        yield from iter_hub_records(spec.location, hub_config, split)
        return
    for path in spec.files:
        if check:
            check_file(path, spec.builder or "", max_line_bytes)
        if spec.builder == "json":
            yield from _json_records(path)
        elif spec.builder == "text":
            yield from _text_records(path, txt_sample_by)
        elif spec.builder == "csv":
            yield from _csv_records(path)
        elif spec.builder == "parquet":
            yield from _parquet_records(path, columns)
        else:  # parse_source only resolves the builders above
            raise DataError(f"{path}: no stream reader for format {spec.builder!r}")


def iter_hub_records(
    path: str, name: str | None = None, split: str = "train", data_files: Any = None
) -> Iterator[tuple[dict[str, Any], str]]:
    """Rows of ``datasets.load_dataset(path, name, split=split, streaming=True)``: a hub id, or a packaged
    builder ("json", "text", ...) with ``data_files`` (how tests drive this path without a network)."""
    import datasets

    where = path if data_files is None else f"{path}:{data_files}"
    try:
        stream = datasets.load_dataset(
            path,
            name,
            split=split,
            streaming=True,
            data_files=data_files,
            cache_dir=str(lab_data_dir() / "hf-datasets"),
        )
        rows = iter(stream)
        for i, row in enumerate(rows):
            yield dict(row), f"{where} row {i}"
    except DataError:
        raise
    except Exception as err:
        msg = str(err).splitlines()[0][:300] if str(err) else type(err).__name__
        raise DataError(
            f"hub dataset {path!r} (config {name!r}, split {split!r}) could not be streamed: "
            f"{type(err).__name__}: {msg}. Without network access use local files or the built-in corpus "
            "(source 'builtin')"
        ) from None


def _json_records(path: Path) -> Iterator[tuple[dict[str, Any], str]]:
    with open(path, encoding="utf-8") as f:
        head = f.read(4096).lstrip()
        f.seek(0)
        if head.startswith("["):  # one JSON array: no way to stream it without a streaming parser
            try:
                rows = json.load(f)
            except json.JSONDecodeError as err:
                raise DataError(
                    f"{path}: line {err.lineno}: could not parse as json ({err.msg}, column {err.colno}); "
                    "fix the file (large corpora read best as JSON lines, one object per line)"
                ) from None
            for i, row in enumerate(rows):
                yield _object(row, path, f"item {i}"), f"{path}: item {i}"
            return
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as err:
                raise DataError(
                    f"{path}: line {n}: could not parse as json ({err.msg}, column {err.colno}); "
                    "fix or remove that line and run again"
                ) from None
            yield _object(row, path, f"line {n}"), f"{path}: line {n}"


def _object(row: Any, path: Path, at: str) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise DataError(
            f"{path}: {at}: a JSON {type(row).__name__}, expected an object with named columns "
            '(e.g. {"text": ...}); fix that record'
        )
    return row


def _text_records(path: Path, sample_by: str) -> Iterator[tuple[dict[str, Any], str]]:
    """Rows as `datasets`' text builder makes them (packaged_modules/text): paragraphs are the pieces between
    "\\n\\n", lines are `str.splitlines` pieces, a document is the whole file."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    line = 1  # the line the pending piece starts on
    if sample_by == "document":
        yield {"text": path.read_text(encoding="utf-8")}, f"{path}: line 1"
        return
    pending = ""
    with open(path, "rb") as f:
        while True:
            chunk = f.read(READ_BYTES)
            pending += decoder.decode(chunk, final=not chunk)
            if sample_by == "paragraph":
                parts = pending.split("\n\n")
                seps = "\n\n"
            else:
                parts = pending.splitlines(keepends=True)
                seps = ""
            done, pending = (parts, "") if not chunk else (parts[:-1], parts[-1])
            for part in done:
                text = part if sample_by == "paragraph" else (part.splitlines() or [""])[0]
                yield {"text": text}, f"{path}: line {line}"
                line += part.count("\n") + seps.count("\n")
            if not chunk:
                return


def _csv_records(path: Path) -> Iterator[tuple[dict[str, Any], str]]:
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        try:
            for row in reader:
                if None in row:  # more fields than the header names
                    raise DataError(
                        f"{path}: line {reader.line_num}: {len(row) - 1 + len(row[None])} fields, the header "
                        f"names {len(reader.fieldnames or [])}; fix that row"
                    )
                yield {k: (None if v == "" else v) for k, v in row.items()}, f"{path}: line {reader.line_num}"
        except csv.Error as err:
            raise DataError(f"{path}: line {reader.line_num}: could not parse as csv ({err})") from None


def _parquet_records(path: Path, columns: tuple[str, ...] | None) -> Iterator[tuple[dict[str, Any], str]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as err:
        raise DataError(f"{path}: could not parse as parquet ({type(err).__name__}: {err})") from None
    names = pf.schema_arrow.names
    wanted = [c for c in columns if c in names] if columns else None
    for g in range(pf.num_row_groups):
        try:
            table = pf.read_row_group(g, columns=wanted)
        except Exception as err:
            raise DataError(
                f"{path}: row group {g}: could not be read ({type(err).__name__}: {err}); the file is damaged"
            ) from None
        for i, row in enumerate(table.to_pylist()):
            yield row, f"{path}: row group {g} row {i}"


# ---------------------------------------------------------------------------------------------- documents
def missing_columns(where: str, record: dict[str, Any], columns: list[str], hint: str) -> DataError:
    missing = [c for c in columns if c not in record]
    return DataError(f"{where}: missing column(s) {missing}; found {sorted(record)}. {hint}")


def iter_documents(
    spec: SourceSpec,
    kind: str = "text",
    *,
    text_column: str = "text",
    domain_column: str | None = None,
    hub_config: str | None = None,
    split: str = "train",
    txt_sample_by: str = "paragraph",
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    max_documents: int | None = None,
    check: bool = True,
) -> Iterator[StreamDocument]:
    """Documents of one kind, streamed. Text: the ``text_column`` (None counts as empty) labelled with
    ``domain_column`` (the built-in corpus's own labels; "text" otherwise). Instruction: chat ``messages`` or
    alpaca records rendered with the chat template, domain "instruction". At most ``max_documents`` records."""
    if kind not in ("text", "instruction"):
        raise DataError(f"documents are 'text' or 'instruction'; {kind!r} records are read with iter_records")
    refuse_kind_the_source_lacks(spec, kind)
    if spec.type == "builtin":
        text_column, domain_column = "text", "domain"
    columns = tuple(c for c in (text_column, domain_column) if c) if kind == "text" else None
    records = iter_records(
        spec,
        hub_config=hub_config,
        split=split,
        txt_sample_by=txt_sample_by,
        max_line_bytes=max_line_bytes,
        columns=columns,
        check=check,
    )
    for n, (record, where) in enumerate(records):
        if max_documents is not None and n >= max_documents:
            return
        if kind == "instruction":
            if record.get("messages") is None and not {"instruction", "output"} <= set(record):
                raise missing_columns(
                    where,
                    record,
                    ["instruction", "output"],
                    "Instruction data needs a chat `messages` column or alpaca `instruction`/`output`.",
                )
            yield StreamDocument(render_chat(to_messages(record)), "instruction", where, record)
            continue
        if text_column not in record:
            raise missing_columns(
                where, record, [text_column], "Pass the text column with text_column / --text-column."
            )
        if domain_column is not None and domain_column not in record:
            raise missing_columns(where, record, [domain_column], "Pass an existing domain_column or none.")
        text = record[text_column]
        if text is not None and not isinstance(text, str):
            raise DataError(
                f"{where}: column {text_column!r} holds a {type(text).__name__}, expected a string; "
                "fix that record or choose another --text-column"
            )
        domain = "text" if domain_column is None else str(record[domain_column])
        yield StreamDocument(text or "", domain, where)


# ---------------------------------------------------------------------------------------------- sampling
class BottomK:
    """The items with the smallest keys seen so far, at most ``max_items`` of them and at most ``max_bytes``
    in total size (always at least one): the longest prefix, in key order, that fits. With keys taken from a
    hash of the content, the sample is a deterministic function of the set of items, whatever their order."""

    def __init__(self, max_items: int | None = None, max_bytes: int | None = None) -> None:
        self.max_items, self.max_bytes = max_items, max_bytes
        self._heap: list[tuple[int, int, int, Any]] = []  # (-key, -index, size, item): the largest key on top
        self.bytes = 0
        self.seen = 0

    def add(self, key: int, index: int, size: int, item: Any) -> None:
        self.seen += 1
        if self._full() and (-key, -index) < self._heap[0][:2]:
            return  # larger than everything kept, and nothing more fits
        heapq.heappush(self._heap, (-key, -index, size, item))
        self.bytes += size
        while len(self._heap) > 1 and self._over():
            _, _, dropped, _ = heapq.heappop(self._heap)
            self.bytes -= dropped

    def _over(self) -> bool:
        return (self.max_items is not None and len(self._heap) > self.max_items) or (
            self.max_bytes is not None and self.bytes > self.max_bytes
        )

    def _full(self) -> bool:
        return bool(self._heap) and (
            (self.max_items is not None and len(self._heap) >= self.max_items)
            or (self.max_bytes is not None and self.bytes >= self.max_bytes)
        )

    def items(self) -> list[tuple[int, Any]]:
        """(index, item) of the sample, in stream order."""
        return sorted((-neg_index, item) for _, neg_index, _, item in self._heap)

    def __len__(self) -> int:
        return len(self._heap)


__all__ = ["BottomK", "StreamDocument", "iter_documents", "iter_hub_records", "iter_records"]
