"""The routing load log: one float32 row per logging step, its layout, its writer and its reader.

Written by the trainer's `RoutingMonitor` (``routing_loads.f32``, layout in ``routing_loads.json``), read by
the dashboard. This module is the layout's one home: every offset into a row is computed here, never by a
reader of the numbers.

Row: ``[step, tokens, then per MoE layer: E expert shares, drop_rate, entropy, max_over_mean_load, E biases
(aux-free routers only)]``. A long run (100k steps x 24 layers x 128 experts) is read by memory-mapping
instead of parsing millions of JSON keys; a reader uses only whole rows (``size // row_bytes``), so a torn
last row is never seen.

    log = LoadLogReader(run_dir)              # one per run: reused for every read, closed when done
    layout, rows_NC = log.rows()              # a read-only map of the whole rows (None, None: no log)
    columns = layout.layer_columns(rows_NC, layer=3)    # frac [N, E], drop_rate [N], ..., bias [N, E]
    log.close()
"""

from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SIDECAR = "routing_loads.f32"
SIDECAR_HEADER = "routing_loads.json"
LAYER_STATS = ("drop_rate", "entropy", "max_over_mean_load")
_PREFIX = 2  # step, tokens
_BYTES = 4  # float32


@dataclass(frozen=True)
class LoadLogLayout:
    """Where each number sits in a row; built from the MoE layers and experts, or from a saved header."""

    layers: tuple[int, ...]
    experts: int
    has_bias: bool

    @property
    def per_layer_floats(self) -> int:
        return self.experts + len(LAYER_STATS) + (self.experts if self.has_bias else 0)

    @property
    def row_floats(self) -> int:
        return _PREFIX + len(self.layers) * self.per_layer_floats

    @property
    def row_bytes(self) -> int:
        return _BYTES * self.row_floats

    def header(self) -> dict:
        """The saved form (``routing_loads.json``); ``per_layer`` gives column offsets inside a layer's block."""
        E, stats = self.experts, len(LAYER_STATS)
        columns = {"frac": [0, E], **{name: E + k for k, name in enumerate(LAYER_STATS)}}
        if self.has_bias:
            columns["bias"] = [E + stats, self.per_layer_floats]
        return {
            "version": 1,
            "dtype": "float32",
            "layers": list(self.layers),
            "experts": E,
            "per_layer": columns,
            "per_layer_floats": self.per_layer_floats,
            "row_floats": self.row_floats,
        }

    @classmethod
    def from_header(cls, header: dict, where: str | Path = SIDECAR_HEADER) -> LoadLogLayout:
        try:
            layout = cls(
                layers=tuple(int(x) for x in header["layers"]),
                experts=int(header["experts"]),
                has_bias="bias" in header["per_layer"],
            )
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(
                f"{where}: not a routing load-log header ({type(err).__name__}: {err}); it is rewritten by "
                "the trainer when the run starts or resumes"
            ) from None
        if layout.row_floats != int(header.get("row_floats", layout.row_floats)):
            raise ValueError(
                f"{where}: row_floats {header['row_floats']} does not match its layers and experts "
                f"({layout.row_floats}); the header was written by another version of moe-lab"
            )
        return layout

    # ------------------------------------------------------------------ encode
    def encode(self, step: float, tokens: float, shares_LE, stats_LS, bias_LE=None) -> bytes:
        """One row: ``shares_LE`` [L, E], ``stats_LS`` [L, len(LAYER_STATS)], ``bias_LE`` [L, E] (bias runs)."""
        parts = [shares_LE, stats_LS] + ([bias_LE] if self.has_bias else [])
        per_layer = np.concatenate(parts, axis=1)
        return np.concatenate([[step, tokens], per_layer.reshape(-1)]).astype(np.float32).tobytes()

    # ------------------------------------------------------------------ decode
    def _blocks(self, rows_NC: np.ndarray) -> np.ndarray:
        """``[N, L, per_layer_floats]``: each layer's block of each row (a view where rows_NC is one)."""
        return rows_NC[:, _PREFIX:].reshape(rows_NC.shape[0], len(self.layers), self.per_layer_floats)

    def steps(self, rows_NC: np.ndarray) -> np.ndarray:
        return rows_NC[:, 0]

    def tokens(self, rows_NC: np.ndarray) -> np.ndarray:
        return rows_NC[:, 1]

    def decode(self, rows_NC: np.ndarray) -> dict[str, np.ndarray]:
        """Every layer at once: ``frac`` [N, L, E], each of `LAYER_STATS` [N, L], ``bias`` [N, L, E]."""
        blocks_NLC, E = self._blocks(rows_NC), self.experts
        out = {"step": rows_NC[:, 0], "frac": blocks_NLC[:, :, :E]}
        for k, name in enumerate(LAYER_STATS):
            out[name] = blocks_NLC[:, :, E + k]
        if self.has_bias:
            out["bias"] = blocks_NLC[:, :, E + len(LAYER_STATS) :]
        return out

    def layer_columns(self, rows_NC: np.ndarray, layer: int) -> dict[str, np.ndarray]:
        """One MoE layer (by its layer id): ``frac`` [N, E], each of `LAYER_STATS` [N], ``bias`` [N, E]."""
        if layer not in self.layers:
            raise KeyError(f"layer {layer} is not an MoE layer of this load log: {list(self.layers)}")
        i = self.layers.index(layer)
        return {name: values[:, i] for name, values in self.decode(rows_NC).items() if name != "step"}


