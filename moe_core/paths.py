"""Model and data paths given on the command line, checked before anything heavy loads.

A path that does not exist fails at once with "not found", instead of being taken for a Hugging Face hub id
and retried over the network (``runs/nope`` is a valid hub id). Arguments that also accept a hub id
(``convert from-hf``, fine-tuning's ``model.path``) treat a name as local when it looks like a path, and a hub
id with ``HF_HUB_OFFLINE`` set must be in the hub cache.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from moe_core.errors import MoELabError


class PathNotFoundError(MoELabError, FileNotFoundError):
    """A model or data path given by the user does not exist."""


def hub_offline() -> bool:
    # read at call time (huggingface_hub reads it once, at import)
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def require_local(path: str | os.PathLike, what: str = "model") -> Path:
    """``path`` as a Path when it exists; otherwise `PathNotFoundError` saying so."""
    local = Path(path).expanduser()
    if not local.exists():
        raise PathNotFoundError(f"{what} {path}: not found (no such file or directory)")
    return local


def looks_local(name: str) -> bool:
    """A name meant as a local path rather than a hub id ``owner/name``: starts with ``.``, ``/`` or ``~``,
    has no or several slashes, or its first part is an existing local directory (``runs/a``)."""
    return (
        name.startswith((".", "/", "~"))
        or name.count("/") != 1
        or os.sep != "/"
        and os.sep in name
        or Path(name.split("/")[0]).is_dir()
    )


def require_model_source(name: str | os.PathLike, what: str = "model") -> None:
    """For arguments that take a local directory or a hub id: a local-looking name must exist, and a hub id
    must be in the hub cache when HF_HUB_OFFLINE is set (one line instead of retries and a traceback)."""
    name = str(name)
    if Path(name).expanduser().exists():
        return
    if looks_local(name):
        raise PathNotFoundError(f"{what} {name}: not found (no such directory)")
    from huggingface_hub import HfApi, try_to_load_from_cache  # heavy (~0.2 s): kept off `moe-lab --help`

    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return
    if hub_offline():
        raise PathNotFoundError(
            f"{what} {name}: not a local directory, and HF_HUB_OFFLINE is set and the hub "
            "cache holds no copy; download it where the hub is reachable"
        )
    try:  # one request, so an unreachable hub is one line now rather than retries and a traceback later
        HfApi().model_info(name, timeout=5)
    except Exception as err:  # no network, no such repo, gated: all end here
        raise PathNotFoundError(
            f"{what} {name}: not a local directory, and the hub did not give it "
            f"({type(err).__name__}); pass a local directory, or retry where the hub is "
            "reachable"
        ) from None


URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(location: str | os.PathLike) -> bool:
    """``scheme://...``: a location fsspec opens (prepared data: `moe_core.data.shards.prepared_dir`)."""
    return bool(URL.match(str(location)))


def existing_path(what: str, urls: bool = False):
    """An argparse ``type=`` that fails the parse with "not found" (exit 2, before any import); with ``urls``
    a URL passes as it is (its reader checks it)."""

    def check(value: str) -> str:
        if urls and is_url(value):
            return value
        try:
            require_local(value, what)
        except PathNotFoundError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        return value

    check.__name__ = what.replace(" ", "_")  # argparse names the type in its messages
    return check


def lab_data_dir() -> Path:
    """The lab's own data directory: prepared data, fetched remote data and every `datasets` cache of ours live
    under it, never in ``~/.cache/huggingface``. ``$MOE_LAB_DATA_CACHE``, else ``~/.cache/moe-lab/data``."""
    return Path(os.environ.get("MOE_LAB_DATA_CACHE") or Path.home() / ".cache" / "moe-lab" / "data")
