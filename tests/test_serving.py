"""Serving path: lab checkpoint -> `moe-lab convert to-hf --arch mixtral` -> `moe-lab export gguf`, read back
with the gguf package's reader and checked against llama.cpp's Mixtral layout; the file's tensors, run through
a NumPy transcription of llama.cpp's llama-architecture MoE graph (interleaved RoPE, softmax top-k with
renormalized weights), give our model's logits; and llama.cpp itself (a prebuilt CPU build,
`tests/llama_cpp_engine.py`) generates our greedy tokens from the file (README, Serving)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from moe_core import MoEForCausalLM, get_config
from moe_core.inference.gguf_export import GGUFExportError, permute_rope_rows, unpermute_rope_rows

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def _field(reader, key):
    field = reader.fields[key]
    value = field.parts[field.data[0]]
    return bytes(value).decode() if field.types[0] == gguf.GGUFValueType.STRING else value.tolist()[0]


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope_interleaved(x_SHd, base):
    """llama.cpp's LLAMA_ROPE_TYPE_NORM: rotate adjacent pairs (x[2i], x[2i+1]) by pos * base^(-2i/d)."""
    S, _, d = x_SHd.shape
    theta = np.arange(S)[:, None] * base ** (-np.arange(0, d, 2) / d)[None, :]
    cos, sin = np.cos(theta)[:, None], np.sin(theta)[:, None]
    x0, x1 = x_SHd[..., 0::2], x_SHd[..., 1::2]
    out = np.empty_like(x_SHd)
    out[..., 0::2], out[..., 1::2] = x0 * cos - x1 * sin, x0 * sin + x1 * cos
    return out


def llama_cpp_reference(reader, ids):
    """Logits of a llama-architecture MoE from GGUF tensors, as llama.cpp's graph computes them (fp64)."""
    T = {
        t.name: np.asarray(t.data, dtype=np.float64).reshape([int(n) for n in reversed(t.shape)])
        for t in reader.tensors
    }
    n_layer, n_head = _field(reader, "llama.block_count"), _field(reader, "llama.attention.head_count")
    n_kv, k_used = _field(reader, "llama.attention.head_count_kv"), _field(reader, "llama.expert_used_count")
    eps, base = (
        _field(reader, "llama.attention.layer_norm_rms_epsilon"),
        _field(reader, "llama.rope.freq_base"),
    )
    x = T["token_embd.weight"][ids]
    S, D = x.shape
    hd = D // n_head
    causal = np.triu(np.full((S, S), -np.inf), 1)
    for i in range(n_layer):
        b = f"blk.{i}."
        h = _rms(x, T[b + "attn_norm.weight"], eps)
        q = _rope_interleaved((h @ T[b + "attn_q.weight"].T).reshape(S, n_head, hd), base)
        k = _rope_interleaved((h @ T[b + "attn_k.weight"].T).reshape(S, n_kv, hd), base)
        v = (h @ T[b + "attn_v.weight"].T).reshape(S, n_kv, hd)
        k, v = np.repeat(k, n_head // n_kv, axis=1), np.repeat(v, n_head // n_kv, axis=1)
        att = np.einsum("shd,thd->hst", q, k) / np.sqrt(hd) + causal
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        x = x + np.einsum("hst,thd->shd", att, v).reshape(S, D) @ T[b + "attn_output.weight"].T
        h = _rms(x, T[b + "ffn_norm.weight"], eps)
        logits = h @ T[b + "ffn_gate_inp.weight"].T
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        y = np.zeros_like(x)
        for t in range(S):
            top = np.argsort(-probs[t])[:k_used]
            w = probs[t, top] / probs[t, top].sum()  # Mixtral: top-k weights renormalized
            for e, we in zip(top, w):
                g, u = T[b + "ffn_gate_exps.weight"][e] @ h[t], T[b + "ffn_up_exps.weight"][e] @ h[t]
                y[t] += we * (T[b + "ffn_down_exps.weight"][e] @ (g / (1 + np.exp(-g)) * u))
        x = x + y
    out = T.get("output.weight", T["token_embd.weight"])
    return _rms(x, T["output_norm.weight"], eps) @ out.T


def test_rope_row_permutation_round_trips():
    w = torch.randn(4 * 8, 5)
    assert torch.equal(unpermute_rope_rows(permute_rope_rows(w, 4), 4), w)
    assert not torch.equal(permute_rope_rows(w, 4), w)


def _export_tiny_gguf(tmp_path) -> MoEForCausalLM:
    """A lab checkpoint (mixtral-tiny, weights large enough that routing and tokens are decisive, with its
    tokenizer) -> `moe-lab convert to-hf --arch mixtral` -> `moe-lab export gguf` at tmp_path/model.gguf."""
    from moe_core.cli import main
    from moe_core.data.tokenizer import train_tokenizer

    torch.manual_seed(0)
    model = MoEForCausalLM(get_config("mixtral-tiny", vocab_size=320)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0.0, 0.2)
    model.save_pretrained(tmp_path / "lab")
    texts = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(200)]
    train_tokenizer(texts, vocab_size=300, min_frequency=1).save_pretrained(tmp_path / "lab")

    assert (
        main(["convert", "to-hf", str(tmp_path / "lab"), "--arch", "mixtral", "--out", str(tmp_path / "hf")])
        == 0
    )
    assert main(["export", "gguf", str(tmp_path / "hf"), "--out", str(tmp_path / "model.gguf")]) == 0
    return model


