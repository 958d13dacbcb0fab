"""The project's own prompt set for generations: short starts of Python code and of English prose, in the
style of the built-in corpus (the standard library's code and docstrings). Written for this project, so
generations from them can be printed and stored freely. Change them only with a new `PROMPT_SET_VERSION`,
so generations stay comparable across runs.
"""

from __future__ import annotations

from dataclasses import dataclass

PROMPT_SET_VERSION = 1


@dataclass(frozen=True)
class Prompt:
    name: str
    domain: str  # "code" or "prose", the built-in corpus's domain labels
    text: str


PROMPTS: tuple[Prompt, ...] = (
    Prompt("def_function", "code", "def read_lines(path):\n    "),
    Prompt("class_init", "code", "class Counter:\n    def __init__(self, start=0):\n        self."),
    Prompt("import_block", "code", "import os\nimport sys\n\n\ndef main(argv"),
    Prompt("for_loop", "code", "    for index, item in enumerate(items):\n        if "),
    Prompt("raise_error", "code", "    if value < 0:\n        raise ValueError("),
    Prompt("docstring_return", "prose", "Return a new list containing"),
    Prompt("docstring_module", "prose", "This module provides functions for"),
    Prompt("docstring_note", "prose", "Note that the result is"),
)
