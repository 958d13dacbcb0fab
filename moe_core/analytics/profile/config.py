"""How a router profile is collected (`ProfileConfig`), and the error every part of it raises."""

from __future__ import annotations

from dataclasses import dataclass

from moe_core.errors import MoELabError


class ProfileError(MoELabError):
    """A profile that cannot be collected, written or read (bad inputs, missing files, newer version)."""


@dataclass(frozen=True)
class ProfileConfig:
    """How to collect a router profile."""

    top_tokens: int = 10  # most frequent token ids kept per expert
    rare_fraction: float = 0.1  # an expert below this fraction of the mean load is "rare"
    max_batches: int | None = None  # stop after this many batches (None: the whole iterable)
    # decode each top token id into its vocabulary piece (a string from the tokenizer). Off by default:
    # pieces with counts say which words a corpus uses, so whoever records a profile (MLflow) opts in.
    include_vocab_pieces: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.top_tokens, int) or self.top_tokens < 0:
            raise ValueError(f"ProfileConfig.top_tokens={self.top_tokens!r}: must be an integer >= 0")
        if not 0.0 <= self.rare_fraction <= 1.0:
            raise ValueError(f"ProfileConfig.rare_fraction={self.rare_fraction!r}: must be within [0, 1]")
        if self.max_batches is not None and self.max_batches < 1:
            raise ValueError(f"ProfileConfig.max_batches={self.max_batches!r}: must be >= 1 or None")
