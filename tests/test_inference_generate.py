"""Batched generation (equal to one-prompt greedy generate), the CLI end to end, torch.compile / torch.export."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch

from moe_core import MoEForCausalLM, get_config
from moe_core.cli import main
from moe_core.inference.generate import GenerationConfig, GenerationError, batch_generate, schedule

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def tiny(**overrides) -> MoEForCausalLM:
    torch.manual_seed(0)
    return MoEForCausalLM(get_config("mixtral-tiny", vocab_size=128, **overrides)).eval()


def prompts(lengths=(3, 9, 5, 12, 7)) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(2, 128, (n,), generator=g).tolist() for n in lengths]


def test_schedule_groups_similar_lengths():
    assert schedule([3, 9, 5, 12, 7], 2) == [[3, 1], [4, 2], [0]]


def test_batched_greedy_equals_one_prompt_generate():
    model = tiny()
    ps = prompts()
    streamed: list[tuple[int, int]] = []
    result = batch_generate(
        model,
        ps,
        GenerationConfig(max_new_tokens=8, batch_size=2),
        on_token=lambda i, t, _text: streamed.append((i, t)),
    )
    for i, p in enumerate(ps):
        ref = model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
        assert result.token_ids[i] == ref[0, len(p) :].tolist(), i
        assert [t for j, t in streamed if j == i] == result.token_ids[i]  # streamed as produced
    assert result.report["new_tokens"] == 40 and result.report["batches"] == 3
    assert 0 < result.report["padding_fraction"] < 0.5


@pytest.mark.slow
def test_compiled_batched_generation_equals_eager():
    """compile=True: left-padded prompts, eager prefill into one static cache sized for the longest prompt
    plus the new tokens, compiled gather decode (inductor); two batch sizes (2, then 1) share the steps."""
    model = tiny(num_hidden_layers=1)
    ps = prompts((3, 9, 5))
    config = dict(max_new_tokens=6, batch_size=2)
    eager = batch_generate(model, ps, GenerationConfig(**config))
    compiled = batch_generate(model, ps, GenerationConfig(**config, compile=True))
    assert compiled.token_ids == eager.token_ids
    assert compiled.report["decode_cache"] == "static" and eager.report["decode_cache"] == "dynamic"
    # the compiled steps stay with the model: a second call (another length, same 64-slot cache) reuses them
    memo = model._generation_steps
    steps = memo[64][0]
    again = batch_generate(model, ps[:2], GenerationConfig(max_new_tokens=9, batch_size=2, compile=True))
    assert again.token_ids == batch_generate(model, ps[:2], GenerationConfig(max_new_tokens=9)).token_ids
    assert list(memo) == [64] and memo[64][0] is steps
    assert copy.deepcopy(model)._generation_steps == {}  # a copy compiles its own
    model.double()  # a changed layout is compiled again, not read through the old graphs
    batch_generate(model, ps[:1], GenerationConfig(max_new_tokens=2, compile=True))
    assert memo[64][0] is not steps


def test_eos_stops_a_row_and_sampling_is_seeded():
    model = tiny()
    ps = prompts((4, 6))
    greedy = batch_generate(model, ps, GenerationConfig(max_new_tokens=6))
    eos = greedy.token_ids[0][2]
    first = greedy.token_ids[0].index(eos)
    stopped = batch_generate(model, ps, GenerationConfig(max_new_tokens=6, eos_token_id=eos))
    assert stopped.token_ids[0] == greedy.token_ids[0][: first + 1]
    a = batch_generate(model, ps, GenerationConfig(max_new_tokens=6, temperature=1.0, top_k=20, seed=5))
    b = batch_generate(model, ps, GenerationConfig(max_new_tokens=6, temperature=1.0, top_k=20, seed=5))
    assert a.token_ids == b.token_ids


def test_generation_errors_are_clear():
    with pytest.raises(GenerationError, match="tokenizer"):
        batch_generate(tiny(), ["hello"])
    with pytest.raises(GenerationError, match="no prompts"):
        batch_generate(tiny(), [])


def _char_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = "abcdefghijklmnopqrstuvwxyz .,"
    vocab = {"<unk>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    assert len(vocab) <= vocab_size
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


def test_cli_quantize_prune_generate(tmp_path, capsys):
    from moe_core.analytics.profile import collect_profile

    model = tiny()
    model.save_pretrained(tmp_path / "model")
    _char_tokenizer(128).save_pretrained(tmp_path / "model")
    collect_profile(model, [torch.randint(0, 128, (4, 16))]).to_dir(tmp_path / "profile")

    assert (
        main(
            [
                "prune",
                str(tmp_path / "model"),
                "--profile",
                str(tmp_path / "profile"),
                "--out",
                str(tmp_path / "pruned"),
                "--keep",
                "4",
            ]
        )
        == 0
    )
    # for people: one summary line and where the report went, not a JSON dump
    summary, wrote = capsys.readouterr().out.strip().splitlines()
    assert re.match(r"8 -> 4 experts per MoE layer \(frequency\), [\d,]+ -> [\d,]+ parameters", summary)
    assert wrote.endswith("(report: pruning.json)")
    report = json.loads((tmp_path / "pruned" / "pruning.json").read_text())
    assert (
        report["experts_after"] == 4
        and MoEForCausalLM.from_pretrained(tmp_path / "pruned").config.num_experts == 4
    )
    args = ["prune", str(tmp_path / "model"), "--profile", str(tmp_path / "profile"), "--keep", "8"]
    assert main([*args, "--out", str(tmp_path / "all")]) == 0
    assert capsys.readouterr().out.startswith("pruned nothing: every MoE layer keeps its 8 experts")

    assert (
        main(
            [
                "quantize",
                str(tmp_path / "model"),
                "--out",
                str(tmp_path / "q4"),
                "--bits",
                "4",
                "--group-size",
                "16",
                "--json",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["fraction_quantized"] > 0.5

    assert (
        main(
            [
                "generate",
                str(tmp_path / "q4"),
                "--prompt",
                "hello",
                "--prompt",
                "a cat",
                "--max-new-tokens",
                "5",
                "--batch-size",
                "2",
                "--json",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    lines = [json.loads(line) for line in captured.out.strip().splitlines()]
    assert sum(1 for line in lines if "text" in line) == 10  # 2 prompts x 5 tokens, streamed
    assert [line["prompt"] for line in lines if line.get("done")] == [0, 1]
    assert json.loads(captured.err.strip().splitlines()[-1])["new_tokens"] == 10
    completions = [line["completion"] for line in lines if line.get("done")]

    # for people: text, the first prompt streamed, each prompt followed by its completion; no JSON
    assert (
        main(
            [
                "generate",
                str(tmp_path / "q4"),
                "--prompt",
                "hello",
                "--prompt",
                "a cat",
                "--max-new-tokens",
                "5",
                "--batch-size",
                "2",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert captured.out.startswith("hello") and captured.out.endswith(f"\n\na cat{completions[1]}\n")
    assert "{" not in captured.err and "new_tokens 10" in captured.err

    # with an expert cache, the closing line says how well it worked (it printed nothing of the cache before)
    args = ["generate", str(tmp_path / "model"), "--prompt", "hello", "--max-new-tokens", "5"]
    assert main([*args, "--expert-cache", "64"]) == 0
    assert re.search(r"expert cache hit rate \d+% \(\d+ of \d+\)", capsys.readouterr().err)

    assert main(["generate", str(tmp_path / "model")]) == 2
    assert "no prompts" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ compile
def test_compile_fullgraph_steps_match_eager():
    """fullgraph capture on the static path (the aot_eager backend: the graph, without the C++ build)."""
    from moe_core.inference.compile import compile_steps

    model = tiny(num_hidden_layers=1)
    steps = compile_steps(model, backend="aot_eager")
    x = torch.randint(0, 128, (1, 6))
    logits, cache = steps.prefill(x)
    with torch.no_grad():
        ref = model(x, use_cache=True)
    torch.testing.assert_close(logits, ref.logits[:, -1], atol=1e-5, rtol=1e-5)
    ref_cache, nxt = ref.cache, logits.argmax(-1, keepdim=True)
    for _ in range(2):
        logits, cache = steps.decode(nxt, cache)
        with torch.no_grad():
            ref = model(nxt, cache=ref_cache, use_cache=True)
        torch.testing.assert_close(logits, ref.logits[:, -1], atol=1e-5, rtol=1e-5)
        ref_cache, nxt = ref.cache, logits.argmax(-1, keepdim=True)


def test_compiled_steps_compile_once_for_every_prompt_and_cache_length():
    """Prefill has a symbolic prompt length and decode a symbolic cache length: a graph each, not one per
    length (decode may compile once more when the cache first grows)."""
    from torch._dynamo.utils import counters

    from moe_core.inference.compile import compile_steps

    model = tiny(num_hidden_layers=1, num_experts=8, num_experts_per_tok=2)
    steps = compile_steps(model, backend="aot_eager")
    graphs = counters["stats"]["unique_graphs"]
    for length in (5, 7, 12):
        x = torch.randint(0, 128, (1, length))
        logits, cache = steps.prefill(x)
        with torch.no_grad():
            torch.testing.assert_close(logits, model(x).logits[:, -1], atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] - graphs == 1
    graphs = counters["stats"]["unique_graphs"]
    nxt = logits.argmax(-1, keepdim=True)
    for _ in range(6):
        logits, cache = steps.decode(nxt, cache)
        nxt = logits.argmax(-1, keepdim=True)
    assert counters["stats"]["unique_graphs"] - graphs <= 2


def test_reduction_gemv_leaves_eager_linears_and_the_state_dict_alone():
    from moe_core.inference.compile import ReductionLinear, reduction_gemv

    model = tiny(num_hidden_layers=1)
    x = torch.randint(0, 128, (1, 6))
    with torch.no_grad():
        ref = model(x).logits
    state = {k: v.clone() for k, v in model.state_dict().items()}
    reduction_gemv(model)
    assert isinstance(model.lm_head, ReductionLinear) and isinstance(
        model.model.layers[0].self_attn.q_proj, ReductionLinear
    )
    with torch.no_grad():
        assert torch.equal(model(x).logits, ref)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


@pytest.mark.slow
def test_compile_inductor_and_torch_export():
    from moe_core.inference.compile import compile_steps, export_program

    model = tiny(num_hidden_layers=1)
    x = torch.randint(0, 128, (1, 6))
    with torch.no_grad():
        ref = model(x).logits
    program = export_program(model, x)
    torch.testing.assert_close(program.module()(x), ref, atol=1e-5, rtol=1e-5)
    longer = torch.randint(0, 128, (1, 9))  # the sequence length is dynamic
    with torch.no_grad():
        torch.testing.assert_close(program.module()(longer), model(longer).logits, atol=1e-5, rtol=1e-5)
    steps = compile_steps(model)  # inductor: the fused gather-reduction decode kernel, and reduction GEMVs
    logits, cache = steps.prefill(x)
    torch.testing.assert_close(logits, ref[:, -1], atol=1e-5, rtol=1e-5)
    nxt = logits.argmax(-1, keepdim=True)
    with torch.no_grad():
        ref = model(torch.cat([x, nxt], 1)).logits[:, -1]
    torch.testing.assert_close(steps.decode(nxt, cache)[0], ref, atol=1e-5, rtol=1e-5)
