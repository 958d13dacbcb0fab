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
import io
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
PART_BYTES = 64 << 20  # a file larger than this is read as parts of about this size (partition_source)


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
    part: Partition | None = None,
    lines_before: int | None = None,
) -> Iterator[tuple[dict[str, Any], str]]:
    """(record, where) of every row of the source, in a fixed order. ``columns``: parquet reads only these
    (when present). Local files are checked first (`check_file`: empty, binary, invalid UTF-8, enormous
    lines), one at a time as the stream reaches them, unless ``check=False`` (a second pass over files a
    first pass checked).

    ``part``: only the rows of that part of the source (`partition_source`); ``lines_before``: the lines of
    its file before it, for the line numbers in ``where`` and in errors (None: counted, a read of the file up
    to the part)."""
    if part is not None and part.path is not None:
        yield from _part_records(spec, part, txt_sample_by, max_line_bytes, columns, check, lines_before)
        return
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


def _json_records(
    path: Path, start: int = 0, stop: int | None = None, lines_before: int = 0
) -> Iterator[tuple[dict[str, Any], str]]:
    with _open_text(path, start, stop) as f:
        if start == 0:
            with open(path, "rb") as raw:
                head = raw.read(4096).lstrip()
        else:  # a later part of JSON lines (partition_source keeps an array whole)
            head = b""
        if head.startswith(b"["):  # one JSON array: no way to stream it without a streaming parser
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
        for n, line in enumerate(f, start=lines_before + 1):
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


