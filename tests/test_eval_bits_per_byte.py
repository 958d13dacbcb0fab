"""Bits per byte: every token of the text predicted once, divided by the raw UTF-8 bytes, whatever the
tokenizer, so models with different vocabularies are compared on the same quantity."""

from __future__ import annotations

import math

import pytest
import torch

from moe_core import MoEForCausalLM
from moe_core.config import get_config
from moe_core.data.sources import builtin_corpus
from moe_core.data.tokenizer import train_tokenizer
from moe_core.eval.bits_per_byte import evaluate_bits_per_byte, split_texts, text_fingerprint
from moe_core.eval.perplexity import evaluate_loss
from tests.helpers import randomize_

pytestmark = pytest.mark.usefixtures("one_thread")

TEXTS = ["déjà vu: naïve café ☕ costs 3€\n", "def f(x):\n    return x * 2\n", "a"]


@pytest.fixture(scope="module")
def tokenizers():
    corpus = [d.text for d in builtin_corpus(40)]
    return {v: train_tokenizer(corpus, vocab_size=v) for v in (300, 700)}


def model_for(tokenizer, seed=0):
    torch.manual_seed(seed)
    model = MoEForCausalLM(get_config("switch-tiny", vocab_size=len(tokenizer), max_position_embeddings=64))
    randomize_(model, seed)
    return model.eval()


def test_the_denominator_is_the_raw_bytes_whatever_the_tokenizer(tokenizers):
    n_bytes = sum(len(t.encode("utf-8")) for t in TEXTS)
    results = {}
    for vocab, tokenizer in tokenizers.items():
        results[vocab] = r = evaluate_bits_per_byte(model_for(tokenizer), tokenizer, TEXTS, window=8)
        assert r.bytes == n_bytes  # per raw byte, not per token
        assert r.tokens == sum(len(tokenizer.encode(t, add_special_tokens=False)) for t in TEXTS)
        assert r.text_sha256 == text_fingerprint(TEXTS)
    assert results[300].tokens > results[700].tokens  # the smaller vocabulary cuts the text finer


def test_every_token_is_predicted_once_across_windows(tokenizers):
    """Short windows (overlapping by one token) sum to exactly the loss of one long forward pass."""
    tokenizer = tokenizers[300]
    model = model_for(tokenizer)
    text = TEXTS[:2]
    long = evaluate_bits_per_byte(model, tokenizer, text, window=64)
    short = evaluate_bits_per_byte(model, tokenizer, text, window=5, batch_size=3)
    assert short.tokens == long.tokens
    assert short.bits_per_byte != pytest.approx(0.0)
    # one window per text, scored with the perplexity code: the same nats
    nats = sum(
        evaluate_loss(
            model, [torch.tensor([tokenizer.eos_token_id] + tokenizer.encode(t, add_special_tokens=False))]
        ).loss
        * len(tokenizer.encode(t, add_special_tokens=False))
        for t in text
    )
    assert long.nats == pytest.approx(nats, rel=1e-5)
    # shorter windows see less context, so the value differs a little, but counts every token once
    assert short.nats == pytest.approx(long.nats, rel=0.5)


def test_a_uniform_model_costs_log2_vocab_bits_per_token(tokenizers):
    for tokenizer in tokenizers.values():
        model = model_for(tokenizer)
        torch.nn.init.zeros_(model.lm_head.weight)  # every next token equally likely
        r = evaluate_bits_per_byte(model, tokenizer, TEXTS, window=16)
        V = model.config.vocab_size
        assert r.bits_per_byte == pytest.approx(r.tokens * math.log2(V) / r.bytes, rel=1e-5)


def test_split_texts_decodes_a_prepared_split(tmp_path):
    from moe_core.data import prepare

    data_dir = prepare.prepare(
        prepare.PrepareConfig(max_documents=12, vocab_size=300, seq_len=32, validate=False),
        tmp_path / "prepared",
    )
    texts = split_texts(data_dir, "validation", max_blocks=2)
    assert texts and all(isinstance(t, str) and t for t in texts)
    assert "<|eos|>" not in "".join(texts)
    assert split_texts(data_dir, "validation", max_blocks=2) == texts  # the same text every time
