"""Errors of the data pipeline. Messages name the file (or source) and the problem and say what to do;
they never quote the data itself (row indices and hashes only)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from moe_core.errors import MoELabError

if TYPE_CHECKING:
    from moe_core.data.validation import ValidationResult


class DataError(MoELabError):
    """Bad input data or a bad prepared-data directory: unreadable, malformed, corrupt or mismatched."""


class DataValidationError(DataError):
    """The data loaded but failed its expectation suite; `result` holds the per-expectation outcome."""

    def __init__(self, message: str, result: ValidationResult) -> None:
        super().__init__(message)
        self.result = result
