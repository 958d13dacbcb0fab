"""Random-weight stand-ins for published MoE checkpoints (`moe_core.published`): they load in transformers and in
the lab as the architecture they name, their sizes are the published ones, and a second build is a no-op.

The stand-ins here are shrunk through ``overrides`` (a hidden size of 64, a few experts, one layer); the layout
code is the same at full size, where only the shapes differ (test_published_sizes counts those on the meta
device).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

import moe_core
from moe_core.published import (
    PUBLISHED,
    RECORD,
    PublishedError,
    build_published,
    published_config,
    tensor_layout,
)

pytestmark = pytest.mark.usefixtures("one_thread")

CLASSES = {
    "olmoe-1b-7b": "OlmoeForCausalLM",
    "qwen1.5-moe-a2.7b": "Qwen2MoeForCausalLM",
    "mixtral-8x7b": "MixtralForCausalLM",
    "moonlight-16b-a3b": "DeepseekV3ForCausalLM",
    "deepseek-v2-lite": "DeepseekV2ForCausalLM",
    "qwen3-30b-a3b": "Qwen3MoeForCausalLM",
    "gpt-oss-20b": "GptOssForCausalLM",
    "glm-4.5-air": "Glm4MoeForCausalLM",
}


def build_small(name, cache_dir, **kwargs):
    kwargs = {"layers": 1, "overrides": PUBLISHED[name].tiny_overrides, "tokenizer_vocab": 300, **kwargs}
    return build_published(name, cache_dir=cache_dir, **kwargs)


def weights(directory) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_stand_in_loads_in_transformers_and_in_the_lab_with_the_same_logits(name, tmp_path):
    directory = build_small(name, tmp_path, max_shard_bytes=40_000)  # several shards and an index
    assert directory.parent == tmp_path
    assert (directory / "model.safetensors.index.json").is_file()
    assert len(list(directory.glob("model-*.safetensors"))) > 1
    written = json.loads((directory / "config.json").read_text())
    expected = published_config(name, 1, PUBLISHED[name].tiny_overrides)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    # the architecture as published (with the overrides); only the special-token ids are the tokenizer's
    for key, value in expected.items():
        if key == "rope_scaling" and isinstance(value, dict):  # transformers 5 adds rope_type and rope_theta
            assert {k: written[key][k] for k in value} == value, key
        elif key not in ("bos_token_id", "eos_token_id", "pad_token_id"):
            assert written[key] == value, key
    assert written["eos_token_id"] == tokenizer.eos_token_id
    assert tokenizer.chat_template and len(tokenizer) <= written["vocab_size"]

    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    assert type(hf).__name__ == CLASSES[name]
    loaded = moe_core.load(directory, dtype="float32")
    assert loaded.kind == "hf"
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name the animal."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=False,  # the ids (transformers 5's default is a dict)
    )
    with torch.no_grad():
        theirs = hf(ids).logits
        ours = loaded.model.eval()(ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)

    tensors = weights(directory)
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert set(tensors) == {n for n, _ in tensor_layout(expected)}
    norms = [n for n in tensors if n.endswith("norm.weight")]
    assert norms and all(bool((tensors[n] == 1).all()) for n in norms)
    embedding = tensors["model.embed_tokens.weight"].float()
    assert abs(embedding.std().item() - 0.02) < 0.002 and abs(embedding.mean().item()) < 0.001


def test_a_second_build_is_a_no_op_and_a_damaged_copy_is_rebuilt(tmp_path):
    directory = build_small("olmoe-1b-7b", tmp_path)
    stamps = {p.name: p.stat().st_mtime_ns for p in directory.iterdir()}
    assert build_small("olmoe-1b-7b", tmp_path) == directory
    assert {p.name: p.stat().st_mtime_ns for p in directory.iterdir()} == stamps
    assert not list(tmp_path.glob(".*tmp-*"))  # no temporary left behind

    shard = directory / "model.safetensors"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:  # a copy cut short (a full disk, a killed copy)
        f.truncate(size // 2)
    build_small("olmoe-1b-7b", tmp_path)
    assert shard.stat().st_size == size
    record = json.loads((directory / RECORD).read_text())
    assert record["files"]["model.safetensors"] == size and record["request"]["layers"] == 1

    # another request (here: another seed) is another set of values, rebuilt in place
    before = weights(directory)["model.embed_tokens.weight"]
    build_small("olmoe-1b-7b", tmp_path, seed=1)
    assert json.loads((directory / RECORD).read_text())["request"]["seed"] == 1
    assert not torch.equal(weights(directory)["model.embed_tokens.weight"], before)


def test_values_do_not_depend_on_the_sharding(tmp_path):
    one = weights(build_small("mixtral-8x7b", tmp_path / "a"))
    many = weights(build_small("mixtral-8x7b", tmp_path / "b", max_shard_bytes=20_000))
    assert set(one) == set(many)
    assert all(torch.equal(one[n], many[n]) for n in one)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "olmoe-7b"}, "unknown published model 'olmoe-7b'"),
        ({"name": "olmoe-1b-7b", "layers": 17}, "layers=17; choose 1..16"),
        ({"name": "olmoe-1b-7b", "layers": 0}, "layers=0; choose 1..16"),
        ({"name": "mixtral-8x7b", "overrides": {"num_experts": 4}}, "fields the published config does not"),
        ({"name": "olmoe-1b-7b", "overrides": {"num_experts_per_tok": 99}}, "is not valid"),
    ],
)
def test_bad_requests_are_refused_before_anything_is_written(kwargs, message, tmp_path):
    name = kwargs.pop("name")
    with pytest.raises(PublishedError, match=message):
        build_published(name, cache_dir=tmp_path / "cache", **kwargs)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def count(name: str, layers: int) -> int:
    return sum(torch.Size(shape).numel() for _, shape in tensor_layout(published_config(name, layers)))


def test_published_sizes():
    """The published configs hold the published parameter counts (model cards: OLMoE-1B-7B 6.9 B,
    Qwen1.5-MoE-A2.7B 14.3 B, Mixtral-8x7B 46.7 B). Counted on the meta device for 1 and 2 layers and
    extended to the published depth (every layer of the three is alike; building the full 3,000-module
    models took most of a minute on a loaded 2-core machine)."""
    counts = {}
    for name, spec in PUBLISHED.items():
        one, two = count(name, 1), count(name, 2)
        counts[name] = one + (spec.config["num_hidden_layers"] - 1) * (two - one)
    assert {name: round(n / 1e9, 1) for name, n in counts.items()} == {
        "olmoe-1b-7b": 6.9,
        "qwen1.5-moe-a2.7b": 14.3,
        "mixtral-8x7b": 46.7,
        "moonlight-16b-a3b": 16.0,  # (the model card's "16B total"; DeepSeek-V2-Lite's card: 15.7 B)
        "deepseek-v2-lite": 15.7,
        "qwen3-30b-a3b": 30.5,
        "gpt-oss-20b": 20.9,
        "glm-4.5-air": 106.9,  # (the model card's "106B total"; its MTP layer is not in the stand-in)
    }
