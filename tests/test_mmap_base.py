"""The frozen base memory-mapped from its safetensors files (`moe_core.mapped`): the same logits and LoRA gradients as
the copying loader, for Hugging Face per-expert layouts and our stacked one, in fp32 and bf16; the weights really
are file-backed (views of the mapping, and anonymous memory far below the weights' bytes in a child process); the
files are byte-identical after training and a merged export; clear refusals."""

import copy
import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from moe_core import load
from moe_core.config import get_config
from moe_core.experts import PROJECTIONS, GroupedExperts
from moe_core.finetune import FinetuneConfig, FinetuneError, finetune
from moe_core.finetune import run as run_module
from moe_core.finetune.methods import MethodPlan, apply_lora, unwrap
from moe_core.finetune.parallel import shard_experts
from moe_core.loading import LoadError
from moe_core.mapped import MappedExperts, densify_experts, is_file_backed, load_mapped, release_pages
from moe_core.model import MoEForCausalLM
from moe_core.train.parallel import ExpertParallelExperts, init_parallel
from tests.finetune_helpers import instruction_records, tiny_tokenizer
from tests.helpers import randomize_
from tests.test_convert import BASE, HF_CASES, make_inputs
from tests.test_expert_lora import randomize_lora
from tests.test_host_waits import OpCount

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

REPO = Path(__file__).resolve().parents[1]
LORA = {"lora": {"r": 4, "alpha": 8.0, "experts": "all", "attention": ["q_proj", "v_proj"]}}


def write_checkpoint(directory: Path, case: str, dtype: torch.dtype, **fields) -> Path:
    """A tiny checkpoint in ``dtype``: a Hugging Face one written by transformers' own class (one tensor per
    expert), or ours (stacked experts)."""
    torch.manual_seed(0)
    if case == "ours":
        model = MoEForCausalLM(get_config("mixtral-tiny", hidden_size=32, expert_intermediate_size=32))
    else:
        config_cls, model_cls, overrides = HF_CASES[case]
        model = model_cls(config_cls(**{**BASE, **overrides, **fields}))
    randomize_(model)
    model.to(dtype).save_pretrained(directory)
    return directory


def digest(directory: Path) -> dict[str, str]:
    return {
        f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(directory.glob("*.safetensors"))
    }


def same_lora(mapped: MoEForCausalLM, copied: MoEForCausalLM):
    """LoRA (`LORA`, every expert of every MoE layer) on both bases, the copied one's random factors loaded into
    the mapped one's: the pair whose outputs and gradients must agree."""
    ft = FinetuneConfig.build(LORA)
    selection = {layer: list(range(mapped.config.num_experts)) for layer in mapped.config.moe_layer_ids}
    ours, _ = apply_lora(mapped.train(), ft, selection)
    reference, _ = apply_lora(copied.train(), ft, selection)
    randomize_lora(reference)
    ours.load_state_dict(reference.state_dict(), strict=False)  # the same factors
    return ours, reference


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {
        (case, dtype): write_checkpoint(tmp_path_factory.mktemp(f"{case}-{dtype}"), case, dtype)
        for case in ("olmoe", "mixtral", "ours")
        for dtype in (torch.float32, torch.bfloat16)
    }


# ------------------------------------------------------------------------------------------------ same numbers
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", ["olmoe", "mixtral", "ours"])
def test_lora_on_the_mapped_base_equals_lora_on_the_copied_one(checkpoints, case, dtype):
    directory = checkpoints[case, dtype]
    before = digest(directory)
    copied, mapped = load(directory).model, load(directory, memory_map=True).model
    assert mapped.dtype == dtype and mapped.mapped_from is not None
    experts = mapped.model.layers[0].mlp.experts
    assert isinstance(experts, MappedExperts if case != "ours" else GroupedExperts)
    ours, reference = same_lora(mapped, copied)
    input_ids, mask = make_inputs(mapped.config.vocab_size)
    # one expert path for both: auto takes grouped_mm for the copied fp32 stacks on the CPU, and the loop for
    # the mapped per-expert tensors (the test below holds every path of the mapped base to the copied one)
    impl = {"expert_impl": "sorted"}
    for model in (ours, reference):
        model(input_ids, attention_mask=mask, labels=input_ids, **impl).loss.backward()
    grads = {n: p.grad for n, p in ours.named_parameters() if p.requires_grad}
    expected = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    assert grads.keys() == expected.keys() and any(".experts." in n for n in grads)
    for name, grad in expected.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(grads[name], grad, atol=0, rtol=0, msg=name)  # the same products
    with torch.no_grad():
        logits = ours(input_ids, attention_mask=mask, **impl).logits
        assert torch.equal(logits, reference(input_ids, attention_mask=mask, **impl).logits)
    assert digest(directory) == before


