"""Training FLOPs per token from the model config, for throughput and MFU.

``6 * N + 12 * L * H * Hd * S`` (Kaplan et al. 2020; PaLM, Chowdhery et al. 2022, appendix B): N is the
number of parameters a token passes through in matmuls (active parameters, without the input embedding,
which is a lookup), times 6 for forward + backward; the second term is attention's QK^T and AV over a
sequence of S tokens (not halved for causality, as PaLM counts it). Router gates are in N; the expert-
dispatch bookkeeping is not.
"""

from __future__ import annotations

from moe_core.config import MoEConfig, parameter_counts

# dense bf16 peak FLOP/s per device (vendor datasheets, without sparsity)
PEAK_FLOPS_BF16 = {
    "H100": 989e12,
    "H200": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
    "L4": 121e12,
}


def flops_per_token(config: MoEConfig, seq_len: int) -> float:
    counts = parameter_counts(config)
    input_embedding = config.vocab_size * config.hidden_size
    matmul_params = counts["active"] - input_embedding
    if config.tie_word_embeddings:  # the one matrix serves as the output projection too
        matmul_params += input_embedding
    attention = 12 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * seq_len
    return 6.0 * matmul_params + attention


def peak_flops(device_name: str | None) -> float | None:
    """A known accelerator's bf16 peak by name (e.g. ``torch.cuda.get_device_name()``), else None."""
    if not device_name:
        return None
    for key, value in PEAK_FLOPS_BF16.items():
        if key in device_name.upper():
            return value
    return None
