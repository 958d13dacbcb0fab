"""One progress display for every long step: training, fine-tuning, data preparation, profiling, export,
quantization, benchmarks.

`Progress` draws one bar per job with rate and ETA and a short postfix (``loss=3.21 lr=3e-4``):

- in a notebook, a native widget (``tqdm.auto``; needs ``ipywidgets``, the ``notebook`` extra), falling back to
  the text bar when the widget library is missing;
- on a terminal, a ``tqdm`` text bar;
- otherwise (a log file, a CI job, a Prefect worker), plain lines at most every ``every_s`` seconds and at the
  end: ``train: 30/150 step (20%) 1.52 step/s, ETA 1m19s loss=3.21``, so logs stay readable.

Modes: ``auto`` (the above), ``bar``, ``lines``, ``off``. ``MOE_LAB_PROGRESS`` overrides ``auto``
(e.g. ``MOE_LAB_PROGRESS=off`` in a script that wants silence).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Literal, TypeVar

from tqdm import tqdm

Mode = Literal["auto", "bar", "lines", "off"]
MODES = ("auto", "bar", "lines", "off")
T = TypeVar("T")


def in_notebook() -> bool:
    """True inside a Jupyter kernel (where ``tqdm.auto`` draws a widget)."""
    shell = sys.modules.get("IPython")
    if shell is None:
        return False
    try:
        ip = shell.get_ipython()
    except AttributeError:
        return False
    return ip is not None and "IPKernelApp" in getattr(ip, "config", {})


def resolve_mode(mode: str = "auto", stream=None) -> str:
    """The concrete mode (``widget``, ``bar``, ``lines`` or ``off``) for ``mode`` on ``stream``."""
    if mode not in MODES:
        raise ValueError(f"progress mode {mode!r}: expected one of {', '.join(MODES)}")
    if mode == "auto":
        mode = os.environ.get("MOE_LAB_PROGRESS", "auto")
        if mode not in MODES:
            mode = "auto"
    if mode == "auto":
        if in_notebook():
            return "widget"
        stream = stream or sys.stderr
        return "bar" if getattr(stream, "isatty", lambda: False)() else "lines"
    return mode


def quiet_library_bars(stream=None) -> None:
    """Off a terminal (``lines`` or ``off``), turn off the tqdm bars of huggingface_hub, transformers and
    datasets too ("Loading weights", "Writing model shards", downloads): in a log they are carriage-return
    noise beside the lab's own lines. Set in the environment, so the processes a command starts (torchrun
    workers, a flow's stages) inherit it; a user's own setting of those variables wins."""
    if resolve_mode("auto", stream) in ("bar", "widget"):
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # huggingface_hub; transformers reads it too
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules and os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1":
        sys.modules["transformers"].utils.logging.disable_progress_bar()  # imported already: read at import


def format_seconds(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def format_value(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class Progress:
    """A progress display for one job of ``total`` units (None: unknown total, no ETA).

    ``update(n, **postfix)`` moves it on by ``n`` units and sets the postfix shown beside it; ``close()``
    (or leaving the ``with`` block) draws the last state. Cheap when ``mode="off"``.
    """

    def __init__(
        self,
        total: int | None,
        desc: str,
        *,
        unit: str = "step",
        mode: str = "auto",
        initial: int = 0,
        stream=None,
        every_s: float = 10.0,
    ) -> None:
        self.total, self.desc, self.unit = total, desc, unit
        self.stream = stream or sys.stderr
        self.mode = resolve_mode(mode, self.stream)
        self.n = self._start = initial
        self.every_s = every_s
        self.postfix: dict[str, str] = {}
        self._t0 = time.perf_counter()
        self._last_line = self._t0
        self._lines_printed = 0
        self._last_printed_state = None  # (n, postfix) of the last line printed: close() does not repeat it
        self._bar = None
        self._closed = False
        if self.mode in ("bar", "widget"):
            self._bar = self._make_bar()

    def _make_bar(self):
        kwargs = dict(total=self.total, initial=self.n, desc=self.desc, unit=self.unit, dynamic_ncols=True)
        if self.mode == "widget":
            try:  # optional: the notebook extra (tqdm.notebook warns and draws text without ipywidgets)
                import ipywidgets  # noqa: F401
                from tqdm.notebook import tqdm as notebook_tqdm

                return notebook_tqdm(**kwargs)
            except ImportError:
                self.mode = "bar"
        return tqdm(file=self.stream, **kwargs)

    # ---------------------------------------------------------------------------------------------- updates
    def update(self, n: int = 1, **postfix) -> None:
        self.n += n
        if postfix:
            self.set_postfix(**postfix)
        if self._bar is not None:
            self._bar.update(n)
        elif self.mode == "lines":
            now = time.perf_counter()
            if now - self._last_line >= self.every_s:
                self._last_line = now
                self._print_line()

    def advance_to(self, n: int, **postfix) -> None:
        """Move to absolute position ``n`` (a step counter), whatever was done in between."""
        self.update(max(0, n - self.n), **postfix)

    def set_postfix(self, **postfix) -> None:
        self.postfix.update({k: format_value(v) for k, v in postfix.items() if v is not None})
        if self._bar is not None:
            self._bar.set_postfix(self.postfix, refresh=False)

    def stage(self, name: str) -> None:
        """Start stage ``name`` of a job counted in stages (``unit="stage"``): the previous one is done."""
        if self.postfix.get("stage") is not None:
            self.update(1)
        self.set_postfix(stage=name)
        if self._bar is not None:
            self._bar.refresh()

    def rate(self) -> float:
        elapsed = time.perf_counter() - self._t0
        return (self.n - self._start) / elapsed if elapsed > 0 else 0.0

    def line(self, head: str | None = None) -> str:
        """The plain-text state: ``desc: n/total unit (pct) rate, ETA postfix`` (``head`` replaces the part
        before the percentage)."""
        rate = self.rate()
        parts = [
            head
            or (
                f"{self.desc}: {format_value(self.n)}"
                + (f"/{format_value(self.total)}" if self.total else "")
                + f" {self.unit}"
            )
        ]
        if self.total:
            parts[0] += f" ({100 * self.n / self.total:.0f}%)"
        parts.append(
            f"{rate:.3g} {self.unit}/s" if rate >= 0.1 or rate == 0 else f"{1 / rate:.3g} s/{self.unit}"
        )
        if self.total and rate > 0 and self.n < self.total:
            parts[-1] += f", ETA {format_seconds((self.total - self.n) / rate)}"
        elif self.total and self.n >= self.total:
            parts[-1] += f", {format_seconds(time.perf_counter() - self._t0)}"
        text = " ".join(parts)
        if self.postfix:
            text += " " + " ".join(f"{k}={v}" for k, v in self.postfix.items())
        return text

    def _print_line(self, head: str | None = None) -> None:
        self._lines_printed += 1
        self._last_line = time.perf_counter()
        self._last_printed_state = self._state()
        print(self.line(head), file=self.stream, flush=True)

    def print_line(self, head: str | None = None) -> None:
        """In ``lines`` mode, print the state now (a caller that decides when, e.g. at each logging step)."""
        if self.mode == "lines":
            self._print_line(head)

    def close(self, final_line: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif (
            final_line
            and self.mode == "lines"
            and self.n > self._start
            and (self._lines_printed or time.perf_counter() - self._t0 >= min(self.every_s, 2.0))
            and self._state() != self._last_printed_state
        ):
            self._print_line()  # the final state, once; a job done in a blink prints nothing

    def _state(self) -> tuple:
        return self.n, tuple(self.postfix.items())

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress(
    iterable: Iterable[T],
    desc: str,
    *,
    total: int | None = None,
    unit: str = "it",
    mode: str = "auto",
    stream=None,
    every_s: float = 10.0,
) -> Iterator[T]:
    """Iterate over ``iterable`` with a `Progress` display (``total`` defaults to ``len(iterable)``)."""
    if total is None:
        try:
            total = len(iterable)  # type: ignore[arg-type]
        except TypeError:
            total = None
    with Progress(total, desc, unit=unit, mode=mode, stream=stream, every_s=every_s) as bar:
        for item in iterable:
            yield item
            bar.update(1)
