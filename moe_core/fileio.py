"""Writing directories so that nothing half-written is ever seen: build in a temporary sibling, then rename
into place (an existing directory is swapped out first and removed only once the new one is there)."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from moe_core.errors import MoELabError


@contextmanager
def atomic_directory(out_dir: str | os.PathLike, overwrite: bool = False,
                     error_cls: type[MoELabError] = MoELabError) -> Iterator[Path]:
    """Yield a temporary directory next to ``out_dir``, renamed into place only when the block succeeds.

    A non-empty ``out_dir`` is refused (with ``error_cls``) unless ``overwrite``; then it is replaced only
    after the new one is complete. On any error the temporary directory is removed and ``out_dir`` is untouched.
    """
    out = Path(out_dir).expanduser().absolute()
    if out.exists() and not out.is_dir():
        raise error_cls(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise error_cls(f"{out} is not empty; choose another output directory or pass overwrite=True (--overwrite)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        if out.is_dir():
            old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
