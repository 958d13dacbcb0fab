"""A chat template is code that came with a model directory: render it with bounds, once, before anything
expensive runs.

transformers renders templates in Jinja's immutable sandbox, which blocks attribute escapes and caps
``range()``, but nested loops under that cap still grow memory without limit (~140 MB/s in a two-line
template) and a template error is a long traceback. `check_chat_template` renders every conversation a
fine-tune will render (the prompt with the generation prompt, the prompt with each answer) through the
tokenizer's own ``apply_chat_template`` in a forked child process with a time limit, a memory limit
(``RLIMIT_AS``) and an output-size limit, and turns any failure into one line naming the template's file, its
line and the example. The trainer then renders the same conversations in-process, as checked.
"""

from __future__ import annotations

import multiprocessing
import resource
import sys
import traceback
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from moe_core.data.tokenizer import CHAT_TEMPLATE
from moe_core.errors import MoELabError

# templates a base model without one can be fine-tuned with (``data.chat_template=NAME``); any other value is a
# path to a Jinja file. "lab" is the one the lab's own tokenizers carry (`moe_core.data.tokenizer`).
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
BUILTIN_TEMPLATES = {"lab": CHAT_TEMPLATE, "chatml": CHATML}

Conversation = list[dict]
# what a fine-tune renders: (example index, messages, add_generation_prompt)
Rendering = tuple[int, Conversation, bool]


class ChatTemplateError(MoELabError):
    """A chat template that fails, runs too long, or needs too much memory or output on the data."""


@dataclass(frozen=True)
class TemplateLimits:
    seconds: float = 30.0  # for every conversation together, plus the next line's per conversation
    seconds_per_conversation: float = 0.01
    memory_bytes: int = 2 << 30  # the renderer's growth beyond the process it was forked from
    chars: int = 4 << 20  # one rendered conversation


def resolve_chat_template(value: str) -> tuple[str, str]:
    """``(template, origin)`` for a ``data.chat_template`` value: a built-in name or a Jinja file."""
    if value in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[value], f"the built-in {value!r} chat template"
    path = Path(value).expanduser()
    if not path.is_file():
        raise ChatTemplateError(
            f"data.chat_template={value!r} is neither a built-in template ({', '.join(BUILTIN_TEMPLATES)}) nor "
            "a file; give one of those names, the path of a Jinja template, or 'plain' (no template: "
            "moe_core.data.framing)"
        )
    try:
        return path.read_text(encoding="utf-8"), str(path)
    except (OSError, UnicodeDecodeError) as err:
        raise ChatTemplateError(f"{path}: cannot read the chat template ({type(err).__name__})") from None


def template_origin(tokenizer) -> str:
    """Where a tokenizer's template came from, for messages: its file when the tokenizer was read from one."""
    directory = Path(str(getattr(tokenizer, "name_or_path", "") or ""))
    for name in ("chat_template.jinja", "chat_template.json", "tokenizer_config.json"):
        if (directory / name).is_file():
            return str(directory / name)
    return f"the chat template of tokenizer {str(directory) or '(in memory)'}"


def _template_line(err: BaseException) -> int | None:
    """The template line an error was raised at: Jinja names it (syntax errors) or its rewritten traceback
    carries it (frames of the compiled template are named ``<template>``)."""
    lineno = getattr(err, "lineno", None)
    if lineno:
        return int(lineno)
    lines = [
        frame.lineno for frame in traceback.extract_tb(err.__traceback__) if frame.filename == "<template>"
    ]
    return lines[-1] if lines else None


def _vm_size() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    return 0


def _render_all(tokenizer, conversations, limits: TemplateLimits, progress, conn) -> None:
    """In the child: render each conversation; send ("ok",) or ("error", example, line, message)."""
    if limits.memory_bytes:
        cap = _vm_size() + limits.memory_bytes
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    index = -1
    try:
        for index, messages, add_generation_prompt in conversations:
            progress.value = index
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            if len(text) > limits.chars:
                conn.send(
                    (
                        "error",
                        index,
                        None,
                        f"renders {len(text):,} characters, over the {limits.chars:,} allowed",
                    )
                )
                return
        conn.send(("ok",))
    except MemoryError:
        conn.send(("error", index, None, f"needs more than {limits.memory_bytes / 2**30:.1f} GiB of memory"))
    except Exception as err:  # the template's own error, reported in one line
        message = " ".join(str(err).split()) or type(err).__name__
        conn.send(("error", index, _template_line(err), f"{type(err).__name__}: {message}"))


def check_chat_template(
    tokenizer,
    conversations: Iterable[Rendering],
    origin: str | None = None,
    limits: TemplateLimits = TemplateLimits(),
) -> None:
    """Render ``conversations`` (``(example index, messages, add_generation_prompt)``) with ``tokenizer``'s chat template
    under ``limits``; `ChatTemplateError` in one line on the first failure. ``origin``: where the template came
    from (default: the tokenizer's file)."""
    if getattr(tokenizer, "chat_template", None) is None:
        return
    origin = origin or template_origin(tokenizer)
    conversations = list(conversations)
    context = multiprocessing.get_context("fork")  # the child needs the tokenizer object as it is
    progress = context.Value("i", -1)
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(
        target=_render_all, args=(tokenizer, conversations, limits, progress, sender), daemon=True
    )
    sys.stdout.flush(), sys.stderr.flush()
    child.start()
    sender.close()
    try:
        seconds = limits.seconds + limits.seconds_per_conversation * len(conversations)
        ready = receiver.poll(seconds)
        outcome = receiver.recv() if ready else None
    except EOFError:  # the child died without a word: killed by the kernel (memory) or a signal
        outcome = ("error", progress.value, None, "the renderer died (out of memory?)")
    finally:
        if child.is_alive():
            child.kill()
        child.join()
        receiver.close()
    if outcome is None:
        outcome = ("error", progress.value, None, f"did not finish within {seconds:.0f} s")
    if outcome[0] == "ok":
        return
    _, index, line, message = outcome
    at = f", line {line}" if line else ""
    example = f" (rendering example {index} of the data)" if index is not None and index >= 0 else ""
    raise ChatTemplateError(
        f"{origin}{at}: the chat template failed: {message}{example}; fix the template or give another one"
    )
