"""Writing files and directories so that nothing half-written is ever seen, and one writer per directory.

- `atomic_directory`: build in a temporary sibling, flush it to disk, then rename into place (an existing
  directory is swapped out first and removed only once the new one is there); every command that writes a
  model or a report writes through it, and `check_output_dir` is its overwrite rule, checked up front.
  Temporaries left by killed writers are removed when their writer is gone (each live temporary holds an
  advisory lock on ``.in-use`` inside it).
- `atomic_file` (and `check_output_file`): the same for an output that is one file (a GGUF).
- `append_record`: append one whole line to a log file, or nothing (a failed write is cut back off).
- `OutputLock` / `lock_output`: one process writes an output directory at a time (a lock file beside it naming
  the holder's pid and host; a lock left by a dead process is taken over with a message).
- `disk_full_guard`: "no space left on device" becomes one clear `DiskFullError` naming the path and the
  space needed, instead of a traceback.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from moe_core.errors import MoELabError

IN_USE = ".in-use"  # inside a temporary directory: flock'ed by its writer for as long as it writes


class DiskFullError(MoELabError):
    """The filesystem ran out of space (or quota) while writing; the message names the path and the space needed."""


class OutputLockedError(MoELabError):
    """Another live process is writing the same output directory."""


# ------------------------------------------------------------------------------------------------ disk full
def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def disk_full_error(path: str | os.PathLike, needed: int | None) -> DiskFullError:
    path = Path(path)
    free = free_bytes(path)
    free = "unknown" if free is None else _human(free)
    need = f"about {_human(needed)}" if needed else "more space"
    return DiskFullError(
        f"no space left on the device writing {path}: it needs {need}, {free} is free there; "
        f"free some space (or point the output elsewhere) and run again"
    )


# How the libraries we write through report a full disk when it is not an OSError: safetensors (Rust's
# io::Error text, "No space left on device (os error 28)"), anything quoting strerror
_OUT_OF_SPACE_TEXT = ("no space left on device", "disk quota exceeded", "os error 28", "os error 122")
# torch.save's writer (caffe2/serialize/inline_container.cc, torch 2.13) reports a short write only as
# "unexpected pos N vs M": out of space when the filesystem has (almost) nothing left
_TORCH_SHORT_WRITE = "unexpected pos"
_NEARLY_FULL = 64 * 2**20


def free_bytes(path: str | os.PathLike) -> int | None:
    """Free bytes on the filesystem that holds ``path`` (or its nearest existing parent); None if unknown."""
    path = Path(path)
    probe = next((p for p in (path, *path.parents) if p.exists()), Path("."))
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return None


def is_disk_full(err: BaseException, path: str | os.PathLike | None = None) -> bool:
    """Whether ``err`` (or an error it was raised from) is the filesystem running out of space or quota."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(err).lower()
        if any(marker in text for marker in _OUT_OF_SPACE_TEXT):
            return True
        if _TORCH_SHORT_WRITE in text and path is not None:
            free = free_bytes(path)
            if free is not None and free < _NEARLY_FULL:
                return True
        err = err.__cause__ or err.__context__
    return False


def require_free_space(path: str | os.PathLike, needed: int) -> None:
    """`DiskFullError` before anything is written when the filesystem of ``path`` has less than ``needed``."""
    free = free_bytes(path)
    if free is not None and free < needed:
        raise disk_full_error(path, needed)


@contextmanager
def disk_full_guard(path: str | os.PathLike, needed: int | None = None) -> Iterator[None]:
    """Writes to ``path`` with a full disk as one `DiskFullError` naming the path and the space needed: with
    ``needed`` (bytes), checked before the block runs; inside it, an out-of-space error of the OS or of a
    library writing for us (safetensors, torch.save) is translated."""
    if needed:
        require_free_space(path, needed)
    try:
        yield
    except DiskFullError:
        raise
    except Exception as err:
        if not is_disk_full(err, path):
            raise
        raise disk_full_error(getattr(err, "filename", None) or path, needed) from None


