"""How a fine-tuned model's prompts are framed: by a chat template, or plainly (no template at all).

A fine-tune frames its instruction data one of two ways (``data.chat_template``):

- a chat template (the tokenizer's own, a built-in one or a Jinja file; `moe_core.data.chat_template`): TRL's
  conversational prompt/completion rows, rendered by ``apply_chat_template``;
- ``plain`` (`PLAIN`): no template, for base models that ship without one (OLMoE-1B-7B, Mixtral-8x7B base). The
  prompt's turns are written one after the other, each followed by a newline, then the answer and EOS:

      "<instruction>\\n<answer><eos>"       (alpaca ``input`` follows the instruction after a blank line)

  no role markers, no special tokens but the tokenizer's own (its BOS when it adds one, as
  ``tokenizer(text)`` does) and the EOS that ends the answer. These are TRL's non-conversational
  prompt/completion rows: TRL tokenizes the prompt and prompt + answer with ``tokenizer(text)``, appends EOS
  to the answer, and trains on the answer's tokens only (``completion_only``). The newline ends the prompt on
  a token boundary (byte-level BPE and SentencePiece both keep a single trailing newline a token of its own),
  so the prompt's tokens are a prefix of prompt + answer's, at training and at generation alike.

The choice is saved as ``prompt_framing.json`` beside the tokenizer of every output a fine-tune writes
(adapter/, merged/, hf/); `moe-lab generate` and `moe-lab eval --generate` read it (`read_framing` on the
directory `moe_core.loading.tokenizer_dir` names) and frame each prompt as a one-turn conversation the way
training framed it (`PromptFraming.encode_prompt`). A model without the file is prompted with the text as given.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from moe_core.errors import MoELabError

PLAIN = "plain"  # the ``data.chat_template`` value that frames data without a template
FRAMING_FILE = "prompt_framing.json"
PLAIN_TURN_END = "\n"  # what follows each prompt turn in plain framing


def plain_text(turns: list[dict[str, Any]]) -> str:
    """The prompt turns (``{"role", "content"}``) as plain text: each turn's content followed by a newline."""
    return "".join(str(turn.get("content") or "") + PLAIN_TURN_END for turn in turns)


@dataclass(frozen=True)
class PromptFraming:
    """How prompts are framed: ``chat_template`` (the tokenizer's, saved with it) or ``plain`` (`plain_text`)."""

    kind: Literal["chat_template", "plain"]

    def encode_prompt(self, tokenizer, prompt: str) -> list[int]:
        """The token ids of one user prompt framed as training framed its prompts: the chat template with the
        generation prompt (no further special tokens, as TRL renders it), or the plain text as ``tokenizer``
        encodes it (with its own BOS when it adds one)."""
        if self.kind == PLAIN:
            return list(tokenizer(plain_text([{"role": "user", "content": prompt}]))["input_ids"])
        ids = (
            tokenizer.apply_chat_template(  # return_dict=False: the ids (transformers 5's default is a dict)
                [{"role": "user", "content": prompt}],
                tokenize=True,
                add_generation_prompt=True,
                return_dict=False,
            )
        )
        return list(ids)

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / FRAMING_FILE
        path.write_text(json.dumps({"framing": self.kind}, indent=2) + "\n", encoding="utf-8")
        return path


def framing_for(chat_template: str | None) -> PromptFraming:
    """The framing a ``data.chat_template`` value gives: plain for `PLAIN`, else the chat template."""
    return PromptFraming(PLAIN if chat_template == PLAIN else "chat_template")


def read_framing(directory: str | Path | None) -> PromptFraming | None:
    """The framing saved in ``directory`` (`FRAMING_FILE`); None when there is none (prompts as given)."""
    if directory is None or not (Path(directory) / FRAMING_FILE).is_file():
        return None
    path = Path(directory) / FRAMING_FILE
    try:
        kind = json.loads(path.read_text(encoding="utf-8")).get("framing")
    except (OSError, ValueError, AttributeError) as err:
        raise MoELabError(
            f"{path}: not a prompt-framing file ({type(err).__name__}); write it again"
        ) from None
    if kind not in ("chat_template", PLAIN):
        raise MoELabError(f"{path}: framing={kind!r}; expected 'chat_template' or 'plain'")
    return PromptFraming(kind)
