"""GGUF export of the families llama.cpp has (issue 32 §3): lab model (tiny preset) -> `to_hf` -> `export_gguf`,
read back with the gguf package's reader: the architecture, the hyperparameter keys llama.cpp reads, exactly
the tensors llama.cpp's loader creates for that architecture with its shapes (ggml order, as
``create_tensor(..., {ne0, ne1, ...})`` in llama.cpp's ``src/llama-model.cpp`` / ``src/models/*.cpp``), and their
values equal to the Hugging Face tensors after the converter's transform, written out per family below.

llama.cpp itself (the prebuilt CPU build of `tests/llama_cpp_engine.py`, llama-cpp-cffi 0.4.17, early 2025)
generates our greedy tokens from the olmoe, qwen2moe and deepseek2 files (DeepSeek-V3 and V2 routing, shared
experts, dense first layer, in the unsplit MLA layout that build reads; it predates expert groups, so those runs
use one group). That build has no qwen3moe, gpt-oss or glm4moe architecture (it refuses to load them), nor
the split MLA tensors: for those the layout tests here are the check."""

from __future__ import annotations

import json
import re

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_core import MoEForCausalLM, get_config
from moe_core.cli import main
from moe_core.convert import to_hf
from moe_core.inference.gguf_export import GGUFExportError, export_gguf

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

VOCAB = 320
# name: (preset, HF architecture, config overrides, MLA layout)
# DeepSeek-V2's routing on the deepseek-tiny preset (softmax scores, a group scored by its best expert, no
# renormalization, no selection bias)
V2_ROUTING = dict(
    router_score="softmax", router_group_score="max", norm_topk_prob=False, router_bias_update_rate=0.0
)
CASES = {
    "qwen3_moe": ("qwen3-tiny", "qwen3_moe", {}, "split"),
    "deepseek_v3": ("deepseek-tiny", "deepseek_v3", {}, "split"),
    "deepseek_v3_unsplit": ("deepseek-tiny", "deepseek_v3", {}, "unsplit"),
    # DeepSeek-V2-Lite's shape: q without LoRA, softmax scores, no renormalization, no selection bias
    "deepseek_v2": (
        "deepseek-tiny",
        "deepseek_v2",
        dict(V2_ROUTING, q_lora_rank=None, router_groups=1, router_topk_groups=1),
        "split",
    ),
    "gpt_oss": ("gptoss-tiny", "gpt_oss", {}, "split"),
    "glm4_moe": ("glm4moe-tiny", "glm4_moe", {}, "split"),
    "olmoe": ("olmoe-tiny", "olmoe", dict(num_key_value_heads=4), "split"),  # llama.cpp's olmoe: no GQA
    "qwen2_moe": ("shared-tiny", "qwen2_moe", {}, "split"),
}
ENGINE_CASES = {
    "olmoe": CASES["olmoe"],
    "qwen2_moe": CASES["qwen2_moe"],
    "deepseek_v3": ("deepseek-tiny", "deepseek_v3", dict(router_groups=1, router_topk_groups=1), "unsplit"),
    "deepseek_v2": (
        "deepseek-tiny",
        "deepseek_v2",
        dict(V2_ROUTING, router_groups=1, router_topk_groups=1),
        "unsplit",
    ),
}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from moe_core.data.tokenizer import train_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    texts = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(200)]
    train_tokenizer(texts, vocab_size=300, min_frequency=1).save_pretrained(path)
    return path