# ------------------------------------------------------------------------------------------------ lines
def append_record(fd: int, data: bytes, path: str | os.PathLike) -> None:
    """Append ``data`` (one or more whole lines) to the file open as ``fd``, all of it or none of it: a short or
    failed write (disk full) is truncated back off, so readers never see a torn record written by us."""
    start = os.lseek(fd, 0, os.SEEK_END)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
    except OSError as err:
        try:
            os.ftruncate(fd, start)
        except OSError:
            pass
        if is_disk_full(err):
            raise disk_full_error(path, len(data)) from None
        raise


def cut_torn_tail(path: str | os.PathLike) -> int:
    """Truncate a text log after its last newline (a record cut by a crash or a full disk); bytes removed."""
    path = Path(path)
    if not path.is_file():
        return 0
    with path.open("rb+") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return 0
        f.seek(max(0, size - 1))
        if f.read(1) == b"\n":
            return 0
        keep, block = 0, 1 << 16
        pos = size
        while pos > 0:  # the last newline, reading backwards
            start = max(0, pos - block)
            f.seek(start)
            chunk = f.read(pos - start)
            i = chunk.rfind(b"\n")
            if i >= 0:
                keep = start + i + 1
                break
            pos = start
        f.truncate(keep)
        return size - keep


# ------------------------------------------------------------------------------------------------ processes
def _this_host() -> str:
    return socket.gethostname()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as err:
        if err.errno in (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN):
            return False
        raise


# ------------------------------------------------------------------------------------------------ lock
class OutputLock:
    """An exclusive lock on an output directory for the life of a run: ``.<name>.lock`` beside it.

    The lock is a kernel advisory lock (``flock``) on that file, so it is released whatever kills the holder;
    the file's content (pid, host, start time, command) names the holder in the error a second writer gets, and
    in the message when a later run takes over a lock left behind by a dead holder.
    """

    def __init__(self, out_dir: str | os.PathLike, what: str = "run") -> None:
        out = Path(out_dir).expanduser().absolute()
        self.out_dir = out
        self.path = out.parent / f".{out.name}.lock"
        self.what = what
        self._fd: int | None = None

    def acquire(self) -> OutputLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(20):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            if not _try_flock(fd):
                holder = self._read(fd)
                os.close(fd)
                raise OutputLockedError(
                    f"{self.out_dir} is in use by another {self.what} ({self._describe(holder)}; lock file "
                    f"{self.path}); wait for it to finish, stop it, or choose another output directory"
                )
            try:  # the holder may have removed the file between our open and flock: lock the file that is there
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            previous = self._read(fd)
            if previous.get("pid") and (previous.get("pid"), previous.get("host")) != (
                os.getpid(),
                _this_host(),
            ):
                print(
                    f"moe-lab: taking over the lock on {self.out_dir} left by a {self.what} that is gone "
                    f"({self._describe(previous)})",
                    file=sys.stderr,
                    flush=True,
                )
            info = {
                "pid": os.getpid(),
                "host": _this_host(),
                "started": time.time(),
                "command": " ".join(sys.argv),
            }
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
            self._fd = fd
            return self
        raise OutputLockedError(f"{self.out_dir}: could not take the lock file {self.path}; try again")

    @staticmethod
    def _read(fd: int) -> dict:
        try:
            data = os.pread(fd, 1 << 16, 0)
            return json.loads(data) if data.strip() else {}
        except (OSError, ValueError):
            return {}

    @staticmethod
    def _describe(holder: dict) -> str:
        if not holder:
            return "holder unknown"
        started = holder.get("started")
        since = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(started)) if started else ""
        return f"pid {holder.get('pid')} on host {holder.get('host')}{since}"

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.unlink(self.path)  # still holding the flock: a waiter re-checks the inode and retries
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> OutputLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def lock_output(out_dir: str | os.PathLike, what: str = "run") -> OutputLock:
    """`OutputLock` on ``out_dir``, taken now (raises `OutputLockedError` when a live process holds it)."""
    return OutputLock(out_dir, what).acquire()


