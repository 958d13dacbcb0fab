"""GGUF export of a Hugging Face Mixtral checkpoint, for llama.cpp (and the engines built on it).

The path from a lab checkpoint: ``moe-lab convert to-hf CKPT --arch mixtral --out HF`` (exact, see
`moe_core.convert`), then ``moe-lab export gguf HF --out model.gguf``. The file follows llama.cpp's own
converter (``convert_hf_to_gguf.py``, class ``LlamaModel``, which also handles ``MixtralForCausalLM``):

- architecture ``llama`` with ``llama.expert_count`` / ``llama.expert_used_count``; tensor names from the
  ``gguf`` package's `TensorNameMap` (``blk.N.attn_q``, ``blk.N.ffn_gate_inp`` for the router,
  ``blk.N.ffn_{gate,up,down}_exps`` for the experts stacked [E, ...] as llama.cpp's converter stacks them);
- q_proj and k_proj rows permuted from Hugging Face's rotate-half RoPE layout to llama.cpp's interleaved
  one (``LlamaModel.permute``), so the file is what llama.cpp's converter would write;
- the byte-level BPE tokenizer (``tokenizer.json``) as ``tokenizer.ggml.model = gpt2`` with its merges, padded
  with unused tokens up to the model's vocabulary size;
- float32 weights (``general.file_type = ALL_F32``); quantize with llama.cpp's ``llama-quantize`` afterwards.

Only the Mixtral layout is written (OLMoE's q/k norms and Qwen2-MoE's shared expert have their own llama.cpp
architectures, not handled here): convert with ``--arch mixtral``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

from moe_core.errors import MoELabError
from moe_core.fileio import atomic_file, check_output_file


class GGUFExportError(MoELabError):
    """A checkpoint that cannot be written as GGUF; the message says why and what to do."""


# Hugging Face Mixtral's per-expert projections and the merged name llama.cpp's converter gives their stack
_EXPERT_PROJ = {"w1": "gate", "w3": "up", "w2": "down"}


def permute_rope_rows(w_OI: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's ``LlamaModel.permute``: per head, rows (first half, second half) -> interleaved pairs."""
    O = w_OI.shape[0]
    return w_OI.reshape(n_head, 2, O // n_head // 2, *w_OI.shape[1:]).swapaxes(1, 2).reshape(w_OI.shape)


def unpermute_rope_rows(w_OI: torch.Tensor, n_head: int) -> torch.Tensor:
    """The inverse of `permute_rope_rows`."""
    O = w_OI.shape[0]
    return w_OI.reshape(n_head, O // n_head // 2, 2, *w_OI.shape[1:]).swapaxes(1, 2).reshape(w_OI.shape)


def _load_hf_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise GGUFExportError(
            f"{hf_dir}: no *.safetensors; write the checkpoint with `moe-lab convert to-hf`"
        )
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def _tokenizer_vocab(hf_dir: Path, vocab_size: int):
    path = hf_dir / "tokenizer.json"
    if not path.is_file():
        raise GGUFExportError(
            f"{hf_dir}: no tokenizer.json; llama.cpp needs the vocabulary in the file "
            "(`moe-lab convert to-hf` copies the checkpoint's tokenizer files along)"
        )
    data = json.loads(path.read_text(encoding="utf-8"))
    model = data.get("model", {})
    if model.get("type") != "BPE":
        raise GGUFExportError(
            f"{path}: tokenizer model {model.get('type')!r}; only byte-level BPE is written"
        )
    vocab: dict[str, int] = dict(model["vocab"])
    special = {t["content"]: t["id"] for t in data.get("added_tokens", [])}
    vocab.update(special)
    if max(vocab.values()) >= vocab_size:
        raise GGUFExportError(f"{path}: token id {max(vocab.values())} does not fit vocab_size={vocab_size}")
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [gguf.TokenType.UNUSED] * vocab_size
    for token, i in vocab.items():
        tokens[i] = token
        types[i] = gguf.TokenType.CONTROL if token in special else gguf.TokenType.NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return tokens, types, merges


def export_gguf(hf_dir: str | os.PathLike, out_file: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Write the Hugging Face Mixtral checkpoint in ``hf_dir`` as one float32 GGUF file, staged (`atomic_file`:
    ``out_file`` is the old file or the complete new one); an existing ``out_file`` is replaced only with
    ``overwrite``."""
    hf_dir, out_file = Path(hf_dir), Path(out_file)
    check_output_file(out_file, overwrite, GGUFExportError)  # before anything expensive
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise GGUFExportError(
            f"{hf_dir}: no config.json; give a directory written by `moe-lab convert to-hf`"
        )
    cfg = json.loads(config_path.read_text())
    if cfg.get("model_type") != "mixtral":
        raise GGUFExportError(
            f"{hf_dir}: model_type {cfg.get('model_type')!r}; GGUF export writes the Mixtral "
            "layout: convert with `moe-lab convert to-hf CKPT --arch mixtral`"
        )
    n_layer, n_head = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads") or n_head
    E, D = cfg["num_local_experts"], cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or D // n_head
    tensors = _load_hf_tensors(hf_dir)
    tokens, types, merges = _tokenizer_vocab(hf_dir, cfg["vocab_size"])

    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, n_layer)
    out: list[tuple[str, np.ndarray]] = []
    for layer in range(n_layer):  # stack each projection's experts: [E, O, I], as llama.cpp's converter
        for w, _ in _EXPERT_PROJ.items():
            names = [f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight" for e in range(E)]
            missing = [n for n in names if n not in tensors]
            if missing:
                raise GGUFExportError(
                    f"{hf_dir}: missing {missing[:3]}; not a Mixtral checkpoint of {E} experts"
                )
            stacked = torch.stack([tensors.pop(n) for n in names])
            out.append(
                (
                    name_map.get_name(f"model.layers.{layer}.block_sparse_moe.experts.{w}") + ".weight",
                    stacked.float().numpy(),
                )
            )
    for hf_name, t in tensors.items():
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue
        t = t.float()
        if hf_name.endswith("self_attn.q_proj.weight"):
            t = permute_rope_rows(t, n_head)
        elif hf_name.endswith("self_attn.k_proj.weight"):
            t = permute_rope_rows(t, n_kv)
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise GGUFExportError(f"{hf_dir}: tensor {hf_name!r} has no llama.cpp name")
        out.append((name, t.numpy()))

    with atomic_file(out_file, overwrite, GGUFExportError) as tmp:
        writer = gguf.GGUFWriter(str(tmp), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
        try:
            _write(writer, hf_dir, cfg, out, tokens, types, merges, head_dim)
        finally:
            writer.close()
    return out_file


def _write(writer, hf_dir: Path, cfg: dict, out, tokens, types, merges, head_dim: int) -> None:
    """The GGUF header, metadata and tensors (llama.cpp's ``LlamaModel`` layout), through ``writer``."""
    n_layer, n_head = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads") or n_head
    E, D = cfg["num_local_experts"], cfg["hidden_size"]
    writer.add_name(hf_dir.name)
    writer.add_context_length(cfg.get("max_position_embeddings", 2048))
    writer.add_embedding_length(D)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_dimension_count(head_dim)
    if head_dim != D // n_head:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    writer.add_expert_count(E)
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    # BOS/EOS/PAD (and the chat template) the way llama.cpp's converter finds them: the tokenizer files first,
    # then config.json (`gguf.SpecialVocab`), so a checkpoint whose config lacks them still stops at EOS
    special = gguf.SpecialVocab(hf_dir, load_merges=False, n_vocab=cfg["vocab_size"])
    special.add_to_gguf(writer, quiet=True)
    for name, array in out:
        writer.add_tensor(name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