def _export(case, tmp_path, tokenizer_dir):
    """A lab model of the case (weights large enough that routing and tokens are decisive, a nonzero selection
    bias where the family has one) -> `to_hf` -> `moe-lab export gguf`; returns the model, the HF directory, the
    file."""
    preset, arch, overrides, mla = case
    torch.manual_seed(0)
    model = MoEForCausalLM(get_config(preset, vocab_size=VOCAB, **overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0.0, 0.2)
        if arch != "deepseek_v2":
            for name, b in model.named_buffers():
                if name.endswith("expert_bias"):
                    b.normal_(0.0, 0.05)
    to_hf(model, tmp_path / "hf", architecture=arch, tokenizer_dir=tokenizer_dir)
    # `moe-lab export gguf`, its --mla flag included
    assert (
        main(["export", "gguf", str(tmp_path / "hf"), "--out", str(tmp_path / "model.gguf"), "--mla", mla])
        == 0
    )
    return model, tmp_path / "hf", tmp_path / "model.gguf"


def _field(reader, key):
    field = reader.fields[key]
    value = field.parts[field.data[0]]
    return bytes(value).decode() if field.types[0] == gguf.GGUFValueType.STRING else value.tolist()[0]


# ------------------------------------------------------------------------------------------------ llama.cpp's view
def llama_cpp_shapes(cfg: dict, arch: str, mla: str) -> dict[str, tuple[int, ...]]:
    """Every tensor llama.cpp's loader creates for ``arch`` from this config, with its ``ne`` (trailing 1s
    dropped), transcribed from its ``create_tensor`` calls."""
    D, V, H = cfg["hidden_size"], cfg["vocab_size"], cfg["num_attention_heads"]
    Hkv = cfg.get("num_key_value_heads") or H
    E = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts")
    hd = cfg.get("head_dim") or D // H
    shapes = {"token_embd.weight": (D, V), "output_norm.weight": (D,), "output.weight": (D, V)}
    for i in range(cfg["num_hidden_layers"]):
        b = f"blk.{i}."
        s = {b + "attn_norm.weight": (D,)}
        if arch == "deepseek2":
            r, rope, nope, v = (
                cfg["kv_lora_rank"],
                cfg["qk_rope_head_dim"],
                cfg["qk_nope_head_dim"],
                cfg["v_head_dim"],
            )
            if cfg.get("q_lora_rank"):
                q = cfg["q_lora_rank"]
                s |= {b + "attn_q_a.weight": (D, q), b + "attn_q_a_norm.weight": (q,)}
                s[b + "attn_q_b.weight"] = (q, H * (nope + rope))
            else:
                s[b + "attn_q.weight"] = (D, H * (nope + rope))
            s |= {b + "attn_kv_a_mqa.weight": (D, r + rope), b + "attn_kv_a_norm.weight": (r,)}
            if mla == "split":
                s |= {b + "attn_k_b.weight": (nope, r, H), b + "attn_v_b.weight": (r, v, H)}
            else:
                s[b + "attn_kv_b.weight"] = (r, H * (nope + v))
            s[b + "attn_output.weight"] = (H * v, D)
        else:
            s |= {
                b + "attn_q.weight": (D, H * hd),
                b + "attn_k.weight": (D, Hkv * hd),
                b + "attn_v.weight": (D, Hkv * hd),
                b + "attn_output.weight": (H * hd, D),
            }
        if cfg.get("attention_bias") or cfg.get("qkv_bias"):
            s |= {
                b + "attn_q.bias": (H * hd,),
                b + "attn_k.bias": (Hkv * hd,),
                b + "attn_v.bias": (Hkv * hd,),
            }
        if arch == "qwen3moe":
            s |= {b + "attn_q_norm.weight": (hd,), b + "attn_k_norm.weight": (hd,)}
        if arch == "olmoe":
            s |= {b + "attn_q_norm.weight": (D,), b + "attn_k_norm.weight": (D,)}
        if arch == "gpt-oss":
            s |= {b + "attn_output.bias": (D,), b + "attn_sinks.weight": (H,)}
        norm = "post_attention_norm" if arch in ("gpt-oss", "glm4moe") else "ffn_norm"
        s[f"{b}{norm}.weight"] = (D,)
        if i < (cfg.get("first_k_dense_replace") or 0):
            F = cfg["intermediate_size"]
            s |= {b + "ffn_gate.weight": (D, F), b + "ffn_up.weight": (D, F), b + "ffn_down.weight": (F, D)}
        else:
            F = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
            s |= {
                b + "ffn_gate_inp.weight": (D, E),
                b + "ffn_gate_exps.weight": (D, F, E),
                b + "ffn_up_exps.weight": (D, F, E),
                b + "ffn_down_exps.weight": (F, D, E),
            }
            if arch == "gpt-oss":
                s |= {
                    b + "ffn_gate_inp.bias": (E,),
                    b + "ffn_gate_exps.bias": (F, E),
                    b + "ffn_up_exps.bias": (F, E),
                    b + "ffn_down_exps.bias": (D, E),
                }
            if arch in ("deepseek2", "glm4moe") and cfg["model_type"] != "deepseek_v2":
                s[b + "exp_probs_b.bias"] = (E,)
            if arch in ("deepseek2", "glm4moe"):  # shexp width: n_ff_exp * n_expert_shared
                Fs = F * cfg["n_shared_experts"]
                s |= {b + "ffn_gate_shexp.weight": (D, Fs), b + "ffn_up_shexp.weight": (D, Fs)}
                s[b + "ffn_down_shexp.weight"] = (Fs, D)
            if arch == "qwen2moe":
                Fs = cfg["shared_expert_intermediate_size"]
                s |= {b + "ffn_gate_shexp.weight": (D, Fs), b + "ffn_up_shexp.weight": (D, Fs)}
                s |= {b + "ffn_down_shexp.weight": (Fs, D), b + "ffn_gate_inp_shexp.weight": (D,)}
        shapes |= s
    return shapes


def expected_values(hf: dict[str, torch.Tensor], cfg: dict, arch: str, mla: str) -> dict[str, np.ndarray]:
    """The Hugging Face tensors under llama.cpp's names after the converter's transform (numpy order)."""
    out = {
        "token_embd.weight": hf["model.embed_tokens.weight"],
        "output_norm.weight": hf["model.norm.weight"],
    }
    out["output.weight"] = hf["lm_head.weight"]
    E = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts")
    for i in range(cfg["num_hidden_layers"]):
        b, p = f"blk.{i}.", f"model.layers.{i}."
        a = p + "self_attn."
        out[b + "attn_norm.weight"] = hf[p + "input_layernorm.weight"]
        norm = "post_attention_norm" if arch in ("gpt-oss", "glm4moe") else "ffn_norm"
        out[f"{b}{norm}.weight"] = hf[p + "post_attention_layernorm.weight"]
        if arch == "deepseek2":
            pairs = {"attn_q_a": "q_a_proj", "attn_q_a_norm": "q_a_layernorm", "attn_q_b": "q_b_proj"}
            pairs |= {"attn_q": "q_proj", "attn_kv_a_mqa": "kv_a_proj_with_mqa", "attn_output": "o_proj"}
            pairs |= {"attn_kv_a_norm": "kv_a_layernorm"}
            out |= {
                f"{b}{g}.weight": hf[f"{a}{h}.weight"] for g, h in pairs.items() if f"{a}{h}.weight" in hf
            }
            kv_b = hf[a + "kv_b_proj.weight"]
            if mla == "split":  # per head [nope + v, r]: k_b = the nope rows transposed, v_b = the v rows
                H, nope = cfg["num_attention_heads"], cfg["qk_nope_head_dim"]
                kv_b_HXR = kv_b.reshape(H, -1, kv_b.shape[-1])
                out[b + "attn_k_b.weight"] = kv_b_HXR[:, :nope].transpose(1, 2)
                out[b + "attn_v_b.weight"] = kv_b_HXR[:, nope:]
            else:
                out[b + "attn_kv_b.weight"] = kv_b
        else:
            for g, h in {
                "attn_q": "q_proj",
                "attn_k": "k_proj",
                "attn_v": "v_proj",
                "attn_output": "o_proj",
            }.items():
                out[f"{b}{g}.weight"] = hf[f"{a}{h}.weight"]
                if f"{a}{h}.bias" in hf:
                    out[f"{b}{g}.bias"] = hf[f"{a}{h}.bias"]
        for g in ("q_norm", "k_norm"):
            if f"{a}{g}.weight" in hf:
                out[f"{b}attn_{g}.weight"] = hf[f"{a}{g}.weight"]
        if a + "sinks" in hf:
            out[b + "attn_sinks.weight"] = hf[a + "sinks"]
        m = p + "mlp."
        if m + "gate_proj.weight" in hf:  # a dense layer
            out |= {f"{b}ffn_{x}.weight": hf[f"{m}{x}_proj.weight"] for x in ("gate", "up", "down")}
        elif arch == "gpt-oss":  # fused [E, D, 2F], gate at even columns
            gate_up, bias = hf[m + "experts.gate_up_proj"], hf[m + "experts.gate_up_proj_bias"]
            out[b + "ffn_gate_exps.weight"] = gate_up[..., 0::2].transpose(1, 2)
            out[b + "ffn_up_exps.weight"] = gate_up[..., 1::2].transpose(1, 2)
            out[b + "ffn_gate_exps.bias"], out[b + "ffn_up_exps.bias"] = bias[:, 0::2], bias[:, 1::2]
            out[b + "ffn_down_exps.weight"] = hf[m + "experts.down_proj"].transpose(1, 2)
            out[b + "ffn_down_exps.bias"] = hf[m + "experts.down_proj_bias"]
            out[b + "ffn_gate_inp.weight"], out[b + "ffn_gate_inp.bias"] = (
                hf[m + "router.weight"],
                hf[m + "router.bias"],
            )
        else:
            out[b + "ffn_gate_inp.weight"] = hf[m + "gate.weight"]
            for x in ("gate", "up", "down"):
                out[f"{b}ffn_{x}_exps.weight"] = torch.stack(
                    [hf[f"{m}experts.{e}.{x}_proj.weight"] for e in range(E)]
                )
                for shared in ("shared_experts", "shared_expert"):
                    if f"{m}{shared}.{x}_proj.weight" in hf:
                        out[f"{b}ffn_{x}_shexp.weight"] = hf[f"{m}{shared}.{x}_proj.weight"]
            if m + "gate.e_score_correction_bias" in hf:
                out[b + "exp_probs_b.bias"] = hf[m + "gate.e_score_correction_bias"]
            if m + "shared_expert_gate.weight" in hf:
                out[b + "ffn_gate_inp_shexp.weight"] = hf[m + "shared_expert_gate.weight"]
    return {name: t.numpy() for name, t in out.items()}


# hyperparameters llama.cpp reads, per case: key -> value (the config.json fields they come from)
def expected_keys(cfg: dict, arch: str, mla: str) -> dict[str, object]:
    keys = {
        "general.architecture": arch,
        f"{arch}.block_count": cfg["num_hidden_layers"],
        f"{arch}.embedding_length": cfg["hidden_size"],
        f"{arch}.attention.head_count": cfg["num_attention_heads"],
        f"{arch}.expert_used_count": cfg["num_experts_per_tok"],
        "general.file_type": int(gguf.LlamaFileType.ALL_F32),
        "tokenizer.ggml.model": "gpt2",
    }
    if arch == "qwen3moe":
        keys |= {
            f"{arch}.expert_count": cfg["num_local_experts"],
            f"{arch}.attention.key_length": cfg["head_dim"],
        }
        keys[f"{arch}.expert_feed_forward_length"] = cfg["moe_intermediate_size"]
    if arch == "qwen2moe":
        keys[f"{arch}.expert_shared_feed_forward_length"] = cfg["shared_expert_intermediate_size"]
    if arch == "deepseek2":
        r, rope, nope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"]
        keys |= {
            f"{arch}.expert_count": cfg["n_routed_experts"],
            f"{arch}.expert_shared_count": cfg["n_shared_experts"],
            f"{arch}.leading_dense_block_count": cfg["first_k_dense_replace"],
            f"{arch}.expert_feed_forward_length": cfg["moe_intermediate_size"],
            f"{arch}.attention.kv_lora_rank": r,
            f"{arch}.attention.q_lora_rank": cfg.get("q_lora_rank") or 0,
            f"{arch}.rope.dimension_count": rope,
            f"{arch}.expert_weights_scale": pytest.approx(cfg["routed_scaling_factor"]),
            f"{arch}.expert_gating_func": 1 if cfg["model_type"] == "deepseek_v2" else 2,  # softmax / sigmoid
        }
        if mla == "split":
            keys |= {f"{arch}.attention.head_count_kv": 1, f"{arch}.attention.key_length": r + rope}
            keys |= {f"{arch}.attention.value_length": r, f"{arch}.attention.key_length_mla": nope + rope}
            keys[f"{arch}.attention.value_length_mla"] = cfg["v_head_dim"]
        else:
            keys |= {f"{arch}.attention.head_count_kv": cfg["num_attention_heads"]}
            keys |= {
                f"{arch}.attention.key_length": nope + rope,
                f"{arch}.attention.value_length": cfg["v_head_dim"],
            }
        if cfg.get("norm_topk_prob"):
            keys[f"{arch}.expert_weights_norm"] = True
        if cfg["model_type"] == "deepseek_v3" and cfg["n_group"] > 1:
            keys |= {
                f"{arch}.expert_group_count": cfg["n_group"],
                f"{arch}.expert_group_used_count": cfg["topk_group"],
            }
    if arch == "gpt-oss":
        rope = cfg["rope_parameters"]
        keys |= {
            f"{arch}.attention.sliding_window": cfg["sliding_window"],
            f"{arch}.expert_count": cfg["num_local_experts"],
            f"{arch}.expert_feed_forward_length": cfg["intermediate_size"],
            f"{arch}.attention.key_length": cfg["head_dim"],
            f"{arch}.rope.freq_base": pytest.approx(rope["rope_theta"]),
            f"{arch}.rope.scaling.type": "yarn",
            f"{arch}.rope.scaling.factor": pytest.approx(rope["factor"]),
            f"{arch}.rope.scaling.original_context_length": rope["original_max_position_embeddings"],
            f"{arch}.rope.scaling.yarn_beta_fast": pytest.approx(rope["beta_fast"]),
        }
    if arch == "glm4moe":
        keys |= {
            f"{arch}.rope.dimension_count": int(
                cfg["head_dim"] * cfg["rope_parameters"]["partial_rotary_factor"]
            ),
            f"{arch}.attention.key_length": cfg["head_dim"],
            f"{arch}.expert_count": cfg["n_routed_experts"],
            f"{arch}.expert_shared_count": cfg["n_shared_experts"],
            f"{arch}.leading_dense_block_count": cfg["first_k_dense_replace"],
            f"{arch}.expert_gating_func": 2,
            f"{arch}.expert_weights_norm": True,
            f"{arch}.expert_weights_scale": pytest.approx(cfg["routed_scaling_factor"]),
        }
    return keys


ARCH = {"qwen3_moe": "qwen3moe", "deepseek_v3": "deepseek2", "deepseek_v2": "deepseek2", "gpt_oss": "gpt-oss"}
ARCH |= {"glm4_moe": "glm4moe", "olmoe": "olmoe", "qwen2_moe": "qwen2moe"}


# ------------------------------------------------------------------------------------------------ layout
@pytest.mark.parametrize("name", list(CASES))
def test_gguf_has_llama_cpps_layout_keys_and_the_hf_values(name, tmp_path, tokenizer_dir):
    _, hf_dir, path = _export(CASES[name], tmp_path, tokenizer_dir)
    _, hf_arch, _, mla = CASES[name]
    arch = ARCH[hf_arch]
    cfg = json.loads((hf_dir / "config.json").read_text())
    reader = gguf.GGUFReader(path)

    for key, value in expected_keys(cfg, arch, mla).items():
        assert _field(reader, key) == value, key
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == cfg["vocab_size"]

    def ne(t):
        dims = [int(n) for n in t.shape]
        while len(dims) > 1 and dims[-1] == 1:
            dims.pop()
        return tuple(dims)

    shapes = {t.name: ne(t) for t in reader.tensors}
    assert shapes == llama_cpp_shapes(cfg, arch, mla)
    # and every name is one the gguf package lists for the architecture
    enum = next(e for e, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    templates = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[enum]}
    assert {re.sub(r"^blk\.\d+\.", "blk.{bid}.", n.rsplit(".", 1)[0]) for n in shapes} <= templates

    expected = expected_values(load_file(str(hf_dir / "model.safetensors")), cfg, arch, mla)
    assert set(expected) == set(shapes)
    for t in reader.tensors:
        np.testing.assert_array_equal(
            np.asarray(t.data).reshape(expected[t.name].shape), expected[t.name], err_msg=t.name
        )


def test_transformers_5_fused_experts_give_the_same_file(tmp_path, tokenizer_dir):
    """A directory in transformers 5's fused expert layout (``save_original_format=False``: gate_up_proj
    [E, 2F, D], gate rows first; down_proj [E, D, F]) is written exactly as its per-expert twin."""
    _, hf_dir, path = _export(CASES["qwen3_moe"], tmp_path, tokenizer_dir)
    tensors = load_file(str(hf_dir / "model.safetensors"))
    E = json.loads((hf_dir / "config.json").read_text())["num_local_experts"]
    for i in range(2):
        m = f"model.layers.{i}.mlp.experts"
        gate, up, down = (
            [tensors.pop(f"{m}.{e}.{x}_proj.weight") for e in range(E)] for x in ("gate", "up", "down")
        )
        tensors[f"{m}.gate_up_proj"] = torch.cat([torch.stack(gate), torch.stack(up)], dim=1)
        tensors[f"{m}.down_proj"] = torch.stack(down)
    save_file(tensors, str(hf_dir / "model.safetensors"))
    export_gguf(hf_dir, tmp_path / "fused.gguf")
    per_expert = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(path).tensors}
    fused = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(tmp_path / "fused.gguf").tensors}
    assert per_expert.keys() == fused.keys()
    for name in per_expert:
        np.testing.assert_array_equal(fused[name], per_expert[name], err_msg=name)