@pytest.mark.parametrize("impl", ["reference", "sorted", "grouped_mm", "static", "gather", "decode"])
def test_every_expert_path_of_the_per_expert_tensors_equals_the_dense_stacks(checkpoints, impl):
    directory = checkpoints["olmoe", torch.float32]
    mapped, copied = load_mapped(directory), load(directory).model
    input_ids, mask = make_inputs(mapped.config.vocab_size)
    if impl == "decode":  # the few-slot loop over the distinct chosen experts (no gradient)
        for model in (mapped, copied):
            for layer in model.model.layers:
                layer.mlp.experts.max_slots = 10_000
        impl = "sorted"
    with torch.no_grad():
        torch.testing.assert_close(
            mapped(input_ids, attention_mask=mask, expert_impl=impl).logits,
            copied(input_ids, attention_mask=mask, expert_impl=impl).logits,
        )
    densify_experts(mapped)  # stacked into ordinary memory: a GroupedExperts with the same weights
    assert not any(isinstance(m, MappedExperts) for m in mapped.modules())
    assert mapped.state_dict().keys() == copied.state_dict().keys()
    for name, tensor in copied.state_dict().items():
        assert torch.equal(mapped.state_dict()[name], tensor), name


# ------------------------------------------------------------------------------------------------ file-backed
@pytest.mark.parametrize("case", ["olmoe", "ours"])
def test_mapped_weights_are_views_of_the_file_and_what_trains_is_not(checkpoints, case):
    directory = checkpoints[case, torch.bfloat16]
    file = directory / "model.safetensors"
    model = load_mapped(directory)
    layer = model.model.layers[0]
    frozen = [model.model.embed_tokens.weight, layer.self_attn.q_proj.weight, layer.input_layernorm.weight]
    experts = layer.mlp.experts
    frozen += [w for p in PROJECTIONS for w in experts.weights(p)] if case != "ours" else [experts.up_proj]
    assert all(is_file_backed(w, file) and not w.requires_grad for w in frozen)
    if (
        case != "ours"
    ):  # the test can fail: the converter copies (transformers' from_pretrained maps ours too)
        assert not is_file_backed(load(directory).model.model.embed_tokens.weight, file)
    # what a method may train is copied into ordinary memory: the router gates, and the LoRA factors
    assert not is_file_backed(layer.mlp.router.gate.weight, file)
    peft_model, _ = apply_lora(model, FinetuneConfig.build(LORA), {0: [0, 1], 1: [2]})
    lora = [p for n, p in peft_model.named_parameters() if "lora_" in n]
    assert lora and not any(is_file_backed(p, file) for p in lora)


RSS_CHILD = textwrap.dedent(
    """
    import json, sys, torch
    from moe_core import load

    def rss_kib():
        fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
        return {k: int(fields[k].split()[0]) for k in ("RssAnon", "RssFile")}

    grown = {}
    for mode in ("mapped", "copied"):  # mapped first: the copy cannot reuse memory the mapped load freed
        before = rss_kib()
        model = load(sys.argv[1], memory_map=mode == "mapped").model
        with torch.no_grad():  # every weight read (a forward would read all but some embedding rows)
            sum(float(p.sum()) for p in model.parameters())
        after = rss_kib()
        grown[mode] = {k: after[k] - before[k] for k in after}
    print(json.dumps(grown))
    """
)


