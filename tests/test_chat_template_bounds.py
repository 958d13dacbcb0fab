"""A model directory's chat template is untrusted code: a fine-tune renders it on every example, bounded in time,
memory and output, before the model loads, and a failure is one line naming the file and the template line."""

import subprocess
import sys
import threading
import time

import pytest
from transformers import TokenizersBackend

from moe_core.data.chat_template import ChatTemplateError, TemplateLimits, check_chat_template
from moe_core.finetune import FinetuneConfig, finetune
from tests.bench_helpers import repo_env
from tests.finetune_helpers import instruction_records, tiny_tokenizer

USER = [{"role": "user", "content": "hi"}]
CHAT = USER + [{"role": "assistant", "content": "hello"}]

# a string doubled under the sandbox's range() cap: memory grows without bound, nothing is output (the issue's
# nested-loop template grew 5.9 GB in 41 s)
MEMORY_BOMB = (
    "{% set ns = namespace(s='x') %}"
    "{% for a in range(1000) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}"
)
# no memory growth, no output: only time
BUSY = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}x"


@pytest.fixture
def tokenizer():
    return tiny_tokenizer()


def renderings(n=3):
    return [(i, CHAT, False) for i in range(n)]


def test_a_good_template_passes(tokenizer):
    check_chat_template(tokenizer, renderings())


def test_a_template_that_eats_memory_is_stopped(tokenizer):
    tokenizer.chat_template = MEMORY_BOMB
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match=r"bomb.jinja: .*needs more than 0.2 GiB of memory"):
        check_chat_template(
            tokenizer, renderings(), "bomb.jinja", TemplateLimits(seconds=20, memory_bytes=256 << 20)
        )
    assert time.monotonic() - start < 30


def test_a_template_that_runs_forever_is_stopped(tokenizer):
    tokenizer.chat_template = BUSY
    with pytest.raises(
        ChatTemplateError, match=r"busy.jinja: .*did not finish within 2 s \(rendering example 0"
    ):
        check_chat_template(
            tokenizer, renderings(), "busy.jinja", TemplateLimits(seconds=2, seconds_per_conversation=0)
        )


def test_output_is_bounded(tokenizer):
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] * 1000 }}{% endfor %}"
    with pytest.raises(ChatTemplateError, match="renders 7,000 characters, over the 100 allowed"):
        check_chat_template(tokenizer, renderings(), "t.jinja", TemplateLimits(chars=100))


def test_errors_name_the_file_the_line_and_the_example(tokenizer):
    tokenizer.chat_template = "{{ bos_token }}\n{% for m in messages %}\n{{ m.content }\n{% endfor %}"
    with pytest.raises(ChatTemplateError) as err:
        check_chat_template(tokenizer, renderings(), "syntax.jinja")
    assert str(err.value).startswith("syntax.jinja, line 3: the chat template failed: TemplateSyntaxError")
    assert "\n" not in str(err.value)

    tokenizer.chat_template = (
        "{% for m in messages %}\n{% if m.role == 'assistant' and loop.index > 1 %}\n"
        "{{ raise_exception('only one turn') }}\n{% endif %}{{ m.content }}{% endfor %}"
    )
    with pytest.raises(ChatTemplateError, match=r"line 3: .*only one turn \(rendering example 2"):
        check_chat_template(tokenizer, [(0, USER, True), (1, USER, True), (2, CHAT, False)], "raise.jinja")


def test_a_fine_tune_refuses_a_bad_template_before_loading_the_model(tmp_path, tokenizer):
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }"
    config = FinetuneConfig.build({"steps": 1, "model": {"path": str(tmp_path / "no-model-here")}})
    # model.path names nothing: the template error must come first, before any load is tried
    with pytest.raises(ChatTemplateError, match="the chat template failed: TemplateSyntaxError"):
        finetune(config, tmp_path / "out", tokenizer=tokenizer, records=instruction_records(4))
    assert not (tmp_path / "out" / "adapter").exists()


# a lock the tokenizer takes while rendering, held by the caller while it checks: a renderer forked from a process
# whose other thread holds a lock inherits it locked and hangs (CI saw one such hang blamed on the template)
HELD = threading.Lock()


class LockingTokenizer(TokenizersBackend):
    def apply_chat_template(self, *args, **kwargs):
        with HELD:
            return super().apply_chat_template(*args, **kwargs)


def test_the_renderer_inherits_no_lock_from_the_caller(tokenizer):
    tokenizer.__class__ = LockingTokenizer
    with HELD:  # as another thread would hold it at the moment the renderer starts
        check_chat_template(tokenizer, renderings(), "t.jinja", TemplateLimits(seconds=20))


def test_a_script_without_a_main_guard_is_not_run_again(tmp_path):
    """A user's plain script calls the check at top level: the renderer must not re-run it (as multiprocessing's
    spawn would)."""
    script = tmp_path / "plain.py"
    script.write_text(
        "from moe_core.data.chat_template import check_chat_template\n"
        "from tests.finetune_helpers import tiny_tokenizer\n"
        "print('script ran', flush=True)\n"
        "check_chat_template(tiny_tokenizer(), [(0, [{'role': 'user', 'content': 'hi'}], True)])\n"
        "print('checked', flush=True)\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=repo_env()
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n").count("script ran") == 1 and "checked" in done.stdout
