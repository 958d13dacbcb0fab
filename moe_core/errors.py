"""Errors the library raises on bad input; the CLI prints them without a traceback and exits non-zero."""


class MoELabError(Exception):
    """Base class: the message says what was wrong, where, and what to do. Never training text or weights."""