def test_lab_checkpoint_to_gguf_matches_llama_cpp_layout_and_logits(tmp_path, capsys):
    model = _export_tiny_gguf(tmp_path)
    capsys.readouterr()

    reader = gguf.GGUFReader(tmp_path / "model.gguf")
    cfg = model.config
    assert _field(reader, "general.architecture") == "llama"
    assert _field(reader, "llama.expert_count") == cfg.num_experts
    assert _field(reader, "llama.expert_used_count") == cfg.num_experts_per_tok
    assert _field(reader, "llama.block_count") == cfg.num_hidden_layers
    assert _field(reader, "tokenizer.ggml.model") == "gpt2"
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == cfg.vocab_size
    assert len(reader.fields["tokenizer.ggml.merges"].data) > 0

    shapes = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}  # ggml order reversed
    E, D, F_ = cfg.num_experts, cfg.hidden_size, cfg.expert_intermediate_size
    expected = {"token_embd.weight": (cfg.vocab_size, D), "output_norm.weight": (D,)}
    if not cfg.tie_word_embeddings:
        expected["output.weight"] = (cfg.vocab_size, D)
    for i in range(cfg.num_hidden_layers):
        b = f"blk.{i}."
        expected.update(
            {
                b + "attn_norm.weight": (D,),
                b + "ffn_norm.weight": (D,),
                b + "attn_q.weight": (cfg.num_attention_heads * cfg.head_dim, D),
                b + "attn_k.weight": (cfg.num_key_value_heads * cfg.head_dim, D),
                b + "attn_v.weight": (cfg.num_key_value_heads * cfg.head_dim, D),
                b + "attn_output.weight": (D, cfg.num_attention_heads * cfg.head_dim),
                b + "ffn_gate_inp.weight": (E, D),
                b + "ffn_gate_exps.weight": (E, F_, D),
                b + "ffn_up_exps.weight": (E, F_, D),
                b + "ffn_down_exps.weight": (E, D, F_),
            }
        )
    assert shapes == expected
    layer0 = {
        t.name: torch.from_numpy(np.array(t.data)) for t in reader.tensors if t.name.startswith("blk.0.")
    }
    q = layer0["blk.0.attn_q.weight"].reshape(expected["blk.0.attn_q.weight"])
    torch.testing.assert_close(
        unpermute_rope_rows(q, cfg.num_attention_heads),
        model.model.layers[0].self_attn.q_proj.weight.detach(),
    )
    torch.testing.assert_close(
        layer0["blk.0.ffn_gate_exps.weight"].reshape(E, F_, D),
        model.model.layers[0].mlp.experts.gate_proj.detach(),
    )

    ids = torch.randint(0, cfg.vocab_size, (9,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model(ids[None]).logits[0].double().numpy()
    np.testing.assert_allclose(llama_cpp_reference(reader, ids.numpy()), ours, atol=2e-4, rtol=1e-4)


def test_gguf_export_refuses_other_layouts(tmp_path):
    from moe_core.inference.gguf_export import export_gguf

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "switch_transformers"}')
    with pytest.raises(GGUFExportError, match="'switch_transformers' has no GGUF layout.*--arch"):
        export_gguf(tmp_path / "hf", tmp_path / "m.gguf")
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".*tmp"))


@pytest.mark.slow
def test_llama_cpp_generates_our_greedy_tokens_from_the_exported_gguf(tmp_path):
    """Issue 16 §4: the exported file in llama.cpp itself (a prebuilt CPU build, `tests/llama_cpp_engine.py`;
    installed on first use): it loads, and its greedy continuation is ours, token for token."""
    from tests.llama_cpp_engine import greedy, install

    site = install()
    model = _export_tiny_gguf(tmp_path)
    prompt = torch.randint(0, model.config.vocab_size, (9,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model.generate(prompt[None], max_new_tokens=16, do_sample=False)[0, 9:].tolist()
        logits = model(prompt[None]).logits[0, -1].numpy()
    engine = greedy(tmp_path / "model.gguf", prompt.tolist(), 16, site)
    assert engine["tokens"] == ours
    # llama.cpp's CPU kernels (fp16 K*Q among them) against fp32: close, not bitwise
    np.testing.assert_allclose(np.array(engine["logits"]), logits, atol=2e-2)
