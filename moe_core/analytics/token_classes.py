"""Token classes for specialization analytics: what kind of text a vocabulary entry is.

A class belongs to a token id (a vocabulary entry), not to a position, so the table is computed once per
tokenizer (`token_class_table`) and looked up for every routed token. Rules, on the decoded token string
with surrounding whitespace removed (first match wins):

- ``whitespace``: nothing left (spaces, tabs, newlines, indentation runs);
- ``keyword``: a Python keyword or soft keyword (`keyword.iskeyword`, `keyword.issoftkeyword`);
- ``number``: digits, with optional ``_``, ``.``, exponent, or a 0x/0o/0b literal;
- ``punctuation``: no letter, digit or underscore at all (operators, brackets, quotes);
- ``identifier``: a Python name that does not look like an English word: has ``_`` or a digit, is
  camelCase, or is a common builtin/convention (``self``, ``len``, ``kwargs``, ...);
- ``prose_word``: letters only (a capital first letter and apostrophes allowed);
- ``other``: anything else (mixed pieces like ``(self`` or ``.__``, undecodable byte pieces).
"""

from __future__ import annotations

import keyword
import re

import numpy as np

TOKEN_CLASSES: tuple[str, ...] = (
    "identifier",
    "keyword",
    "number",
    "punctuation",
    "whitespace",
    "prose_word",
    "other",
)

_NUMBER = re.compile(
    r"(?:\d[\d_]*\.?[\d_]*(?:[eE][+-]?\d+)?|\.\d[\d_]*|0[xX][0-9a-fA-F_]+|0[oO][0-7_]+|0[bB][01_]+)[jJ]?"
)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_WORD = re.compile(r"[A-Za-z][a-z]*(?:'[a-z]+)?|[A-Z]+")
_CAMEL = re.compile(r"[a-z][A-Z]")
_CODE_NAMES = frozenset(
    "self cls args kwargs len print range isinstance str int float bool dict list tuple set bytes repr "
    "enumerate zip super getattr setattr hasattr sorted os sys re np init".split()
)


def classify_token(text: str) -> str:
    """The class (one of `TOKEN_CLASSES`) of one decoded token string."""
    s = text.strip()
    if not s:
        return "whitespace"
    if keyword.iskeyword(s) or keyword.issoftkeyword(s):
        return "keyword"
    if _NUMBER.fullmatch(s):
        return "number"
    if not any(ch.isalnum() or ch == "_" for ch in s):
        return "punctuation"
    if _NAME.fullmatch(s):
        if "_" in s or any(ch.isdigit() for ch in s) or _CAMEL.search(s) or s in _CODE_NAMES:
            return "identifier"
        if _WORD.fullmatch(s):
            return "prose_word"
        return "identifier"  # e.g. "HTTPServer"-like mixed capitals
    if _WORD.fullmatch(s):  # words with an apostrophe
        return "prose_word"
    return "other"


def token_class_table(tokenizer, vocab_size: int | None = None) -> np.ndarray:
    """Class index (into `TOKEN_CLASSES`) of every token id ``0 .. vocab_size-1``, shape [V], int64.

    Ids the tokenizer does not know (a model vocabulary larger than the tokenizer's) are ``other``.
    """
    vocab_size = vocab_size or len(tokenizer)
    index = {name: i for i, name in enumerate(TOKEN_CLASSES)}
    table_V = np.full(vocab_size, index["other"], dtype=np.int64)
    for token_id in range(min(vocab_size, len(tokenizer))):
        table_V[token_id] = index[classify_token(tokenizer.decode([token_id]))]
    return table_V