def _read_header(path: Path) -> dict:
    with path.open("rb") as f:
        return json.loads(f.read())


# ---------------------------------------------------------------------------------------------- writer
class LoadLogWriter:
    """Appends rows to a run's load log; on resume drops the rows past ``start_step`` (and a torn last row)."""

    def __init__(self, out_dir: str | Path, layout: LoadLogLayout, start_step: int = 0) -> None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.layout = layout
        tmp = out / f".{SIDECAR_HEADER}.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(layout.header(), indent=1))
        os.replace(tmp, out / SIDECAR_HEADER)
        path = out / SIDECAR
        self._file = path.open("ab")
        size = path.stat().st_size
        keep = size - size % layout.row_bytes  # a crash mid-row: drop the partial row
        if keep:  # resumed: rows after the checkpoint's step are logged again, so drop them here
            with path.open("rb") as f:
                steps = np.frombuffer(f.read(keep), dtype=np.float32).reshape(-1, layout.row_floats)[:, 0]
            keep = int(np.searchsorted(steps, start_step, side="right")) * layout.row_bytes
        if keep != size:
            self._file.truncate(keep)

    def append(self, step: float, tokens: float, shares_LE, stats_LS, bias_LE=None) -> None:
        self._file.write(self.layout.encode(step, tokens, shares_LE, stats_LS, bias_LE))
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


# ---------------------------------------------------------------------------------------------- reader
class LoadLogReader:
    """A run's load log, for as long as a reader needs it: one memory map, replaced when the file grows
    (the old one is closed at once unless an array taken from it is still held, then with that array),
    and plain reads for a few rows. Not thread-safe: callers that share one hold a lock around it."""

    def __init__(self, run_dir: str | Path) -> None:
        self.dir = Path(run_dir)
        self._header_key: tuple | None = None
        self.layout: LoadLogLayout | None = None
        self._map: mmap.mmap | None = None
        self._rows: np.ndarray | None = None

    def _stat(self) -> tuple[os.stat_result, os.stat_result] | None:
        try:
            return (self.dir / SIDECAR_HEADER).stat(), (self.dir / SIDECAR).stat()
        except FileNotFoundError:
            return None

    def _layout(self, header_stat: os.stat_result) -> LoadLogLayout:
        key = (header_stat.st_mtime_ns, header_stat.st_size, header_stat.st_ino)
        if key != self._header_key:  # written when the run starts or resumes
            path = self.dir / SIDECAR_HEADER
            layout = LoadLogLayout.from_header(_read_header(path), path)
            if layout != self.layout:
                self._release()
            self.layout, self._header_key = layout, key
        return self.layout

    def row_count(self) -> int:
        """Whole rows in the file now (0 without a load log)."""
        found = self._stat()
        if found is None:
            return 0
        return found[1].st_size // self._layout(found[0]).row_bytes

    def rows(self) -> tuple[LoadLogLayout | None, np.ndarray | None]:
        """The layout and a read-only ``[rows, row_floats]`` map of the whole rows; (None, None) without a log."""
        found = self._stat()
        if found is None:
            self._release()
            return None, None
        layout = self._layout(found[0])
        n = found[1].st_size // layout.row_bytes
        if self._rows is not None and self._rows.shape[0] == n:
            return layout, self._rows
        self._release()
        if n == 0:
            return layout, np.zeros((0, layout.row_floats), dtype=np.float32)
        with (self.dir / SIDECAR).open("rb") as f:
            self._map = mmap.mmap(f.fileno(), n * layout.row_bytes, access=mmap.ACCESS_READ)
        self._rows = np.frombuffer(self._map, dtype=np.float32).reshape(n, layout.row_floats)
        return layout, self._rows

    def read(self, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` as a copy, read with a plain file read (no map is kept); fewer where the file
        holds fewer whole rows."""
        found = self._stat()
        if found is None or stop <= start:
            width = self.layout.row_floats if self.layout else 0
            return np.zeros((0, width), dtype=np.float32)
        layout = self._layout(found[0])
        stop = min(stop, found[1].st_size // layout.row_bytes)
        with (self.dir / SIDECAR).open("rb") as f:
            f.seek(start * layout.row_bytes)
            data = f.read(max(0, stop - start) * layout.row_bytes)
        data = data[: len(data) - len(data) % layout.row_bytes]
        return np.frombuffer(data, dtype=np.float32).reshape(-1, layout.row_floats).copy()

    def _release(self) -> None:
        self._rows = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # an array from it is still held: the map closes when that array goes
                pass
            self._map = None

    def close(self) -> None:
        self._release()
        self.layout, self._header_key = None, None

    def __enter__(self) -> LoadLogReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_sidecar(run_dir: str | Path) -> tuple[dict, np.ndarray] | None:
    """The header and a copy ``[rows, row_floats]`` of a run's whole load-log rows, or None when the run has
    none (for tests and one-off scripts; a server keeps a `LoadLogReader` open instead). No file stays open."""
    with LoadLogReader(run_dir) as log:
        layout, rows = log.rows()
        if layout is None:
            return None
        return layout.header(), np.array(rows)
