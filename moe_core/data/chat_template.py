"""A chat template is code that came with a model directory: render it with bounds, once, before anything
expensive runs.

transformers renders templates in Jinja's immutable sandbox, which blocks attribute escapes and caps
``range()``, but nested loops under that cap still grow memory without limit (~140 MB/s in a two-line
template) and a template error is a long traceback. `check_chat_template` renders every conversation a
fine-tune will render (the prompt with the generation prompt, the prompt with each answer) through the
tokenizer's own ``apply_chat_template`` in a child process with a time limit, a memory limit (``RLIMIT_AS``)
and an output-size limit, and turns any failure into one line naming the template's file, its line and the
example. The trainer then renders the same conversations in-process, as checked.

The child is a fresh interpreter (``python -m moe_core.data.chat_template``), not a fork and not
multiprocessing's spawn. A fine-tune runs inside Prefect's task threads, and a child forked from a threaded
process can inherit a lock another thread held at the fork and hang on it, which the time limit then blames on
the template (seen in CI, beside a test worker's execnet thread). multiprocessing's spawn would re-run the
caller's unguarded script. The tokenizer travels pickled (the one the caller just loaded; the parent writes the
pickle and its own child reads it), and the clock starts when the child says it is ready, so the interpreter's
start never counts against the template.
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import select
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterable
from dataclasses import asdict, dataclass
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


# a fresh interpreter importing transformers to unpickle the tokenizer: about a second idle, more on a loaded machine
STARTUP_SECONDS = 300.0


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


def _render_all(tokenizer, conversations, limits: TemplateLimits, send) -> None:
    """In the child: say ["ready"], then ["at", example] before each rendering, then ["ok"] or ["error", example,
    line, message]."""
    if limits.memory_bytes:
        cap = _vm_size() + limits.memory_bytes
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    send(["ready"])
    index = -1
    try:
        for index, messages, add_generation_prompt in conversations:
            send(["at", index])
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            if len(text) > limits.chars:
                send(
                    [
                        "error",
                        index,
                        None,
                        f"renders {len(text):,} characters, over the {limits.chars:,} allowed",
                    ]
                )
                return
        send(["ok"])
    except MemoryError:
        send(["error", index, None, f"needs more than {limits.memory_bytes / 2**30:.1f} GiB of memory"])
    except Exception as err:  # the template's own error, reported in one line
        message = " ".join(str(err).split()) or type(err).__name__
        send(["error", index, _template_line(err), f"{type(err).__name__}: {message}"])


def _child_main() -> None:
    """``python -m moe_core.data.chat_template``: read the parent's ``sys.path``, then ``(tokenizer,
    conversations, limits)``, from stdin (two pickles the parent wrote), and answer on stdout, one JSON list per
    line. Anything else written to stdout (a library's print) goes to stderr."""
    channel = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    # What is unpickled here is never a file a user gave: `check_chat_template` pickles the tokenizer object its
    # caller already holds into an unnamed temporary file (no path another process could write to) and hands
    # that file to this child as stdin. A pickle keeps the tokenizer exactly as the caller has it (its class,
    # a trust_remote_code class among them, and a chat template set in memory), which a save_pretrained round
    # trip through AutoTokenizer would not.
    sys.path[:] = pickle.load(sys.stdin.buffer)  # a tokenizer class from trust_remote_code lives on it
    tokenizer, conversations, fields = pickle.load(sys.stdin.buffer)
    _render_all(
        tokenizer,
        conversations,
        TemplateLimits(**fields),
        lambda m: channel.write(json.dumps(m).encode() + b"\n"),
    )


def _next_message(fd: int, buffer: bytearray, deadline: float) -> list | None:
    """The child's next message, or None at ``deadline``; EOFError when the child is gone."""
    while b"\n" not in buffer:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            return None
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            raise EOFError
        buffer += chunk
    line, _, rest = bytes(buffer).partition(b"\n")
    buffer[:] = rest
    return json.loads(line)


def _death(child: subprocess.Popen, stderr) -> str:
    """Why the child ended without an answer, in a few words: its signal, or the last line it wrote."""
    code = child.wait()
    stderr.seek(0)
    lines = [line.strip() for line in stderr.read().decode(errors="replace").splitlines() if line.strip()]
    if code < 0:
        return f"the renderer was killed by signal {-code} (out of memory?)"
    return f"the renderer died: {lines[-1][:300]}" if lines else f"the renderer died (exit code {code})"


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
    seconds = limits.seconds + limits.seconds_per_conversation * len(conversations)
    package_root = str(Path(__file__).resolve().parents[2])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])),
    }
    with tempfile.TemporaryFile() as request, tempfile.TemporaryFile() as stderr:
        pickle.dump(sys.path, request)
        pickle.dump((tokenizer, conversations, asdict(limits)), request)
        request.seek(0)
        child = subprocess.Popen(
            [sys.executable, "-m", "moe_core.data.chat_template"],
            stdin=request,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=env,
        )
        buffer, index = bytearray(), -1
        try:
            fd = child.stdout.fileno()
            if _next_message(fd, buffer, time.monotonic() + STARTUP_SECONDS) is None:
                raise ChatTemplateError(
                    f"{origin}: the chat template's renderer did not start within {STARTUP_SECONDS:.0f} s"
                )
            deadline = time.monotonic() + seconds  # ["ready"]: the clock starts
            while (outcome := _next_message(fd, buffer, deadline)) is not None and outcome[0] == "at":
                index = outcome[1]
            if outcome is None:
                outcome = ["error", index, None, f"did not finish within {seconds:.0f} s"]
        except EOFError:
            outcome = ["error", index, None, _death(child, stderr)]
        finally:
            if child.poll() is None:
                child.kill()
            child.wait()
            child.stdout.close()
    if outcome[0] == "ok":
        return
    _, index, line, message = outcome
    at = f", line {line}" if line else ""
    example = f" (rendering example {index} of the data)" if index is not None and index >= 0 else ""
    raise ChatTemplateError(
        f"{origin}{at}: the chat template failed: {message}{example}; fix the template or give another one"
    )


if __name__ == "__main__":
    _child_main()
