"""Where documents come from: the built-in offline corpus, local files, or a Hugging Face hub dataset.

Every source ends up as a `datasets.Dataset`. For ``kind="text"`` its columns are ``text``, ``domain`` and
``source`` (the file or id a row came from: a name, never content); instruction and preference data keep
their own columns (alpaca ``instruction/input/output``, chat ``messages``, ``prompt/chosen/rejected``)
plus ``source``.

Source strings (`parse_source`):
    ``builtin``                     the standard library of the running interpreter (no network needed)
    ``path/to/file.jsonl``          a file: .txt/.text/.md, .jsonl/.json, .parquet, .csv
    ``path/to/dir`` or ``a/*.txt``  every file of a supported format under a directory, or a glob
    ``hf:owner/name`` (or ``owner/name`` when no such local path exists), with ``hub_config`` and ``split``,
                                    e.g. ``hf:Salesforce/wikitext`` + ``wikitext-103-raw-v1`` (WikiText-103)

Local files are checked before `datasets` reads them (`check_file`), so an empty, binary or non-UTF-8 file,
or one enormous line, is reported with the file name, byte offset and line instead of a parser traceback.

`load_source` returns the whole source as one in-memory dataset (fine-tuning sets); preparation and
validation read sources as streams instead (`moe_core.data.stream`), which keeps memory flat at any size.

Where text is stored: `datasets` would keep an Arrow copy of every local file it reads under
``~/.cache/huggingface/datasets``, files that fail validation included. Local files are read through a
scratch cache inside the lab's data directory (`lab_data_dir`) into memory, and the scratch directory is
deleted when loading ends, whether it succeeded or not: no copy of a local file's text stays behind. Hub
datasets are cached in ``<lab data dir>/hf-datasets``. Prepared data (``moe_core.data.prepare``) holds token
ids, which decode back to the text with the tokenizer beside them.
"""

from __future__ import annotations

# Lazy: `datasets` (heavy, seconds) loads inside the functions that read data; the flows and
# `moe-lab run --help-config` import this module for source parsing.
import ast
import codecs
import glob
import hashlib
import inspect
import io
import json
import os
import re
import sys
import sysconfig
import tokenize
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from moe_core.data.errors import DataError
from moe_core.data.shards import sha256_file
from moe_core.fileio import scratch_directory
from moe_core.paths import lab_data_dir

# kto: unpaired feedback (prompt, completion, label true/false), what KTO fine-tuning trains on; prompt: prompts alone
# (and any columns a reward reads), what GRPO samples completions for
KINDS: tuple[str, ...] = ("text", "instruction", "preference", "kto", "prompt")

# file suffix -> `datasets` packaged builder
FORMATS: dict[str, str] = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
}
DEFAULT_MAX_LINE_BYTES = 8 * 1024 * 1024
CORPUS_VERSION = 1  # bump when builtin_corpus() changes what it yields, so prepared data is rebuilt

_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


@dataclass(frozen=True)
class Document:
    """One training document. `domain` labels it for routing-by-domain analytics ("code", "prose", ...)."""

    text: str
    domain: str
    source: str


# ---------------------------------------------------------------------------------------------- built-in
_SKIP_DIRS = {
    "site-packages",
    "dist-packages",
    "test",
    "tests",
    "idle_test",
    "__pycache__",
    "encodings",
    "ensurepip",
    "__phello__",
}
_PRAGMA = re.compile(r"^#!|coding[:=]|^#\s*(noqa|type:|pragma|fmt:)")


