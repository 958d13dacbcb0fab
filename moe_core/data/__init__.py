"""Data pipeline: sources -> validation (great-expectations) -> tokenizer -> packed token shards -> sampler.

    from moe_core.data.prepare import PrepareConfig, prepare
    from moe_core.data.shards import PackedTokens
    from moe_core.data.sampler import ResumableSampler, iterate_batches

    data_dir = prepare(PrepareConfig(max_documents=200, vocab_size=2000), "runs/data")
    train = PackedTokens(data_dir, "train")
    sampler = ResumableSampler(len(train), seed=0, rank=0, world_size=1)
    for batch_BS in iterate_batches(train, sampler, batch_size=8): ...

Modules import nothing heavy at import time (great_expectations and datasets load inside functions).
"""

from moe_core.data.errors import DataError, DataValidationError

__all__ = ["DataError", "DataValidationError"]
