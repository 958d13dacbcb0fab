"""Bits per byte: a language model's loss on raw text, comparable across tokenizers.

Perplexity is per token, and a token is whatever its tokenizer makes it: a 384-entry vocabulary cuts the same
text into more, easier tokens than a 4000-entry one, so their perplexities measure different things. Bits per
byte divides the whole text's negative log-likelihood by its length in UTF-8 bytes instead, which does not
depend on the tokenizer (the measure used for tokenizer-free comparison in e.g. Gao et al. 2020, "The Pile",
section 4, and nanochat's ``evaluate_bpb``)::

    bits_per_byte = sum over every token t of the text of -log2 p(t | tokens before t) / UTF-8 bytes of the text

Every token of a text is predicted exactly once: the text starts after the tokenizer's EOS (how documents are
joined in prepared data), and texts longer than the model's window are cut into windows that overlap by one
token, whose first token is context only. Two models evaluated on the same texts, each with its own
tokenizer, therefore divide by the same number of bytes.

Legend: B = batch (windows of one length), S = window length, V = vocabulary.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from moe_core.data.shards import PackedTokens
from moe_core.data.tokenizer import load_tokenizer
from moe_core.eval.perplexity import EvaluationError


@dataclass(frozen=True)
class ByteLossResult:
    nats: float  # summed negative log-likelihood of every token of the texts
    tokens: int  # predicted tokens (all tokens of the texts, in this model's tokenizer)
    bytes: int  # UTF-8 bytes of the texts: the same for every tokenizer
    text_sha256: str  # which texts (see `text_fingerprint`)

    @property
    def bits_per_byte(self) -> float:
        return self.nats / math.log(2) / self.bytes

    @property
    def bits_per_token(self) -> float:
        return self.nats / math.log(2) / self.tokens

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "bits_per_byte": self.bits_per_byte, "bits_per_token": self.bits_per_token}

    def _repr_markdown_(self) -> str:  # a notebook shows one readable line
        return (
            f"**{self.bits_per_byte:.4f} bits per byte** ({self.bits_per_token:.3f} bits/token) over "
            f"{self.bytes:,} bytes, {self.tokens:,} tokens (text sha256 {self.text_sha256[:12]})"
        )


def text_fingerprint(texts: Sequence[str]) -> str:
    """sha256 over the texts (each length-prefixed, so ["ab", "c"] and ["a", "bc"] differ)."""
    h = hashlib.sha256()
    for text in texts:
        data = text.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def split_texts(data_dir: str | Path, split: str = "validation", max_blocks: int | None = None) -> list[str]:
    """The raw text behind the first ``max_blocks`` blocks of a prepared split: their tokens decoded with
    the data's own (byte-level, lossless) tokenizer, one string per document piece (cut at EOS)."""
    data = PackedTokens(data_dir, split)
    tokenizer = load_tokenizer(Path(data_dir) / "tokenizer")
    n = len(data) if max_blocks is None else min(len(data), max_blocks)
    if n == 0:
        raise EvaluationError(f"{data_dir}: split {split!r} has no blocks to take evaluation text from")
    ids = data.get_batch(list(range(n))).reshape(-1).tolist()
    texts, piece = [], []
    for token in ids + [tokenizer.eos_token_id]:
        if token == tokenizer.eos_token_id:
            if piece:
                texts.append(tokenizer.decode(piece, skip_special_tokens=True))
            piece = []
        else:
            piece.append(token)
    return [t for t in texts if t]


@torch.no_grad()
def evaluate_bits_per_byte(
    model, tokenizer, texts: Sequence[str], window: int | None = None, batch_size: int = 8
) -> ByteLossResult:
    """Negative log-likelihood of ``texts`` under ``model``, tokenized with ``tokenizer`` (the model's own),
    per UTF-8 byte. ``window``: tokens per forward (default: the model's ``max_position_embeddings``)."""
    start = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.bos_token_id
    if start is None:
        raise EvaluationError(
            "bits per byte needs a tokenizer with an EOS or BOS token to start each text from"
        )
    window = window or model.config.max_position_embeddings
    if window < 2:
        raise EvaluationError(f"window={window}: needs at least 2 tokens (one of context, one to predict)")
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    if n_bytes == 0:
        raise EvaluationError("no text to evaluate bits per byte on")
    windows: list[list[int]] = []
    for text in texts:
        ids = [start] + tokenizer.encode(text, add_special_tokens=False)
        # windows overlap by one token: the last token of one is the (unpredicted) first of the next
        windows += [ids[i : i + window] for i in range(0, len(ids) - 1, window - 1)]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    nats, tokens = 0.0, 0
    # batch only windows of the same length: no padding, which would take expert capacity (Switch-style
    # routing drops tokens per batch) and change what the real tokens score
    by_length: dict[int, list[list[int]]] = {}
    for w in windows:
        by_length.setdefault(len(w), []).append(w)
    try:
        for same in by_length.values():
            for b in range(0, len(same), batch_size):
                ids_BS = torch.tensor(same[b : b + batch_size], dtype=torch.long, device=device)
                if int(ids_BS.max()) >= model.config.vocab_size:
                    raise EvaluationError(
                        f"token id {int(ids_BS.max())} >= the model's vocab_size "
                        f"{model.config.vocab_size}: pass the model's own tokenizer"
                    )
                logits_BSV = model(ids_BS, use_cache=False).logits.float()
                nats += float(
                    F.cross_entropy(
                        logits_BSV[:, :-1].reshape(-1, logits_BSV.shape[-1]),
                        ids_BS[:, 1:].reshape(-1),
                        reduction="sum",
                    )
                )
                tokens += ids_BS[:, 1:].numel()
    finally:
        model.train(was_training)
    return ByteLossResult(nats=nats, tokens=tokens, bytes=n_bytes, text_sha256=text_fingerprint(texts))