def test_a_mapped_model_grows_file_backed_memory_not_anonymous(tmp_path):
    """In a child process, on a ~100 MB checkpoint: the mapped weights count as file-backed pages, which the kernel
    may drop, and the anonymous memory grows far less than the weights' bytes; the copying loader's grows by them."""
    config_cls, model_cls, overrides = HF_CASES["olmoe"]
    fields = {**BASE, **overrides, "hidden_size": 256, "intermediate_size": 1024, "num_experts": 8}
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**fields, "num_hidden_layers": 4}))
    model.save_pretrained(tmp_path)
    weights_kib = sum(p.numel() * p.element_size() for p in model.parameters()) // 1024
    assert weights_kib > 90 * 1024
    child = subprocess.run(
        [sys.executable, "-c", RSS_CHILD, str(tmp_path)], capture_output=True, text=True, cwd=REPO, check=True
    )
    grown = json.loads(child.stdout.strip().splitlines()[-1])
    assert grown["mapped"]["RssAnon"] < 0.25 * weights_kib, grown
    assert grown["mapped"]["RssFile"] > 0.9 * weights_kib, grown
    assert grown["copied"]["RssAnon"] > 0.9 * weights_kib, grown  # what the test tells apart


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and madvise: Linux")
def test_released_pages_leave_the_resident_set_and_read_back_the_same(tmp_path):
    """`release_pages` on a view of a file mapping drops its pages from the process (the file-backed resident set
    falls by its size) and a later read faults the same values back in; anonymous memory given to it (a copy, where
    MADV_DONTNEED would zero it) is left alone."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    def rss_file_kib() -> int:
        status = Path("/proc/self/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("RssFile:")))

    torch.manual_seed(0)
    expected = torch.randn(8, 256, 1024)  # 8 MiB, a "stack" of 8 slices
    save_file({"w": expected}, str(tmp_path / "w.safetensors"))
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        mapped = f.get_tensor("w")
    assert is_file_backed(mapped, tmp_path / "w.safetensors")
    copy_ = mapped.clone()
    assert torch.equal(mapped, expected)  # every page read in
    before = rss_file_kib()
    released = release_pages([*mapped.unbind(0), copy_])
    after = rss_file_kib()
    assert released >= 7.9 * 2**20 and released <= 8 * 2**20
    assert before - after > 7 * 1024, (before, after)
    assert torch.equal(copy_, expected)  # anonymous: not touched
    assert torch.equal(mapped, expected)  # read back from the file


# ------------------------------------------------------------------------------------------------ fine-tuning
def hf_source(tmp_path: Path, dtype: torch.dtype) -> Path:
    # the tokenizer's vocabulary (300), and room for data.max_length
    directory = write_checkpoint(
        tmp_path / "olmoe", "olmoe", dtype, vocab_size=300, max_position_embeddings=128
    )
    tiny_tokenizer().save_pretrained(directory)
    return directory


def ft_config(source: Path, **fields) -> FinetuneConfig:
    base = {
        "model": {"path": str(source)},
        "steps": 3,
        "batch_size": 4,
        "optim": {"lr": 5e-3},
        "lora": {"r": 4, "experts": "all"},
        "data": {"max_length": 64, "chat_template": "chatml"},
        "log": {"progress": "off"},
        "export": {"merged": True, "hf": True},
    }
    return FinetuneConfig.build(base).with_overrides([f"{k}={v}" for k, v in fields.items()])


def test_finetune_maps_the_base_by_default_and_leaves_its_files_as_they_were(tmp_path, capsys):
    source = hf_source(tmp_path, torch.float32)
    before = digest(source)
    mapped = finetune(ft_config(source), tmp_path / "mapped", records=instruction_records(16))
    assert "not memory-mapped" not in capsys.readouterr().out
    assert getattr(unwrap(mapped.model), "mapped_from", None) is not None
    assert json.loads((tmp_path / "mapped" / "finetune_config.json").read_text())["model"]["mmap"] is None
    assert digest(source) == before  # trained, merged and exported: the files were never written
    copied = finetune(
        ft_config(source, **{"model.mmap": "false"}), tmp_path / "copied", records=instruction_records(16)
    )
    assert getattr(unwrap(copied.model), "mapped_from", None) is None
    assert mapped.report.to_dict() == copied.report.to_dict()  # the same parameters, the same ones train
    # the same run: the same adapter, the same merged weights in both exports
    x = torch.randint(0, 300, (2, 10))
    for export in ("merged", "hf"):
        a, b = load(tmp_path / "mapped" / export).model, load(tmp_path / "copied" / export).model
        with torch.no_grad():
            torch.testing.assert_close(a(input_ids=x).logits, b(input_ids=x).logits)
        original = load(source).model
        with torch.no_grad():
            assert not torch.allclose(original(input_ids=x).logits, a(input_ids=x).logits, atol=1e-4)


def test_a_dtype_change_is_refused_when_asked_and_falls_back_with_a_reason_when_not(
    tmp_path, capsys, monkeypatch
):
    source = hf_source(tmp_path, torch.bfloat16)

    def no_weights(*args, **kwargs):
        raise AssertionError("weights loaded before the checks")

    monkeypatch.setattr(run_module, "load", no_weights)
    with pytest.raises(
        FinetuneError, match="model.mmap=true, but .* stored in bfloat16, the model would run in float32"
    ):
        finetune(
            ft_config(source, **{"model.mmap": "true"}), tmp_path / "out", records=instruction_records(4)
        )
    monkeypatch.undo()
    run_module.load_inputs(ft_config(source), records=instruction_records(4))  # auto: copied, and says why
    assert "copied into memory, not memory-mapped (model.mmap): its weights are stored in bfloat16" in (
        capsys.readouterr().out
    )
    inputs = run_module.load_inputs(
        ft_config(source, **{"model.dtype": "bfloat16"}), records=instruction_records(4)
    )
    assert inputs.model.mapped_from is not None and "not memory-mapped" not in capsys.readouterr().out


def test_mapping_is_refused_where_it_means_nothing(tmp_path, checkpoints):
    with pytest.raises(FinetuneError, match="model.mmap=true keeps the frozen base"):
        FinetuneConfig.build({"method": "full", "model": {"mmap": True}})
    with pytest.raises(FinetuneError, match="model.mmap=true with quantize.base=nf4"):
        FinetuneConfig.build({"method": "qlora", "model": {"mmap": True}})
    # full fine-tuning copies the base whatever the files hold: every weight changes
    assert not run_module.memory_map_base(ft_config(checkpoints["olmoe", torch.float32], method="full"))
    with pytest.raises(LoadError, match="stored in float32, the model would run in bfloat16"):
        load(checkpoints["olmoe", torch.float32], dtype="bfloat16", memory_map=True)
    (tmp_path / "quantization.json").write_text("{}")
    with pytest.raises(LoadError, match="quantized checkpoint is not memory-mapped"):
        load(tmp_path, memory_map=True)


# ------------------------------------------------------------------------------------------------ peak memory
def test_a_large_frozen_weight_s_input_gradient_goes_by_blocks_and_equals_autograd_s(monkeypatch):
    """With the base mapped, the transposed copy `frozen_linear`'s bf16 backward makes of a weight was what kept
    the fine-tuning peak above transformers + PEFT's (an LM head: 196 MiB); above TRANSPOSE_BLOCK_BYTES it is
    made a block of rows at a time, and the gradient is the same."""
    from moe_core import frozen_linear as module

    monkeypatch.setattr(module, "INPUT_GRADIENT_LAYOUT", {torch.bfloat16: "transposed"})  # on any CPU
    torch.manual_seed(0)
    w, x, grad = torch.randn(48, 64), torch.randn(2, 5, 64, requires_grad=True), torch.randn(2, 5, 48)
    torch.nn.functional.linear(x, w).backward(grad)
    grads = {}
    for block_bytes in (module.TRANSPOSE_BLOCK_BYTES, 10 * 64 * 2):  # one copy; five blocks of 10 rows
        monkeypatch.setattr(module, "TRANSPOSE_BLOCK_BYTES", block_bytes)
        x_bf16 = x.detach().bfloat16().requires_grad_()
        module.frozen_linear(x_bf16, w.bfloat16()).backward(grad.bfloat16())
        grads[block_bytes] = x_bf16.grad.float()
    for got in grads.values():
        torch.testing.assert_close(got, x.grad, atol=0.1, rtol=0.02)
    blocked, whole = grads[10 * 64 * 2], grads[module.TRANSPOSE_BLOCK_BYTES]
    torch.testing.assert_close(blocked, whole, atol=0.05, rtol=0.02)


def test_expert_parallel_fine_tuning_stacks_a_mapped_layer_s_experts_first(checkpoints):
    """`moe_core.finetune.parallel.shard_experts` on a memory-mapped Hugging Face layout (`MappedExperts`): each
    layer's experts become this rank's stacked slice (a world of one here: all of them), with the same outputs."""
    directory = checkpoints["olmoe", torch.float32]
    model = load(directory, memory_map=True).model
    ft = FinetuneConfig.build(LORA)
    selection = {layer: list(range(model.config.num_experts)) for layer in model.config.moe_layer_ids}
    peft_model, lora_mask = apply_lora(model.train(), ft, selection)
    plan = MethodPlan("lora", expert_selection=selection, lora_mask=lora_mask)
    randomize_lora(peft_model)
    input_ids, mask = make_inputs(model.config.vocab_size)
    with torch.no_grad():
        before = peft_model(input_ids, attention_mask=mask).logits
    shard_experts(peft_model, init_parallel(1, backend="gloo", device="cpu"), plan)
    assert not any(isinstance(m, MappedExperts) for m in peft_model.modules())
    assert any(isinstance(m, ExpertParallelExperts) for m in peft_model.modules())
    with torch.no_grad():
        torch.testing.assert_close(peft_model(input_ids, attention_mask=mask).logits, before)


# ------------------------------------------------------------------------------------------------ moved to a device
@pytest.mark.parametrize("case", ["olmoe", "mixtral"])
def test_a_mapped_base_moved_off_its_file_is_stacked_and_runs_grouped_mm_like_the_copied_one(
    checkpoints, case
):
    """``.to()`` that copies the per-expert weights (to a GPU in real use; to fp32 here, on the CPU) copies each
    projection into one ``[E, O, I]`` stack whose views the ``{p}_{e}`` parameters become: ``grouped_mm`` then
    runs on it (before, a mapped base on a GPU ran the per-expert loop: 10.6x transformers + PEFT's step on an
    H100), with LoRA gradients equal to those of the copied base on the same path; a move that copies nothing
    keeps the views of the file."""
    directory = checkpoints[case, torch.bfloat16]
    file = directory / "model.safetensors"
    mapped = load(directory, memory_map=True).model
    experts = mapped.model.layers[0].mlp.experts
    mapped.to("cpu")  # nothing to copy: still the file's views, and no stack
    assert all(is_file_backed(w, file) for w in experts.weights("up_proj"))
    assert experts.stack("up_proj") is None and not experts.grouped_mm_ok(torch.zeros(1, 8))
    names = set(mapped.state_dict())
    mapped.to(torch.float32)
    assert set(mapped.state_dict()) == names  # the per-expert names of the file's layout, as before
    for p in experts.projections:
        stack_EOI = experts.stack(p)
        assert stack_EOI is not None and stack_EOI.dtype == torch.float32
        assert stack_EOI.shape == experts.stack_shape(p)
        assert all(w.data_ptr() == s.data_ptr() for w, s in zip(experts.weights(p), stack_EOI))
    copied = load(directory).model.to(torch.float32)
    ours, reference = same_lora(mapped, copied)
    input_ids, mask = make_inputs(mapped.config.vocab_size)
    for model in (ours, reference):
        model(input_ids, attention_mask=mask, labels=input_ids, expert_impl="grouped_mm").loss.backward()
    grads = {n: p.grad for n, p in ours.named_parameters() if p.requires_grad}
    expected = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    assert grads.keys() == expected.keys() and any(".experts." in n for n in grads)
    for name, grad in expected.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(grads[name], grad, atol=0, rtol=0, msg=name)
    # and no more host work for it: the mapped model dispatches the copied one's operators, no more (a check
    # of each expert's view at every call, an unbind and E selects, was the largest host cost of an H100's
    # step)
    ops = []
    for model in (ours, reference):
        with OpCount() as count:
            model(input_ids, attention_mask=mask, labels=input_ids, expert_impl="grouped_mm").loss.backward()
        ops.append(count.ops)
    assert ops[0] == ops[1]
    # a weight replaced afterwards is no view of the stack: the stack is no longer used
    experts.set_expert("up_proj", 0, experts.weights("up_proj")[0].clone())
    assert experts.stack("up_proj") is None and not experts.grouped_mm_ok(torch.zeros(1, 8))
    assert experts.stack("down_proj") is not None  # the other projections' stacks still hold their weights
    # the same view assigned again (load_state_dict(assign=True) of the model's own state): nothing dropped
    experts.down_proj_1 = experts.down_proj_1
    assert experts.stack("down_proj") is not None


def test_a_copy_of_a_stacked_mapped_layer_runs_grouped_mm_on_its_own_weights(checkpoints):
    """`copy.deepcopy` (and pickling) clone each per-expert weight apart from the stack `_apply` made: the copy's
    grouped_mm must not multiply by that stack once the copy's weights change in place (``load_state_dict``
    without ``assign``); it lets go of it and gives what the per-expert path gives."""
    directory = checkpoints["olmoe", torch.bfloat16]
    mapped = load(directory, memory_map=True).model.to(torch.float32)
    experts = mapped.model.layers[0].mlp.experts
    assert all(experts.stack(p) is not None for p in experts.projections)
    copied = copy.deepcopy(mapped)
    torch.manual_seed(1)
    new_weights = {k: torch.randn_like(v) for k, v in copied.state_dict().items() if ".experts." in k}
    copied.load_state_dict(new_weights, strict=False)
    input_ids, mask = make_inputs(copied.config.vocab_size)
    with torch.no_grad():
        grouped = copied(input_ids, attention_mask=mask, expert_impl="grouped_mm").logits
        per_expert = copied(input_ids, attention_mask=mask, expert_impl="sorted").logits
        before = mapped(input_ids, attention_mask=mask, expert_impl="grouped_mm").logits
    torch.testing.assert_close(grouped, per_expert)
    assert not torch.allclose(grouped, before)  # the new weights did change the outputs


def test_a_mapped_base_moved_off_the_cpu_lets_go_of_its_files(tmp_path):
    """Moved wholly to another device (a GPU; here the meta device), no tensor is a view of the files: the model
    drops its reader and the process maps the files no more (their pages leave its resident set). Moved within
    the CPU, or partly, it keeps them."""
    import gc

    directory = write_checkpoint(tmp_path, "olmoe", torch.bfloat16)
    files = sorted(str(f.resolve()) for f in directory.glob("*.safetensors"))

    def mapped_files() -> set[str]:
        gc.collect()
        return {
            line.split(maxsplit=5)[-1] for line in Path("/proc/self/maps").read_text().splitlines()
        } & set(files)

    model = load(directory, memory_map=True).model
    assert model.mapped_from is not None and mapped_files()
    model.to(torch.bfloat16)  # the CPU, the file's dtype: still its views
    model.model.embed_tokens.to("meta")  # a part moved
    assert model.mapped_from is not None and mapped_files()
    model.to("meta")
    assert model.mapped_from is None and not mapped_files()


@pytest.mark.parametrize("case", ["olmoe", "mixtral"])
def test_a_mapped_model_is_saved_a_shard_at_a_time_as_save_pretrained_writes_it(tmp_path, checkpoints, case):
    """`save_streaming` writes what ``densify_experts`` + ``save_pretrained`` write (the same files, names, shards
    and tensors, bit for bit) while the experts stay the file's: the copy of a projection's stack lives while its
    shard is written. A router fine-tune (nothing to merge) of the full OLMoE-1B-7B held 13.1 GiB of anonymous
    memory to write merged/ that way."""
    import json

    from safetensors.torch import load_file

    from moe_core.mapped import save_streaming

    directory = checkpoints[case, torch.bfloat16]
    mapped = load(directory, memory_map=True).model
    shard = 40_000  # bytes: several shards, an expert stack alone in some
    save_streaming(mapped, tmp_path / "streamed", shard)
    assert isinstance(mapped.model.layers[0].mlp.experts, MappedExperts)  # still the file's
    dense = load(directory, memory_map=True).model
    densify_experts(dense)
    dense.save_pretrained(tmp_path / "saved", max_shard_size=shard)
    files = sorted(p.name for p in (tmp_path / "saved").iterdir())
    assert sorted(p.name for p in (tmp_path / "streamed").iterdir()) == files
    assert len([f for f in files if f.endswith(".safetensors")]) > 2
    for name in files:
        ours, theirs = tmp_path / "streamed" / name, tmp_path / "saved" / name
        if name.endswith(".safetensors"):
            a, b = load_file(ours), load_file(theirs)
            assert a.keys() == b.keys(), name
            assert all(torch.equal(a[k], b[k]) for k in a), name
        elif name.endswith(".json"):
            assert json.loads(ours.read_text()) == json.loads(theirs.read_text()), name
    x = torch.randint(0, mapped.config.vocab_size, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(
            load(tmp_path / "streamed").model(input_ids=x).logits, mapped(input_ids=x).logits
        )


def test_a_router_fine_tune_of_a_mapped_base_writes_merged_without_stacking_its_experts(
    tmp_path, monkeypatch
):
    source = hf_source(tmp_path, torch.float32)
    monkeypatch.setattr(MappedExperts, "densified", stacked_in_memory)  # written from the file's views
    result = finetune(
        ft_config(source, method="router", **{"export.hf": "false"}),
        tmp_path / "out",
        records=instruction_records(16),
    )
    # the in-memory model is what was written, memory-mapped
    assert is_file_backed(
        result.model.model.layers[0].mlp.experts.up_proj, tmp_path / "out" / "merged" / "model.safetensors"
    )
    x = torch.randint(0, 300, (2, 10))
    with torch.no_grad():
        written = load(tmp_path / "out" / "merged").model(input_ids=x).logits
        torch.testing.assert_close(written, result.model(input_ids=x).logits)
        assert not torch.allclose(
            written, load(source).model(input_ids=x).logits, atol=1e-5
        )  # the routers trained


def stacked_in_memory(self):
    raise AssertionError("a memory-mapped experts module was stacked into memory")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_lora_fine_tune_of_a_mapped_base_merges_its_experts_as_merged_and_hf_are_written(
    tmp_path, monkeypatch, dtype
):
    """merged/ and hf/ of a LoRA fine-tune on a memory-mapped base: the experts are never stacked into memory (a
    merged copy of the full Qwen1.5-MoE-A2.7B is 26.7 GiB, more than the machine it fine-tunes on); each
    projection's delta is added to each expert as its shard is written. The files hold what merging the adapter
    into the whole base gives (PEFT's merge, through ``load(OUT / "adapter")``), bit for bit, and the run's
    in-memory model is merged/ memory-mapped."""
    from safetensors.torch import load_file

    from moe_core.hf_export import convert_to_hf

    source = hf_source(tmp_path, dtype)
    monkeypatch.setattr(MappedExperts, "densified", stacked_in_memory)
    name = str(dtype).removeprefix("torch.")
    result = finetune(
        ft_config(source, **{"model.dtype": name, "lora.attention": "[q_proj, v_proj]"}),
        tmp_path / "out",
        records=instruction_records(16),
    )
    monkeypatch.undo()
    out = tmp_path / "out"
    assert result.merged_dir == out / "merged" and result.hf_dir == out / "hf"
    reference = load(out / "adapter", dtype=dtype).model  # the adapter merged into a copy of the whole base
    written = load_file(out / "merged" / "model.safetensors")
    expected = reference.state_dict()
    assert written.keys() == expected.keys()
    for key, tensor in written.items():
        assert torch.equal(tensor, expected[key]), key
    reference_hf = convert_to_hf(out / "adapter", tmp_path / "reference_hf")
    hf, hf_expected = (
        load_file(out / "hf" / "model.safetensors"),
        load_file(reference_hf / "model.safetensors"),
    )
    assert hf.keys() == hf_expected.keys()
    assert all(torch.equal(hf[k], hf_expected[k]) for k in hf)
    x = torch.randint(0, 300, (2, 10))
    with torch.no_grad():
        ours = result.model(input_ids=x).logits
        torch.testing.assert_close(ours, reference(input_ids=x).logits)
        assert not torch.allclose(
            ours, load(source, dtype=dtype).model(input_ids=x).logits
        )  # the adapter acts
