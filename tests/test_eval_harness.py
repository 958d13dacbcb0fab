"""lm-evaluation-harness adapter: scores checked against log-probabilities computed token by token; a local
YAML task with a local JSONL dataset runs end to end offline. Skipped where lm-eval is not installed."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from lm_eval.api.instance import Instance

from moe_core import MoEForCausalLM, get_config
from moe_core.eval.harness import MoELabLM, run_tasks
from tests.test_eval_generate import tiny_tokenizer


@pytest.fixture(scope="module")
def lm():
    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    model = MoEForCausalLM(get_config("mixtral-tiny", vocab_size=len(tokenizer)))
    return MoELabLM(model, tokenizer, max_length=64, max_gen_toks=8)


def request(kind: str, *args) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


def logprob_token_by_token(lm: MoELabLM, prefix: list[int], targets: list[int]) -> float:
    """Each target scored by its own forward over everything before it (no slicing shared with the adapter)."""
    total, ids = 0.0, list(prefix)
    with torch.no_grad():
        for t in targets:
            logits_V = lm.model(torch.tensor([ids]), use_cache=False).logits[0, -1]
            total += float(torch.log_softmax(logits_V.float(), -1)[t])
            ids.append(t)
    return total


def test_loglikelihood(lm):
    tok = lm.tokenizer
    context, continuation = "def add(a, b):", "\n    return a + b"
    (logprob, greedy), (empty_ctx, _) = lm.loglikelihood(
        [request("loglikelihood", context, continuation), request("loglikelihood", "", "Return")]
    )
    ctx = tok.encode(context, add_special_tokens=False)
    cont = tok.encode(context + continuation, add_special_tokens=False)[len(ctx) :]
    assert logprob == pytest.approx(logprob_token_by_token(lm, ctx, cont), abs=1e-4)
    assert logprob < 0 and isinstance(greedy, bool)
    expected = logprob_token_by_token(lm, [tok.eos_token_id], tok.encode("Return", add_special_tokens=False))
    assert empty_ctx == pytest.approx(expected, abs=1e-4)


def test_loglikelihood_rolling(lm):
    tok = lm.tokenizer
    text = "Return the sum."
    (total,) = lm.loglikelihood_rolling([request("loglikelihood_rolling", text)])
    ids = tok.encode(text, add_special_tokens=False)
    assert total == pytest.approx(logprob_token_by_token(lm, [tok.eos_token_id], ids), abs=1e-4)
    short = MoELabLM(lm.model, tok, max_length=3)  # several windows, each token still scored once
    (windowed,) = short.loglikelihood_rolling([request("loglikelihood_rolling", text)])
    assert windowed < 0 and windowed != pytest.approx(total, abs=1e-6)


def test_generate_until_is_greedy_and_stops(lm):
    tok = lm.tokenizer
    context = "def add(a, b):"
    (full,) = lm.generate_until([request("generate_until", context, {"until": [], "max_gen_toks": 6})])
    ids, new = tok.encode(context, add_special_tokens=False), []
    with torch.no_grad():
        for _ in range(6):
            new.append(int(lm.model(torch.tensor([ids + new]), use_cache=False).logits[0, -1].argmax()))
            if new[-1] == tok.eos_token_id:
                break
    assert full == tok.decode(new, skip_special_tokens=True)
    stop = full[len(full) // 2]
    (cut,) = lm.generate_until([request("generate_until", context, {"until": [stop], "max_gen_toks": 6})])
    assert cut == full.split(stop)[0] and stop not in cut


@pytest.mark.slow
def test_local_task_end_to_end(lm, tmp_path):
    data = tmp_path / "tiny_choice.jsonl"
    rows = [
        {"question": "def add(a, b):\n    return a", "choices": [" + b", " - b"], "answer": 0},
        {"question": "Return the", "choices": [" sum", " zzz"], "answer": 0},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "tiny_choice.yaml").write_text(
        textwrap.dedent(f"""\
        task: moe_lab_tiny_choice
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {data}
        test_split: test
        output_type: multiple_choice
        doc_to_text: "{{{{question}}}}"
        doc_to_choice: "{{{{choices}}}}"
        doc_to_target: answer
        metric_list:
          - metric: acc
        """)
    )
    results = run_tasks(lm, ["moe_lab_tiny_choice"], include_path=str(tmp_path))
    acc = results["moe_lab_tiny_choice"]["acc,none"]
    assert acc in (0.0, 0.5, 1.0)