def stdlib_files() -> list[tuple[str, Path]]:
    """(relative path, path) of the interpreter's standard-library .py files, sorted, tests excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        # prune in place: never walk site-packages, tests or build configs
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("config-")]
        rel_dir = Path(dirpath).relative_to(root)
        out.extend(((rel_dir / f).as_posix(), Path(dirpath) / f) for f in filenames if f.endswith(".py"))
    return sorted(out)


def split_python_source(source: str) -> tuple[str, str]:
    """Split Python source into (code, prose): prose is the docstrings and comments, in source order;
    code is the rest with those removed. Raises SyntaxError on source `ast` cannot parse."""
    tree = ast.parse(source)
    lines = source.splitlines()
    drop: set[int] = set()  # 1-based lines that belong to prose only
    prose: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if (
            not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            or not node.body
        ):
            continue
        first = node.body[0]
        if not (
            isinstance(first, ast.Expr)
            and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)
        ):
            continue
        prose.append((first.lineno, inspect.cleandoc(first.value.value)))
        if isinstance(node, ast.Module) or first.lineno != node.lineno:  # `def f(): "doc"` keeps its line
            drop.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    cut: dict[int, int] = {}  # line -> column where an inline comment starts
    block: list[str] = []
    block_start = block_end = -2
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        row, col = tok.start
        if _PRAGMA.search(tok.string):
            text = ""
        else:
            text = tok.string.lstrip("#").strip()
        if lines[row - 1][:col].strip():  # inline comment after code
            cut[row] = col
            if text:
                prose.append((row, text))
            continue
        drop.add(row)
        if block and row == block_end + 1:
            block.append(text)
        else:
            if block:
                prose.append((block_start, "\n".join(block).strip()))
            block, block_start = [text], row
        block_end = row
    if block:
        prose.append((block_start, "\n".join(block).strip()))
    code_lines = [
        line[: cut[i]].rstrip() if i in cut else line
        for i, line in enumerate(lines, start=1)
        if i not in drop
    ]
    code = re.sub(r"\n{3,}", "\n\n", "\n".join(code_lines)).strip("\n")
    prose_text = "\n\n".join(text for _, text in sorted(prose, key=lambda p: p[0]) if text)
    return code, prose_text


def iter_builtin_corpus() -> Iterator[Document]:
    """Documents of the built-in corpus, in a fixed order: for each stdlib file (sorted by path) its prose
    (docstrings + comments, domain "prose") then its code (domain "code"). Unparsable files are skipped."""
    for rel, path in stdlib_files():
        try:
            with tokenize.open(path) as f:  # honours the file's coding cookie
                source = f.read()
            code, prose = split_python_source(source)
        except (SyntaxError, UnicodeDecodeError, ValueError, tokenize.TokenError):
            continue
        if prose.strip():
            yield Document(prose, "prose", f"stdlib:{rel}#prose")
        if code.strip():
            yield Document(code, "code", f"stdlib:{rel}#code")


def builtin_corpus(max_documents: int | None = None) -> list[Document]:
    """The built-in offline corpus: the running interpreter's standard library (found through `sysconfig`),
    split into code and prose documents. Deterministic for a given Python installation."""
    if max_documents is not None and max_documents <= 0:
        raise ValueError(f"builtin_corpus: max_documents={max_documents!r} must be positive or None")
    docs: list[Document] = []
    for doc in iter_builtin_corpus():
        if max_documents is not None and len(docs) >= max_documents:
            break
        docs.append(doc)
    return docs


# ---------------------------------------------------------------------------------------------- spec
@dataclass(frozen=True)
class SourceSpec:
    """A resolved source: ``type`` is "builtin", "local" or "hub"."""

    type: Literal["builtin", "local", "hub"]
    location: str
    files: tuple[Path, ...] = field(default=())
    builder: str | None = None  # `datasets` builder of local files

    @property
    def name(self) -> str:
        return self.location if self.type != "local" else f"{self.location} ({len(self.files)} file(s))"


def _has_magic(s: str) -> bool:
    return any(ch in s for ch in "*?[")


def parse_source(source: str) -> SourceSpec:
    """Resolve a source string to a `SourceSpec`, listing local files. Raises `DataError` for a missing
    path, a directory or glob with no supported files, an unknown format, or mixed formats."""
    source = str(source)
    if source == "builtin":
        return SourceSpec("builtin", "builtin")
    if source.startswith("hf:"):
        return SourceSpec("hub", source[3:])
    path = Path(source).expanduser()
    supported = ", ".join(sorted(FORMATS))
    if _has_magic(source):
        files = [Path(p) for p in sorted(glob.glob(str(path), recursive=True)) if Path(p).is_file()]
        if not files:
            raise DataError(f"{source}: the glob matches no files; check the pattern")
        what = f"glob {source}"
    elif path.is_dir():
        files = sorted(
            p
            for p in path.rglob("*")
            if p.is_file()
            and p.suffix.lower() in FORMATS
            and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        if not files:
            raise DataError(f"{source}: the directory holds no files of a supported format ({supported})")
        what = f"directory {source}"
    elif path.is_file():
        files, what = [path], str(path)
    elif path.suffix.lower() in FORMATS or "/" not in source.strip("/") or not _HUB_ID.match(source):
        raise DataError(
            f"{source}: no such file or directory; pass an existing path, 'builtin', "
            "or a hub dataset id as hf:owner/name"
        )
    else:
        return SourceSpec("hub", source)
    unknown = [p for p in files if p.suffix.lower() not in FORMATS]
    if unknown:
        raise DataError(
            f"{unknown[0]}: unknown format {unknown[0].suffix or '(no suffix)'!r}; supported: {supported}"
        )
    builders = sorted({FORMATS[p.suffix.lower()] for p in files})
    if len(builders) > 1:
        raise DataError(f"{what}: mixes formats {builders}; put one format per source")
    return SourceSpec("local", source, tuple(files), builders[0])


# ---------------------------------------------------------------------------------------------- checks
def check_file(
    path: Path,
    builder: str,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    start: int = 0,
    stop: int | None = None,
    lines_before: int = 0,
) -> None:
    """Reject a file `datasets` would choke on or silently mangle, naming the file, offset and line.
    ``start``/``stop``: check only those bytes (a part of the file cut at a line boundary, which has
    ``lines_before`` lines before it; `moe_core.data.stream.partition_source`); an empty file is refused
    only by the check of the whole file."""
    whole = start == 0 and stop is None
    size = path.stat().st_size
    if size == 0:
        raise DataError(f"{path}: empty file (0 bytes); remove it or point the source elsewhere")
    if builder == "parquet":
        with open(path, "rb") as f:
            head = f.read(4)
        if head != b"PAR1":
            raise DataError(f"{path}: not a parquet file (no PAR1 magic bytes); check the file or its suffix")
        return
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    offset, line = start, lines_before  # bytes and newlines before the current chunk
    current = 0  # length of the line that runs into the current chunk
    nonspace = False
    left = (size if stop is None else stop) - start
    with open(path, "rb") as f:
        f.seek(start)
        while left > 0 and (chunk := f.read(min(1 << 20, left))):
            left -= len(chunk)
            nul = chunk.find(b"\0")
            if nul >= 0:
                raise DataError(
                    f"{path}: binary file (NUL byte at byte offset {offset + nul}); "
                    "only UTF-8 text is accepted for this format"
                )
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as err:
                pos = max(err.start, 0)
                at_line = line + chunk.count(b"\n", 0, pos) + 1
                raise DataError(
                    f"{path}: invalid UTF-8 at byte offset {offset + pos} (line {at_line}); "
                    "re-encode the file as UTF-8"
                ) from None
            parts = chunk.split(b"\n")
            lengths = [current + len(parts[0])] + [len(p) for p in parts[1:]]
            longest = max(lengths)
            if longest > max_line_bytes:
                at = lengths.index(longest)
                raise DataError(
                    f"{path}: line {line + at + 1} is over {max_line_bytes} bytes "
                    f"(max_line_bytes); split it into several lines/documents or raise the limit"
                )
            current = lengths[-1]
            nonspace = nonspace or bool(chunk.strip())
            line += len(parts) - 1
            offset += len(chunk)
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise DataError(
                f"{path}: invalid UTF-8 (truncated sequence at the end of the file); "
                "re-encode the file as UTF-8"
            ) from None
    if whole and not nonspace:
        raise DataError(f"{path}: empty file (whitespace only); remove it or point the source elsewhere")


# ---------------------------------------------------------------------------------------------- loading
@dataclass
class LoadedSource:
    dataset: Any  # datasets.Dataset
    spec: SourceSpec
    fingerprint: str


def source_fingerprint(spec: SourceSpec, hub_config: str | None = None, split: str = "train") -> str:
    """A hash that changes when the source's content changes: file contents for local files; the
    interpreter's stdlib file list (sizes, mtimes) for the built-in corpus; id/config/split for the hub."""
    h = hashlib.sha256()
    if spec.type == "builtin":
        h.update(f"builtin:v{CORPUS_VERSION}:{sys.version}".encode())
        for rel, path in stdlib_files():
            st = path.stat()
            h.update(f"{rel}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    elif spec.type == "local":
        for path in spec.files:
            h.update(f"{path.name}:{sha256_file(path)}\n".encode())
    else:
        h.update(f"hub:{spec.location}:{hub_config}:{split}".encode())
    return h.hexdigest()


@contextmanager
def _scratch_datasets_cache() -> Iterator[str]:
    """A `datasets` cache directory that exists only while local files are read (into memory), then is
    removed with every Arrow copy of their text, also when reading failed half way; one a killed reader left
    is removed by the next read (`scratch_directory`)."""
    with scratch_directory(lab_data_dir() / "hf-datasets", ".local") as scratch:
        yield str(scratch)


def _load_local(spec: SourceSpec, max_line_bytes: int, txt_sample_by: str) -> Any:
    for path in spec.files:
        check_file(path, spec.builder or "", max_line_bytes)
    with _scratch_datasets_cache() as cache_dir:
        return _load_local_files(spec, txt_sample_by, cache_dir)


def _load_local_files(spec: SourceSpec, txt_sample_by: str, cache_dir: str) -> Any:
    import datasets

    kwargs: dict[str, Any] = {"sample_by": txt_sample_by} if spec.builder == "text" else {}

    def load(files: list[Path]) -> Any:
        # keep_in_memory: the rows are read into memory, so the scratch cache can go once loading ends
        return datasets.load_dataset(
            spec.builder,
            data_files=[str(p) for p in files],
            split="train",
            cache_dir=cache_dir,
            keep_in_memory=True,
            **kwargs,
        )

    try:
        with quiet_datasets():
            ds = load(list(spec.files))
    except Exception as err:  # find the file to blame and say what the parser said
        culprit = spec.files[0]
        if len(spec.files) > 1:
            for path in spec.files:
                try:
                    with quiet_datasets():
                        load([path])
                except Exception:
                    culprit = path
                    break
        cause = err.__cause__ or err
        first = str(cause).splitlines()[0][:200] if str(cause) else type(cause).__name__
        if len(spec.files) > 1 and culprit == spec.files[0]:
            raise DataError(
                f"{spec.location}: the files load one by one but not together ({first}); "
                "make their columns and types agree"
            ) from None
        raise DataError(
            f"{culprit}: could not parse as {spec.builder} ({type(cause).__name__}: {first}); "
            "fix the file or its suffix"
        ) from None
    # the name of the file each row came from (never its content)
    names: list[str] = []
    if len(spec.files) == 1:
        names = [str(spec.files[0])] * len(ds)
    else:
        with quiet_datasets():
            for path in spec.files:
                names.extend([str(path)] * len(load([path])))
        if len(names) != len(ds):
            names = [spec.location] * len(ds)
    return ds.add_column("source", names) if "source" not in ds.column_names else ds


class quiet_datasets:
    """Silence `datasets` progress bars while loading (they are noise in tests and flow logs)."""

    def __enter__(self) -> None:
        import datasets

        self._was = datasets.utils.logging.is_progress_bar_enabled()
        datasets.disable_progress_bars()

    def __exit__(self, *exc: object) -> None:
        import datasets

        if self._was:
            datasets.enable_progress_bars()


def _load_hub(spec: SourceSpec, hub_config: str | None, split: str, max_documents: int | None) -> Any:
    import datasets

    # "train[:N]" lets `datasets` read only the first N rows where the builder supports it
    selected = split if max_documents is None or "[" in split else f"{split}[:{max_documents}]"
    try:
        return datasets.load_dataset(
            spec.location, hub_config, split=selected, cache_dir=str(lab_data_dir() / "hf-datasets")
        )
    except Exception as err:
        msg = str(err).splitlines()[0][:300] if str(err) else type(err).__name__
        raise DataError(
            f"hub dataset {spec.location!r} (config {hub_config!r}, split {split!r}) could not be loaded: "
            f"{type(err).__name__}: {msg}. Without network access use local files or the built-in corpus "
            "(source 'builtin')"
        ) from None


def _require_columns(ds: Any, spec: SourceSpec, columns: list[str], hint: str) -> None:
    missing = [c for c in columns if c not in ds.column_names]
    if missing:
        where = str(spec.files[0]) if len(spec.files) == 1 else spec.name
        raise DataError(f"{where}: missing column(s) {missing}; found {ds.column_names}. {hint}")


def refuse_kind_the_source_lacks(spec: SourceSpec, kind: str) -> None:
    """The built-in corpus holds text only: instruction or preference data must come from a file or the hub."""
    if spec.type == "builtin" and kind != "text":
        raise DataError(f"the built-in corpus is text; kind={kind!r} needs a local file or hub dataset")


def load_source(
    source: str,
    kind: str = "text",
    text_column: str = "text",
    domain_column: str | None = None,
    hub_config: str | None = None,
    split: str = "train",
    max_documents: int | None = None,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    txt_sample_by: str = "paragraph",
) -> LoadedSource:
    """Load a source (see the module docstring) as a `datasets.Dataset`; see `LoadedSource`.

    Text: columns ``text``, ``domain``, ``source``. Instruction: the alpaca or chat columns + ``source``.
    Preference: ``prompt``, ``chosen``, ``rejected`` + ``source``. Raises `DataError` on bad input."""
    import datasets

    if kind not in KINDS:
        raise DataError(f"unknown data kind {kind!r}; choose one of {KINDS}")
    spec = parse_source(source)
    fingerprint = source_fingerprint(spec, hub_config, split)
    refuse_kind_the_source_lacks(spec, kind)
    if spec.type == "builtin":
        docs = builtin_corpus(max_documents)
        ds = datasets.Dataset.from_dict(
            {
                "text": [d.text for d in docs],
                "domain": [d.domain for d in docs],
                "source": [d.source for d in docs],
            }
        )
        return LoadedSource(ds, spec, fingerprint)
    ds = (
        _load_local(spec, max_line_bytes, txt_sample_by)
        if spec.type == "local"
        else _load_hub(spec, hub_config, split, max_documents)
    )
    if "source" not in ds.column_names:
        ds = ds.add_column("source", [spec.location] * len(ds))
    if max_documents is not None:
        ds = ds.select(range(min(max_documents, len(ds))))
    if len(ds) == 0:
        raise DataError(f"{spec.name}: no rows; check the file(s) or split")
    if kind == "text":
        _require_columns(ds, spec, [text_column], "Pass the text column with text_column / --text-column.")
        if domain_column is not None:
            _require_columns(ds, spec, [domain_column], "Pass an existing domain_column or none.")
        ds = _text_columns(ds, text_column, domain_column)
    elif kind == "instruction":
        if "messages" not in ds.column_names:
            _require_columns(
                ds,
                spec,
                ["instruction", "output"],
                "Instruction data needs a chat `messages` column or alpaca `instruction`/`output`.",
            )
    elif kind == "kto":
        _require_columns(
            ds,
            spec,
            ["prompt", "completion", "label"],
            "KTO data needs `prompt`, `completion` and a boolean `label` (true: desirable) column.",
        )
        _require_filled(ds, spec, ["prompt", "completion"])
        _require_boolean_labels(ds, spec)
    elif kind == "prompt":
        _require_columns(
            ds,
            spec,
            ["prompt"],
            "Prompt data needs a `prompt` column (text or chat turns); other columns reach the reward functions.",
        )
        _require_filled(ds, spec, ["prompt"])
    else:
        _require_columns(
            ds,
            spec,
            ["prompt", "chosen", "rejected"],
            "Preference data needs `prompt`, `chosen` and `rejected` columns.",
        )
        _require_filled(ds, spec, ["prompt", "chosen", "rejected"])
    return LoadedSource(ds, spec, fingerprint)


def _row_where(spec: SourceSpec, i: int) -> str:
    """Row ``i`` (0-based) as a user finds it: row n of the file (line n of a JSON Lines file)."""
    return f"{str(spec.files[0]) if len(spec.files) == 1 else spec.name}: row {i + 1}"


def _require_filled(ds: Any, spec: SourceSpec, columns: list[str]) -> None:
    """Every row of preference or KTO data has each of ``columns`` (null or empty text is named, by row)."""
    for column in columns:
        for i, value in enumerate(ds[column]):
            if value is None or (isinstance(value, str | list) and not value):
                raise DataError(
                    f"{_row_where(spec, i)}: {column} is empty; every row needs a {column} (fix or drop that row)"
                )


def _require_boolean_labels(ds: Any, spec: SourceSpec) -> None:
    """Every KTO row's ``label`` is true or false; the first that is not is named (row n of the file: line n of a
    JSON Lines file)."""
    for i, label in enumerate(ds["label"]):
        if not isinstance(label, bool):
            got = "missing (null)" if label is None else f"{label!r}"
            raise DataError(
                f"{_row_where(spec, i)}: label is {got}; KTO data needs label true (a desirable completion) or "
                "false (an undesirable one) on every row"
            )


def _text_columns(ds: Any, text_column: str, domain_column: str | None) -> Any:
    """Columns ``text``, ``domain`` (as strings; "text" without a domain column), ``source``, by Arrow column
    operations: rebuilding the dataset from Python lists (``Dataset.from_dict``) costs time per row."""
    import datasets
    import pyarrow as pa

    table = ds.with_format("arrow")[:]  # a pyarrow Table of the rows (a selection's indices applied)
    domain = (
        table.column(domain_column).cast(pa.string())
        if domain_column is not None
        else pa.repeat(pa.scalar("text"), len(ds))
    )
    columns = {
        "text": table.column(text_column).cast(pa.string()),
        "domain": domain,
        "source": table.column("source"),
    }
    return datasets.Dataset(datasets.table.InMemoryTable.from_pydict(columns))


# ---------------------------------------------------------------------------------------------- records
def to_messages(record: dict[str, Any]) -> list[dict[str, str]]:
    """An instruction record (chat ``messages`` or alpaca ``instruction``/``input``/``output``) as a list of
    ``{"role", "content"}`` turns."""
    if record.get("messages") is not None:
        return [
            {"role": str(m.get("role")), "content": str(m.get("content") or "")} for m in record["messages"]
        ]
    prompt = str(record.get("instruction") or "")
    if record.get("input"):
        prompt = f"{prompt}\n\n{record['input']}"
    return [
        {"role": "user", "content": prompt},
        {"role": "assistant", "content": str(record.get("output") or "")},
    ]


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)
