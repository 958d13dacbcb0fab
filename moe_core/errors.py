"""Errors the library raises on bad input; the CLI prints them without a traceback and exits non-zero."""

import difflib


class MoELabError(Exception):
    """Base class: the message says what was wrong, where, and what to do. Never training text or weights."""


def did_you_mean(name: str, choices) -> str:
    """``"; did you mean 'num_experts'?"`` when a close match exists, else ``""`` (for unknown-field errors)."""
    close = difflib.get_close_matches(name, sorted(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""
