"""Errors the library raises on bad input; the CLI prints them without a traceback and exits non-zero."""

import difflib


class MoELabError(Exception):
    """Base class: the message says what was wrong, where, and what to do. Never training text or weights."""


def did_you_mean(name: str, choices) -> str:
    """``"; did you mean 'num_experts'?"`` when a close match exists, else ``""`` (for unknown-field errors)."""
    close = difflib.get_close_matches(name, sorted(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _in_order(names) -> list[str]:
    """Parameter names by name with layer numbers compared as numbers (transformers 5 reports sets)."""
    return sorted(
        names, key=lambda name: [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split(".")]
    )


def weight_mismatch(missing, unexpected) -> str:
    """What a ``load_state_dict(strict=False)`` found wrong, for an error message: how many tensors are missing
    and unexpected, and the first of each by name (``"missing 12 tensors, first model.layers.0.mlp..."``)."""
    parts = [
        f"{what} {len(keys)} tensor{'s' if len(keys) != 1 else ''}, first {keys[0]}"
        for what, keys in (("missing", _in_order(missing)), ("unexpected", _in_order(unexpected)))
        if keys
    ]
    return "; ".join(parts) or "nothing missing or unexpected"