def test_split_mla_tensors_rebuild_kv_b(tmp_path, tokenizer_dir):
    """The split layout loses nothing: per head, k_b transposed back over v_b is kv_b_proj's rows."""
    model, hf_dir, path = _export(CASES["deepseek_v3"], tmp_path, tokenizer_dir)
    cfg = model.config
    T = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(path).tensors}
    H, r = cfg.num_attention_heads, cfg.kv_lora_rank
    k_b = T["blk.1.attn_k_b.weight"].reshape(H, r, cfg.qk_nope_head_dim)
    v_b = T["blk.1.attn_v_b.weight"].reshape(H, cfg.v_head_dim, r)
    kv_b = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, r)
    np.testing.assert_array_equal(kv_b, model.model.layers[1].self_attn.kv_b_proj.weight.detach().numpy())
    assert not np.array_equal(T["blk.1.exp_probs_b.bias"], np.zeros(cfg.num_experts))


# ------------------------------------------------------------------------------------------------ refusals
def _config(tmp_path, preset, arch, overrides=None, edit=None):
    """Only config.json (no weights, no tokenizer): a refusal must come before either is read."""
    torch.manual_seed(0)
    to_hf(MoEForCausalLM(get_config(preset, **(overrides or {}))), tmp_path / "full", architecture=arch)
    cfg = json.loads((tmp_path / "full" / "config.json").read_text())
    cfg.update(edit or {})
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    return tmp_path / "hf"


