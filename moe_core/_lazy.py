"""Lazy re-exports for package ``__init__`` files (PEP 562), one mechanism for every package that needs it.

Why lazy at all: Python runs a package's ``__init__`` before any of its submodules, so a package that
re-exports names from modules importing torch, transformers or pydantic would make every import below it pay
for them. ``moe-lab --help`` imports ``moe_core.cli`` and the ``moe_core.*.cli`` modules to build its parser,
and must stay free of those (tests/test_cli_help.py). Such a package keeps a name -> module table, builds its
``__getattr__`` and ``__dir__`` here, and repeats the same imports under ``if TYPE_CHECKING:`` so that readers
and type checkers see what it depends on (tests/test_lazy_exports.py holds the two in agreement).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping


def lazy_exports(
    package: str, exports: Mapping[str, str], *, requires: Mapping[str, str] | None = None
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package`` that resolve each name of ``exports`` (name -> module,
    absolute or relative to ``package``) on first use. ``requires`` maps a module to one that must be imported
    before it (an import with a side effect, such as registering Auto classes). Names are looked up on every
    access, not cached, so a monkeypatched submodule attribute is what the package returns too."""
    exports = dict(exports)
    requires = dict(requires or {})

    def __getattr__(name: str) -> object:
        module_name = exports.get(name)
        if module_name is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module_name = importlib.util.resolve_name(module_name, package)
        if module_name in requires:
            importlib.import_module(requires[module_name])
        return getattr(importlib.import_module(module_name), name)

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