def _text_records(
    path: Path, sample_by: str, start: int = 0, stop: int | None = None, lines_before: int = 0
) -> Iterator[tuple[dict[str, Any], str]]:
    """Rows as `datasets`' text builder makes them (packaged_modules/text): paragraphs are the pieces between
    "\\n\\n", lines are `str.splitlines` pieces, a document is the whole file. A part of the file that is
    not its last (``stop``) ends on the separator `partition_source` cut after: its empty last piece is the
    start of the next part's first."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    line = lines_before + 1  # the line the pending piece starts on
    if sample_by == "document":
        yield {"text": path.read_text(encoding="utf-8")}, f"{path}: line 1"
        return
    pending = ""
    left = None if stop is None else stop - start
    with open(path, "rb") as f:
        f.seek(start)
        while True:
            chunk = f.read(READ_BYTES if left is None else min(READ_BYTES, left))
            if left is not None:
                left -= len(chunk)
            pending += decoder.decode(chunk, final=not chunk)
            if sample_by == "paragraph":
                parts = pending.split("\n\n")
                seps = "\n\n"
            else:
                parts = pending.splitlines(keepends=True)
                seps = ""
            done, pending = (parts, "") if not chunk else (parts[:-1], parts[-1])
            if not chunk and stop is not None and sample_by == "paragraph":
                done = done[:-1]  # "" after the separator the part ends on
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


def _parquet_records(
    path: Path, columns: tuple[str, ...] | None, start: int = 0, stop: int | None = None
) -> Iterator[tuple[dict[str, Any], str]]:
    """Rows of row groups ``start`` up to ``stop`` (None: the last)."""
    import pyarrow.parquet as pq  # optional heavy dependency of parquet sources

    try:
        pf = pq.ParquetFile(path)
    except Exception as err:
        raise DataError(f"{path}: could not parse as parquet ({type(err).__name__}: {err})") from None
    names = pf.schema_arrow.names
    wanted = [c for c in columns if c in names] if columns else None
    for g in range(start, pf.num_row_groups if stop is None else stop):
        try:
            table = pf.read_row_group(g, columns=wanted)
        except Exception as err:
            raise DataError(
                f"{path}: row group {g}: could not be read ({type(err).__name__}: {err}); the file is damaged"
            ) from None
        for i, row in enumerate(table.to_pylist()):
            yield row, f"{path}: row group {g} row {i}"


# ---------------------------------------------------------------------------------------------- partitions
@dataclass(frozen=True)
class Partition:
    """One part of a source's stream that a worker reads on its own: its documents, in order, follow the
    previous part's in `iter_documents`. ``path`` None: the whole source (the built-in corpus, a hub dataset:
    they are not cut). Otherwise ``start`` / ``stop`` of one file: bytes of a line-based file (``stop`` just
    after a line break, or a paragraph's blank line), row groups of a parquet file; ``stop`` None: to its end."""

    path: Path | None = None
    start: int = 0
    stop: int | None = None


def partition_source(
    spec: SourceSpec, *, txt_sample_by: str = "paragraph", part_bytes: int | None = None
) -> list[Partition]:
    """The parts of a source, in stream order: one per file, and a file over ``part_bytes`` (default
    `PART_BYTES`) cut into parts of about that size where a record starts: JSON lines and text read by line
    after a line break, text read by paragraph after the blank line that ends one (the first "\\n\\n" of a
    run of newlines, where `str.split` cuts), parquet between row groups. A JSON array, a whole-document text
    file and csv (a quoted field may hold line breaks) stay whole. Reads only a few bytes near each cut."""
    if spec.type != "local":
        return [Partition()]
    size = part_bytes or PART_BYTES
    parts = []
    for path in spec.files:
        cuts = _cuts(path, spec.builder or "", txt_sample_by, size)
        bounds = [0, *cuts, None]
        parts += [Partition(path, a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    return parts


def _cuts(path: Path, builder: str, txt_sample_by: str, size: int) -> list[int]:
    if builder == "parquet":
        import pyarrow.parquet as pq  # optional heavy dependency of parquet sources

        try:
            meta = pq.ParquetFile(path).metadata
        except Exception:
            return []  # the reader names what is wrong with the file
        cuts, total = [], 0
        for g in range(meta.num_row_groups - 1):
            total += meta.row_group(g).total_byte_size
            if total >= size:
                cuts.append(g + 1)
                total = 0
        return cuts
    length = path.stat().st_size
    if length <= size or builder == "csv" or (builder == "text" and txt_sample_by == "document"):
        return []
    with open(path, "rb") as f:
        if builder == "json" and f.read(4096).lstrip().startswith(b"["):
            return []
        separator = b"\n\n" if builder == "text" and txt_sample_by == "paragraph" else b"\n"
        cuts = []
        target = size
        while target < length:
            cut = _next_cut(f, target, separator)
            if cut is None or cut >= length:
                break
            cuts.append(cut)
            target = cut + size
        return cuts


def _next_cut(f: io.BufferedReader, at: int, separator: bytes) -> int | None:
    """The offset just after the first ``separator`` at or after ``at`` that is not preceded by a newline
    (so that it is one `str.split` and `splitlines` cut at too); None at the end of the file."""
    start = max(at - 1, 0)
    while True:
        f.seek(start)
        window = f.read(1 << 16)
        if len(window) < len(separator):
            return None
        i = window.find(separator, 1 if start else 0)
        while i > 0 and len(separator) > 1 and window[i - 1 : i] == b"\n":
            i = window.find(separator, i + 1)
        if i >= 0:
            return start + i + len(separator)
        start += len(window) - len(separator)


def lines_before(path: Path, offset: int) -> int:
    """The line breaks in a file before ``offset``: line numbers of a part that starts there count on from it."""
    count, left = 0, offset
    with open(path, "rb") as f:
        while left > 0 and (chunk := f.read(min(READ_BYTES, left))):
            count += chunk.count(b"\n")
            left -= len(chunk)
    return count


class _ByteRange(io.RawIOBase):
    """Bytes ``start`` up to ``stop`` of a file, as a file of their own."""

    def __init__(self, path: Path, start: int, stop: int | None) -> None:
        self.file = open(path, "rb")  # noqa: SIM115 (closed with this object)
        self.file.seek(start)
        self.left = None if stop is None else stop - start

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer)
        if self.left is not None:
            view = view[: max(0, min(len(view), self.left))]
        n = self.file.readinto(view) or 0
        if self.left is not None:
            self.left -= n
        return n

    def close(self) -> None:
        self.file.close()
        super().close()


def _open_text(path: Path, start: int = 0, stop: int | None = None) -> io.TextIOBase:
    """``open(path, encoding="utf-8")`` of a part of the file (universal newlines, as the whole file reads)."""
    if start == 0 and stop is None:
        return open(path, encoding="utf-8")  # noqa: SIM115 (the caller's with closes it)
    return io.TextIOWrapper(io.BufferedReader(_ByteRange(path, start, stop)), encoding="utf-8")


def _part_records(
    spec: SourceSpec,
    part: Partition,
    txt_sample_by: str,
    max_line_bytes: int,
    columns: tuple[str, ...] | None,
    check: bool,
    before: int | None,
) -> Iterator[tuple[dict[str, Any], str]]:
    path, start, stop = part.path, part.start, part.stop
    assert path is not None
    if spec.builder == "parquet":
        if check and start == 0:
            check_file(path, "parquet", max_line_bytes)
        yield from _parquet_records(path, columns, start, stop)
        return
    if before is None:
        before = lines_before(path, start) if start else 0
    if check:
        check_file(path, spec.builder or "", max_line_bytes, start, stop, before)
    if spec.builder == "json":
        yield from _json_records(path, start, stop, before)
    elif spec.builder == "text":
        yield from _text_records(path, txt_sample_by, start, stop, before)
    elif spec.builder == "csv":
        yield from _csv_records(path)
    else:  # parse_source only resolves the builders above
        raise DataError(f"{path}: no stream reader for format {spec.builder!r}")


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
    part: Partition | None = None,
    lines_before: int | None = None,
) -> Iterator[StreamDocument]:
    """Documents of one kind, streamed. Text: the ``text_column`` (None counts as empty) labelled with
    ``domain_column`` (the built-in corpus's own labels; "text" otherwise). Instruction: chat ``messages`` or
    alpaca records rendered with the chat template, domain "instruction". At most ``max_documents`` records.
    ``part``, ``lines_before``: the documents of one part of the source (`iter_records`)."""
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
        part=part,
        lines_before=lines_before,
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


__all__ = [
    "BottomK",
    "Partition",
    "StreamDocument",
    "iter_documents",
    "iter_hub_records",
    "iter_records",
    "lines_before",
    "partition_source",
]
