"""Byte-level BPE tokenizer: trained, saved as a transformers directory, loaded back; chat template."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from moe_core.data.errors import DataError
from moe_core.data.sources import builtin_corpus
from moe_core.data.tokenizer import (
    BOS,
    EOS,
    PAD,
    load_tokenizer,
    render_chat,
    set_model_input_names,
    special_token_ids,
    tokenizer_hash,
    train_tokenizer,
)


@pytest.fixture(scope="module")
def texts():
    return [d.text for d in builtin_corpus(16)]


def test_train_save_load_roundtrip(tmp_path, texts):
    tok = train_tokenizer(texts, vocab_size=400)
    assert len(tok) == 400
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (BOS, EOS, PAD)
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert tokenizer_hash(loaded) == tokenizer_hash(tok)
    assert load_tokenizer(tmp_path).eos_token_id == tok.eos_token_id
    sample = texts[1][:500] + " ünïcode ✓"
    ids = loaded(sample, add_special_tokens=False)["input_ids"]
    assert loaded.decode(ids) == sample  # byte-level: lossless
    assert max(ids) < 400


def test_outputs_are_the_model_inputs_only_also_for_a_tokenizer_saved_without_them(tmp_path, texts):
    inputs = {"input_ids", "attention_mask"}  # no token_type_ids: generate() refuses them
    tok = train_tokenizer(texts, vocab_size=300)
    assert set(tok("hello")) == inputs
    tok.save_pretrained(tmp_path / "new")
    assert set(AutoTokenizer.from_pretrained(tmp_path / "new")("hello")) == inputs
    assert special_token_ids(tok) == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}

    old = tmp_path / "old"  # as tokenizers were saved before: transformers' default inputs
    tok.save_pretrained(old)
    config = json.loads((old / "tokenizer_config.json").read_text())
    del config["model_input_names"]
    (old / "tokenizer_config.json").write_text(json.dumps(config))
    # (transformers 4 then returned token_type_ids too; transformers 5's tokenizers no longer add them unasked)
    loaded = load_tokenizer(old)
    assert set(loaded("hello")) == inputs
    loaded.save_pretrained(tmp_path / "resaved")  # and what it saves keeps them
    assert set(AutoTokenizer.from_pretrained(tmp_path / "resaved")("hello")) == inputs
    set_model_input_names(old)  # a copied directory, fixed in place (exports)
    assert set(AutoTokenizer.from_pretrained(old)("hello")) == inputs


def test_training_is_deterministic_and_vocab_matters(texts):
    a, b = train_tokenizer(texts, 400), train_tokenizer(texts, 400)
    assert tokenizer_hash(a) == tokenizer_hash(b)
    assert tokenizer_hash(train_tokenizer(texts, 450)) != tokenizer_hash(a)
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(texts, 100)


def test_chat_template_matches_render_chat(texts):
    tok = train_tokenizer(texts, 300)
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]
    assert tok.apply_chat_template(messages, tokenize=False) == render_chat(messages)
    prompt = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == render_chat(messages[:2], add_generation_prompt=True)
    ids = tok(render_chat(messages), add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.bos_token_id and ids.count(tok.eos_token_id) == 3  # special tokens stay single ids


def test_load_tokenizer_missing_path_is_clear(tmp_path):
    with pytest.raises(DataError, match="could not be loaded"):
        load_tokenizer(tmp_path / "nope")