# ------------------------------------------------------------------------------------------------ temporaries
def remove_abandoned(path: Path) -> bool:
    """Remove a temporary directory whose writer is gone: its ``.in-use`` flock is free, or (no such file: an
    older writer) the pid in its name is dead on this host and it has not changed for a minute. True if removed."""
    marker = path / IN_USE
    if marker.is_file():
        try:
            fd = os.open(marker, os.O_RDWR)
        except FileNotFoundError:
            fd = None
        if fd is not None:
            try:
                if not _try_flock(fd):
                    return False  # a live writer
                shutil.rmtree(path, ignore_errors=True)
                return True
            finally:
                os.close(fd)
    parts = path.name.rsplit(".tmp-", 1)
    pid = parts[1].split("-")[0] if len(parts) == 2 else ""
    try:
        idle = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return False
    if pid.isdigit() and not _pid_alive(int(pid)) and idle > 60:
        shutil.rmtree(path, ignore_errors=True)
        return True
    return False


@contextmanager
def claimed_directory(path: Path) -> Iterator[Path]:
    """Create the directory ``path`` and hold its ``.in-use`` flock while the block runs; remove it afterwards
    unless the block moved it away. A process killed inside leaves it with its flock free, which tells the next
    writer (`remove_abandoned`) it may go."""
    path.mkdir()
    in_use = os.open(path / IN_USE, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(in_use, fcntl.LOCK_EX)
    try:
        yield path
    finally:
        os.close(in_use)
        if path.exists():
            shutil.rmtree(path, ignore_errors=True)


@contextmanager
def scratch_directory(root: str | os.PathLike, prefix: str) -> Iterator[Path]:
    """A private working directory ``<root>/<prefix>.tmp-<pid>-<id>``, removed when the block ends; the ones
    killed processes left under ``root`` with the same prefix are removed first (their flock is free)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for path in root.glob(f"{prefix}.tmp-*"):
        if path.is_dir():
            remove_abandoned(path)
    with claimed_directory(root / f"{prefix}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}") as path:
        yield path


def clean_abandoned_temporaries(out: Path) -> list[Path]:
    """Temporaries of `atomic_directory` for ``out`` left by killed writers (``.<name>.tmp-*``), removed."""
    removed = []
    if out.parent.is_dir():
        for path in out.parent.glob(f".{out.name}.tmp-*"):
            if path.is_dir() and remove_abandoned(path):
                removed.append(path)
    return removed


def replace_path(src: Path, dst: Path) -> None:
    """Move ``src`` to ``dst``, replacing what is there; a directory in the way is renamed aside first (rename
    cannot replace a non-empty directory, nor put a directory over a link) and removed after, so ``dst`` is never
    missing and never mixed."""
    if dst.is_symlink() or dst.is_dir():
        old = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(dst, old)
        os.replace(src, dst)
        old.unlink() if old.is_symlink() else shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)


def check_output_dir(
    out_dir: str | os.PathLike, overwrite: bool = False, error_cls: type[MoELabError] = MoELabError
) -> Path:
    """The rule `atomic_directory` applies, for a command to check before anything expensive: ``out_dir`` is
    absent or empty, or ``overwrite`` says to replace it. Returns its absolute path."""
    out = Path(out_dir).expanduser().absolute()
    if out.exists() and not out.is_dir():
        raise error_cls(f"{out} exists and is not a directory; choose another output directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise error_cls(
            f"{out} is not empty; choose another output directory or pass --overwrite (overwrite=True) "
            "to replace it"
        )
    return out


def fsync_file(path: str | os.PathLike) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_directory(path: str | os.PathLike) -> None:
    """Flush a directory's entries (a rename or a new file in it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Every file and directory under ``root`` (links not followed), flushed to disk."""
    for directory, _, files in os.walk(root):
        for name in files:
            path = Path(directory) / name
            if not path.is_symlink():
                fsync_file(path)
        fsync_directory(directory)


@contextmanager
def atomic_directory(
    out_dir: str | os.PathLike, overwrite: bool = False, error_cls: type[MoELabError] = MoELabError
) -> Iterator[Path]:
    """Yield a temporary directory next to ``out_dir``, flushed to disk and renamed into place only when the
    block succeeds.

    A non-empty ``out_dir`` is refused (with ``error_cls``) unless ``overwrite``; then it is replaced only
    after the new one is complete. On any error the temporary directory is removed and ``out_dir`` is untouched;
    a full disk raises `DiskFullError` naming the directory. The temporary holds ``.in-use`` (flock'ed) while
    it is written, so a later writer can tell an abandoned one (removed) from a concurrent one (left alone).
    """
    out = check_output_dir(out_dir, overwrite, error_cls)
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_abandoned_temporaries(out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    with claimed_directory(tmp), disk_full_guard(out):
        yield tmp
        fsync_tree(tmp)  # the data is on disk before the rename makes it visible
        # .in-use goes along and is removed only after the rename: a writer killed before it leaves a
        # temporary whose lock is free, which the next writer removes
        replace_path(tmp, out)
        os.unlink(out / IN_USE)
        fsync_directory(out)
        fsync_directory(out.parent)


def check_output_file(
    path: str | os.PathLike, overwrite: bool = False, error_cls: type[MoELabError] = MoELabError
) -> Path:
    """`check_output_dir` for a one-file output: ``path`` is absent, or ``overwrite`` says to replace it."""
    out = Path(path).expanduser().absolute()
    if out.is_dir():
        raise error_cls(f"{out} is a directory; give the file to write")
    if out.exists() and not overwrite:
        raise error_cls(
            f"{out} exists; choose another output file or pass --overwrite (overwrite=True) to replace it"
        )
    return out


@contextmanager
def atomic_file(
    path: str | os.PathLike, overwrite: bool = False, error_cls: type[MoELabError] = MoELabError
) -> Iterator[Path]:
    """`atomic_directory` for an output that is one file (a GGUF): yield a temporary path beside ``path``, flushed
    to disk and renamed over ``path`` only when the block succeeds. An existing ``path`` is refused (with
    ``error_cls``) unless ``overwrite``; on any error the temporary goes and ``path`` is untouched."""
    out = check_output_file(path, overwrite, error_cls)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with disk_full_guard(out):
            yield tmp
            fsync_file(tmp)
            os.replace(tmp, out)
            fsync_directory(out.parent)
    finally:
        tmp.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------------ run outputs
def previous_outputs(out_dir: str | os.PathLike, patterns: tuple[str, ...]) -> list[str]:
    """What of a run's outputs (glob ``patterns`` relative to ``out_dir``) an earlier run left there."""
    out = Path(out_dir)
    if not out.is_dir():
        return []
    return sorted(str(p.relative_to(out)) for pattern in patterns for p in out.glob(pattern))


def refuse_previous_outputs(
    out_dir: str | os.PathLike,
    patterns: tuple[str, ...],
    hint: str,
    what: str = "outputs",
    error_cls: type[MoELabError] = MoELabError,
) -> None:
    """The rule every run command follows (train, finetune): an output directory holding an earlier run's outputs
    is not written into unless the user said how (``hint``: --resume for training, --overwrite for fine-tuning)."""
    found = previous_outputs(out_dir, patterns)
    if found:
        shown = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
        raise error_cls(
            f"{out_dir} already holds {what} of an earlier run ({shown}); {hint}, or choose "
            f"another output directory"
        )


@contextmanager
def staged_outputs(out_dir: str | os.PathLike, replace: tuple[str, ...] = ()) -> Iterator[Path]:
    """A staging directory inside ``out_dir`` for a run's outputs: on success each entry is moved into ``out_dir``
    (replacing an entry of the same name), ``summary.json`` last if there is one, so it marks a complete set; on
    failure the staging directory goes and ``out_dir`` keeps only what was there before. On success, earlier
    outputs matching ``replace`` (glob patterns) are removed first. Files other writers put in ``out_dir`` (an
    MLflow run reference, say) are left alone. Abandoned stagings of killed runs are removed."""
    out = Path(out_dir).expanduser().absolute()
    out.mkdir(parents=True, exist_ok=True)
    for path in out.glob(".staging.tmp-*"):
        if path.is_dir():
            remove_abandoned(path)
    stage = out / f".staging.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    with claimed_directory(stage), disk_full_guard(out):
        yield stage
        for name in previous_outputs(out, replace):
            stale = out / name
            shutil.rmtree(stale) if stale.is_dir() and not stale.is_symlink() else stale.unlink()
        # .in-use stays locked until every entry moved: a run killed among the moves leaves a staging
        # directory the next run removes
        entries = sorted(
            (p for p in stage.iterdir() if p.name != IN_USE), key=lambda p: p.name == "summary.json"
        )
        fsync_tree(stage)  # on disk before the moves make it visible
        for entry in entries:
            replace_path(entry, out / entry.name)
        fsync_directory(out)
