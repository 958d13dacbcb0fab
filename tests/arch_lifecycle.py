"""The lifecycle of issue 32 §3 on one family's tiny preset, shared by tests/test_arch_qwen3.py and
tests/test_arch_gptoss.py: a few pretraining steps through `moe_core.train.train` on the built-in corpus, a save /
load round trip through `moe_core.load`, LoRA on the experts through `moe_core.finetune`, and a router profile."""

from __future__ import annotations

import math

import numpy as np
import torch

import moe_core
from moe_core.analytics.profile.collect import collect_profile
from moe_core.finetune import FinetuneConfig, finetune
from moe_core.train import TrainConfig, train
from tests.finetune_helpers import instruction_records, tiny_tokenizer

OVERRIDES = dict(num_experts=8, num_hidden_layers=2)


def run_lifecycle(preset: str, tmp_path, corpus_cache, **overrides) -> None:
    overrides = {**OVERRIDES, **overrides}
    # pretraining: a few steps, finite losses, and the routing telemetry of every MoE layer
    config = TrainConfig.build(
        {
            "model": {"preset": preset, "overrides": overrides},
            "steps": 3,
            "batch_size": 4,
            "seed": 0,
            "data": {"max_documents": 30, "seq_len": 32, "vocab_size": 384, "cache_dir": str(corpus_cache)},
            "optim": {"warmup_steps": 1, "lr": 3e-3},
            "log": {"every": 1, "progress": "off"},
            "checkpoint": {"every": 10**6, "export": True},
            "eval": {"batches": 1},
        }
    )
    result = train(config, tmp_path / "pretrain")
    assert result.step == 3 and result.loss is not None and math.isfinite(result.loss), (
        result.step,
        result.loss,
        result.skipped_steps,
    )
    assert result.export_dir is not None

    # save / load: the exported model loads through moe_core.load with the family's fields, and a second save
    # of it gives the same logits
    loaded = moe_core.load(result.export_dir, dtype="float32")
    for field, value in overrides.items():
        assert getattr(loaded.config, field) == value, field
    ids = torch.randint(0, loaded.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = loaded.model(ids).logits
    loaded.model.save_pretrained(tmp_path / "saved")
    again = moe_core.load(tmp_path / "saved", dtype="float32").model
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, before, atol=0, rtol=0)

    # router analytics: every MoE layer's kept slots sum to tokens * K
    profile = collect_profile(loaded.model, [ids])
    assert [layer.layer_id for layer in profile.layers] == loaded.config.moe_layer_ids
    for layer in profile.layers:
        assert int(np.sum(layer.kept_E)) == ids.numel() * loaded.config.num_experts_per_tok

    # LoRA on every expert (and attention): the adapters train, the base experts stay as they were
    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    model = moe_core.MoEForCausalLM(moe_core.get_config(preset, vocab_size=384, **overrides))
    base_experts = {k: v.clone() for k, v in model.state_dict().items() if ".experts." in k}
    ft = FinetuneConfig.build(
        {"lora": {"r": 2, "experts": "all"}, "steps": 2, "batch_size": 2, "export": {"merged": False}}
    )
    out = finetune(ft, tmp_path / "ft", model=model, tokenizer=tokenizer, records=instruction_records(8))
    assert (
        out.steps_done in (None, 2) and out.last_step_loss is not None and math.isfinite(out.last_step_loss)
    )
    lora_expert = [n for n, p in out.model.named_parameters() if p.requires_grad and "experts" in n]
    assert lora_expert, "no trainable LoRA parameters on the experts"
    state = {k.replace("base_model.model.", ""): v for k, v in out.model.state_dict().items()}
    for name, tensor in base_experts.items():
        stored = state.get(name, state.get(name.replace(".experts.", ".experts.base_layer.")))
        if stored is not None:
            assert torch.equal(stored, tensor), name