@pytest.mark.parametrize(
    "preset, arch, overrides, edit, match",
    [
        ("gptoss-tiny", "gpt_oss", {}, {"swiglu_limit": 5.0}, "swiglu_limit=5.0.*hard-codes limit 7.0"),
        ("gptoss-tiny", "gpt_oss", {}, {"layer_types": ["full_attention"] * 2}, "slides on the even layers"),
        ("olmoe-tiny", "olmoe", {}, {}, "num_key_value_heads=2 < num_attention_heads=4"),
        ("qwen3-tiny", "qwen3_moe", {}, {"mlp_only_layers": [0]}, "experts in every layer"),
        (
            "qwen3-tiny",
            "qwen3_moe",
            {},
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
            "rope_type='linear'",
        ),
        (
            "deepseek-tiny",
            "deepseek_v2",
            V2_ROUTING,
            {},
            "n_group=4.*sum of its two best",
        ),
        ("deepseek-tiny", "deepseek_v3", {}, {"kv_lora_rank": None}, "lacks kv_lora_rank"),
        ("deepseek-tiny", "deepseek_v3", {}, {"scoring_func": "sqrtsoftplus"}, "scoring_func='sqrtsoftplus'"),
        (
            "gptoss-tiny",
            "gpt_oss",
            {},
            {"quantization_config": {"quant_method": "mxfp4"}},
            "'mxfp4'.*from-hf",
        ),
    ],
)
def test_what_llama_cpp_cannot_run_is_refused_before_any_weight(
    tmp_path, preset, arch, overrides, edit, match
):
    hf_dir = _config(tmp_path, preset, arch, overrides, edit)
    with pytest.raises(GGUFExportError, match=match):
        export_gguf(hf_dir, tmp_path / "model.gguf")
    assert not list(tmp_path.glob("*.gguf"))


