"""Where training batches come from: a prepared token-block dataset and a resumable global order.

Every rank walks the same global order of blocks (one `ResumableSampler` over the whole dataset, seeded by
the config) and takes its own slice of each global batch: micro-step m of rank r reads blocks
``[(m * W + r) * b, (m * W + r + 1) * b)`` of the step's ``batch_size`` blocks. So a run on W processes
sees exactly the global batches a single process sees, and the position in the order (the sampler's
state) is all a checkpoint needs to continue.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path

import torch

from moe_core.data.prepare import prepare
from moe_core.data.sampler import ResumableSampler
from moe_core.data.shards import PackedTokens, read_manifest
from moe_core.data.tokenizer import SPECIAL_TOKEN_FIELDS, load_tokenizer
from moe_core.errors import MoELabError
from moe_core.paths import is_url, lab_data_dir


class TrainDataError(MoELabError):
    """The training data cannot be used (too small, wrong vocabulary, missing split)."""


class SyntheticTokens:
    """Token blocks from a fixed random Markov chain where each token has 4 possible successors: learnable
    (entropy ln 4 = 1.39 nats against ln V for uniform tokens) without a tokenizer, for tests and throughput
    benchmarks. Same protocol as `moe_core.data.shards.PackedTokens`: len(), [i] -> LongTensor[seq_len]."""

    SUCCESSORS = 4

    def __init__(self, num_blocks: int, seq_len: int, vocab_size: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        next_VN = torch.randint(
            0, vocab_size, (vocab_size, self.SUCCESSORS), generator=torch.Generator().manual_seed(1234)
        )
        choice_NS = torch.randint(0, self.SUCCESSORS, (num_blocks, seq_len), generator=generator)
        blocks_NS = torch.empty(num_blocks, seq_len, dtype=torch.long)
        blocks_NS[:, 0] = torch.randint(0, vocab_size, (num_blocks,), generator=generator)
        for s in range(1, seq_len):
            blocks_NS[:, s] = next_VN[blocks_NS[:, s - 1], choice_NS[:, s]]
        self.blocks_NS = blocks_NS
        self.seq_len = seq_len

    def __len__(self) -> int:
        return self.blocks_NS.shape[0]

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.blocks_NS[i]


class GlobalBatches:
    """An endless stream of global batches (lists of block indices), epoch after epoch, resumable."""

    def __init__(self, num_blocks: int, batch_size: int, seed: int) -> None:
        if num_blocks < batch_size:
            raise TrainDataError(
                f"the training split has {num_blocks} blocks, fewer than batch_size={batch_size}; "
                f"lower batch_size or data.seq_len, or prepare more documents"
            )
        self.sampler = ResumableSampler(
            num_blocks, seed=seed, rank=0, world_size=1, shuffle=True, drop_last=True
        )
        self.batch_size = batch_size
        self.epoch = 0
        self.sampler.set_epoch(0)
        self._iter = None

    def next_batch(self) -> list[int]:
        indices: list[int] = []
        while len(indices) < self.batch_size:
            if self._iter is None:
                self._iter = iter(self.sampler)
            try:
                indices.append(int(next(self._iter)))
            except StopIteration:  # next epoch: a new permutation; partial batches never cross epochs
                indices.clear()
                self.epoch += 1
                self.sampler.set_epoch(self.epoch)
                self._iter = None
        return indices

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self.sampler.set_epoch(self.epoch)
        self.sampler.load_state_dict(state["sampler"])
        self._iter = None


def rank_slice(
    indices: list[int], micro_step: int, dp_rank: int, dp_world: int, micro_batch: int
) -> list[int]:
    start = (micro_step * dp_world + dp_rank) * micro_batch
    return indices[start : start + micro_batch]


def stack_blocks(dataset, indices: list[int]) -> torch.Tensor:
    return torch.stack([torch.as_tensor(dataset[i]).long() for i in indices])


def adopt_data_seq_len(config):
    """With ``data.path`` (data someone prepared) and ``data.seq_len`` left at its default, train on the
    data's own block length: `moe-lab data prepare` writes 256-token blocks by default, and asking the user
    to repeat that number is friction, not safety. An explicitly different seq_len still fails in
    `open_datasets`, naming both."""
    data = config.data
    default = type(data).model_fields["seq_len"].default
    if data.path is None or data.seq_len != default:
        return config
    if not is_url(data.path) and not (Path(data.path) / "manifest.json").is_file():
        return config  # open_datasets says what is wrong with it
    seq_len = int(read_manifest(data.path)["seq_len"])
    return (
        config
        if seq_len == data.seq_len
        else config.model_copy(update={"data": data.model_copy(update={"seq_len": seq_len})})
    )


def open_datasets(
    data_cfg, out_dir: Path, model_vocab: int, is_main: bool, wait, tokenizer: str | None = None
) -> tuple:
    """(train, val or None, data_dir or None, tokenizer vocab size or None). `wait` is a barrier: rank 0
    prepares the data, the others reuse it. ``tokenizer``: prepare ``data.source`` with this one (an upcycled
    model's: `moe_core.upcycle`) instead of training one."""
    if data_cfg.source == "synthetic":
        vocab = data_cfg.vocab_size or model_vocab
        train = SyntheticTokens(data_cfg.synthetic_blocks, data_cfg.seq_len, vocab, data_cfg.seed)
        val = SyntheticTokens(
            max(8, data_cfg.synthetic_blocks // 8), data_cfg.seq_len, vocab, data_cfg.seed + 1
        )
        return train, val, None, vocab
    if data_cfg.path is not None:
        data_dir = (
            data_cfg.path
        )  # a directory, or a URL the readers fetch (moe_core.data.shards.prepared_dir)
        if not is_url(data_dir) and not Path(data_dir).is_dir():
            raise TrainDataError(
                f"data.path={data_cfg.path!r} is not a directory; prepare it with "
                f"`moe-lab data prepare` or leave data.path unset to prepare data.source"
            )
    else:
        prepare_cfg = data_cfg.prepare_config(model_vocab, **({"tokenizer": tokenizer} if tokenizer else {}))
        cache = data_cache_dir(data_cfg.cache_dir, prepare_cfg)
        data_dir = None
        if is_main:
            data_dir = Path(prepare(prepare_cfg, cache))
        wait()
        if not is_main:
            data_dir = Path(prepare(prepare_cfg, cache))  # finds rank 0's result and reuses it
    train = PackedTokens(data_dir, "train")
    data_dir = train.data_dir  # on this machine (a URL's local copy)
    if train.seq_len != data_cfg.seq_len:
        raise TrainDataError(
            f"{data_dir}: blocks are {train.seq_len} tokens but data.seq_len={data_cfg.seq_len}; "
            f"set data.seq_len={train.seq_len} or prepare the data again"
        )
    val = None
    for split in ("validation", "val"):
        try:
            val = PackedTokens(data_dir, split)
            break
        except (FileNotFoundError, KeyError, MoELabError):
            continue
    if val is not None and len(val) == 0:
        val = None
    vocab = getattr(train, "vocab_size", None) or tokenizer_vocab_size(data_dir)
    return train, val, data_dir, vocab


def data_cache_dir(cache_dir: str | None, prepare_cfg) -> Path:
    """Prepared data is shared between runs: ``<cache>/<source>-<hash of the preparation settings>``, with
    ``<cache>`` = data.cache_dir, else $MOE_LAB_DATA_CACHE, else ~/.cache/moe-lab/data."""
    root = Path(cache_dir) if cache_dir else lab_data_dir()
    settings = json.dumps(dataclasses.asdict(prepare_cfg), sort_keys=True, default=str)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(prepare_cfg.source))[-40:]
    return root / f"{name}-{hashlib.sha1(settings.encode()).hexdigest()[:12]}"


def data_special_token_ids(train) -> dict[str, int]:
    """The BOS/EOS/PAD ids of the tokenizer the training data was prepared with (its manifest records them),
    keyed by model-config field; {} for data without a tokenizer (synthetic)."""
    recorded = getattr(train, "manifest", {}).get("tokenizer", {})
    return {field: int(recorded[field]) for field in SPECIAL_TOKEN_FIELDS if recorded.get(field) is not None}


def tokenizer_vocab_size(data_dir: Path) -> int | None:
    tok_dir = Path(data_dir) / "tokenizer"
    if not tok_dir.is_dir():
        return None
    tokenizer = load_tokenizer(tok_dir)
    return len(tokenizer)
