"""Tokenizers: train a byte-level BPE (GPT-2 style, `tokenizers`) or load an existing one.

A trained tokenizer has BOS/EOS/PAD special tokens, role markers for chat, and a chat template; it is saved
as a transformers tokenizer directory (`PreTrainedTokenizerFast`), so ``AutoTokenizer.from_pretrained`` loads
it. `tokenizer_hash` identifies a tokenizer by its vocabulary, merges and special tokens, and is stored in
the manifest of prepared data.
"""

from __future__ import annotations

# Lazy: `transformers` (heavy, seconds) loads inside the functions that build a tokenizer; `prepare`
# imports this module, and the flows and `moe-lab run --help-config` import `prepare`.
import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from moe_core.data.errors import DataError

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")
SPECIAL_TOKENS = (PAD, BOS, EOS, *ROLE_TOKENS)  # ids 0..6 in a trained tokenizer
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)  # the byte alphabet plus the special tokens
# What the model's forward takes. transformers' default adds token_type_ids, which our decoder has no use for and
# `model.generate(**tokenizer(text, return_tensors="pt"))` refuses ("model_kwargs are not used by the model").
MODEL_INPUT_NAMES = ("input_ids", "attention_mask")
# The model-config fields that name the tokenizer's special tokens (`special_token_ids`)
SPECIAL_TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")

# Each turn is "<|role|>\n{content}" followed by EOS; generation prompts end with "<|assistant|>\n".
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8000, min_frequency: int = 2) -> Any:
    """Train a byte-level BPE tokenizer on `texts`; returns a `PreTrainedTokenizerFast`."""
    from transformers import PreTrainedTokenizerFast

    if vocab_size < MIN_VOCAB:
        raise ValueError(
            f"vocab_size={vocab_size} is below {MIN_VOCAB} (256 bytes + {len(SPECIAL_TOKENS)} "
            "special tokens); raise it"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=list(ROLE_TOKENS),
        clean_up_tokenization_spaces=False,
        model_input_names=list(MODEL_INPUT_NAMES),
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def load_tokenizer(path_or_id: str | Path) -> Any:
    """A transformers tokenizer from a prepared-data directory (its ``tokenizer/``), a tokenizer directory,
    or a hub id. Raises `DataError` when it cannot be loaded or has no EOS token (packing needs one).
    Its outputs are the model's inputs only (`MODEL_INPUT_NAMES`), also for a tokenizer saved before that was
    set, and a `save_pretrained` of it keeps them."""
    from transformers import AutoTokenizer

    path = Path(path_or_id)
    if (path / "manifest.json").is_file() and (path / "tokenizer").is_dir():
        path = path / "tokenizer"
    try:
        try:
            tok = AutoTokenizer.from_pretrained(str(path) if path.exists() else str(path_or_id))
        except KeyError:  # a model directory whose model_type ("moe_lab") has no registered tokenizer class
            from transformers import PreTrainedTokenizerFast

            tok = PreTrainedTokenizerFast.from_pretrained(str(path))
    except Exception as err:
        msg = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        raise DataError(
            f"tokenizer {str(path_or_id)!r} could not be loaded ({type(err).__name__}: {msg}); pass a "
            "tokenizer directory, a prepared-data directory, or a reachable hub id"
        ) from None
    if tok.eos_token_id is None:
        raise DataError(
            f"tokenizer {str(path_or_id)!r} has no EOS token; packing separates documents with EOS, "
            "so pick a tokenizer that defines one"
        )
    return with_model_input_names(tok)


def with_model_input_names(tokenizer: Any) -> Any:
    """``tokenizer`` returning only `MODEL_INPUT_NAMES` (no token_type_ids), in memory and in what its
    `save_pretrained` writes (transformers saves ``init_kwargs``); returns it."""
    tokenizer.model_input_names = list(MODEL_INPUT_NAMES)
    tokenizer.init_kwargs["model_input_names"] = list(MODEL_INPUT_NAMES)
    return tokenizer


def special_token_ids(tokenizer: Any) -> dict[str, int]:
    """The ids of the tokenizer's BOS, EOS and PAD tokens, keyed by their model-config field
    (`SPECIAL_TOKEN_FIELDS`); a token the tokenizer does not define is left out."""
    ids = {field: getattr(tokenizer, field, None) for field in SPECIAL_TOKEN_FIELDS}
    return {field: int(value) for field, value in ids.items() if value is not None}


def adopt_special_token_ids(model: Any, ids: dict[str, int], *, replace: bool = False) -> None:
    """Set the special-token ids ``ids`` (`special_token_ids`) on ``model.config`` and its generation config, so
    `generate` (and every engine reading ``config.json`` / ``generation_config.json``) stops at EOS and pads
    with PAD. Without ``replace`` only unset ids are filled in (a model saved before they were recorded);
    with it the tokenizer's win (the one a fine-tune frames its data with, as transformers' Trainer aligns
    them, but before the model is used, so nothing warns and the saved configs agree)."""
    for config in (model.config, getattr(model, "generation_config", None)):
        if config is None:
            continue
        for field, value in ids.items():
            if replace or getattr(config, field, None) is None:
                setattr(config, field, value)


def set_model_input_names(directory: str | Path) -> None:
    """Rewrite ``tokenizer_config.json`` in ``directory`` to name `MODEL_INPUT_NAMES` when it is a generic
    ``PreTrainedTokenizerFast`` (``train_tokenizer``'s) without them: a tokenizer copied from an older checkpoint
    or prepared-data directory then loads with ``AutoTokenizer.from_pretrained`` returning only what the model
    takes. Model-specific classes (Llama, Qwen2, GPT-2 ...) name their own inputs, and their files stay as
    they are."""
    path = Path(directory) / "tokenizer_config.json"
    if not path.is_file():
        return
    saved = json.loads(path.read_text(encoding="utf-8"))
    generic = saved.get("tokenizer_class") == "PreTrainedTokenizerFast"
    if generic and saved.get("model_input_names") != list(MODEL_INPUT_NAMES):
        saved["model_input_names"] = list(MODEL_INPUT_NAMES)
        path.write_text(json.dumps(saved, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def tokenizer_hash(tokenizer: Any) -> str:
    """sha256 of the tokenizer's vocabulary, merges, normalizer/pre-tokenizer and special tokens."""
    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    h = hashlib.sha256()
    h.update(json.dumps(backend, sort_keys=True).encode())
    h.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    h.update(str(getattr(tokenizer, "chat_template", None)).encode())
    return h.hexdigest()


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """`CHAT_TEMPLATE` in plain Python, for rendering instruction data before a tokenizer exists."""
    text = BOS + "".join(f"<|{m['role']}|>\n{m['content']}{EOS}" for m in messages)
    return text + ("<|assistant|>\n" if add_generation_prompt else "")