def test_published_gpt_oss_yarn_without_truncation_is_written_and_said(tmp_path, tokenizer_dir, caplog):
    """gpt-oss's published ``truncate: false``: llama.cpp always truncates YaRN's correction range, so the file
    runs slightly differently there; written (as llama.cpp's converter does), with a warning naming why."""
    torch.manual_seed(0)
    to_hf(
        MoEForCausalLM(get_config("gptoss-tiny", vocab_size=VOCAB)),
        tmp_path / "hf",
        "gpt_oss",
        tokenizer_dir=tokenizer_dir,
    )
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["rope_parameters"]["truncate"] = False
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    with caplog.at_level("WARNING", logger="moe_core.inference.gguf_export"):
        export_gguf(tmp_path / "hf", tmp_path / "model.gguf")
    assert "truncate=false" in caplog.text and "always truncates" in caplog.text
    assert _field(gguf.GGUFReader(tmp_path / "model.gguf"), "gpt-oss.rope.scaling.type") == "yarn"


def test_unknown_mla_layout_is_refused(tmp_path):
    with pytest.raises(GGUFExportError, match="mla='absorbed'.*split, unsplit"):
        export_gguf(_config(tmp_path, "deepseek-tiny", "deepseek_v3"), tmp_path / "m.gguf", mla="absorbed")


# ------------------------------------------------------------------------------------------------ llama.cpp
@pytest.mark.slow
@pytest.mark.parametrize("name", list(ENGINE_CASES))
def test_llama_cpp_generates_our_greedy_tokens(name, tmp_path, tokenizer_dir):
    """The file in llama.cpp itself (installed on first use, `tests/llama_cpp_engine.py`): it loads, and its
    greedy continuation is ours token for token; its logits after the prompt are close to ours."""
    from tests.llama_cpp_engine import greedy, install

    site = install()
    model, _, path = _export(ENGINE_CASES[name], tmp_path, tokenizer_dir)
    prompt = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model.generate(prompt[None], max_new_tokens=16, do_sample=False)[0, 9:].tolist()
        logits = model(prompt[None]).logits[0, -1].numpy()
    engine = greedy(path, prompt.tolist(), 16, site)
    assert engine["tokens"] == ours
    # llama.cpp's CPU kernels (fp16 K*Q among them) against fp32: close, not bitwise
    np.testing.assert_allclose(np.array(engine["logits"]), logits, atol=2e-2)
