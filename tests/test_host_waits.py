"""The training steps queue their work on the device without the host reading anything back.

On CUDA, a host read (``.item()``, ``.tolist()``, ``bool(t)``, or an op whose output size depends on the data:
``nonzero``, ``bincount``, a boolean mask) waits for every kernel queued before it. Once per MoE layer, that
leaves the GPU idle while Python launches the next layer: on an H100, the OLMoE-1B-7B LoRA step took 0.218 s with
the GPU busy for 0.101 s of it (transformers + PEFT: 0.151 s), with three such reads per layer (a ``nonzero`` and
a ``bincount`` in the expert dispatch, a ``bincount`` in the load-balancing loss).

Here, on the CPU, the ops themselves are visible: `HostReads` lists every op that would make the host wait on
CUDA, with the lab's line that made it. Each case is a step of the ``grouped_mm`` path, the one a GPU runs:
pretraining (the aux loss, an aux-loss-free router's bias), LoRA, QLoRA. The sorted path reads the counts back
by design (a slice per expert). ``tests/test_gpu.py`` checks the same on a GPU with torch's own detector.
"""

from __future__ import annotations

import collections
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe_core.finetune import FinetuneConfig
from moe_core.finetune.methods import apply_lora
from moe_core.routing import AuxLossFreeRouter
from tests.finetune_helpers import tiny_model

aten = torch.ops.aten
# ops whose result the host must have before it goes on: a value, or an output size that depends on the data
WAITING_OPS = {
    aten._local_scalar_dense.default,  # .item(), bool(t), int(t), float(t)
    aten.nonzero.default,
    aten.argwhere.default,
    aten.bincount.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.equal.default,
}
INDEXING_OPS = {
    aten.index.Tensor,
    aten.index_put.default,
    aten.index_put_.default,
    aten._index_put_impl_.default,
}
LORA = {"lora": {"r": 8, "alpha": 16.0, "experts": "all", "attention": ["q_proj", "v_proj"]}}


def _where() -> str:
    """The innermost frames of the lab's own code on the current stack (a backward op has none: the test's)."""
    stack = traceback.extract_stack()[:-2]
    frames = [f for f in stack if "moe_core" in f.filename] or stack
    return "".join(traceback.format_list(frames[-3:]))


class OpCount(TorchDispatchMode):
    """Counts the operators dispatched in its scope, by name (``ops``): what a CUDA step launches, one kernel
    or more each, and what the host spends its time on when the device waits for it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


class HostReads(TorchDispatchMode):
    """Records every op dispatched in its scope that would make the host wait for a CUDA device, and
    ``Tensor.tolist`` (which reads a CPU tensor without dispatching an op)."""

    def __init__(self, monkeypatch) -> None:
        super().__init__()
        self.sites: list[str] = []
        tolist = torch.Tensor.tolist

        def recorded_tolist(tensor):
            self.sites.append("Tensor.tolist\n" + _where())
            return tolist(tensor)

        monkeypatch.setattr(torch.Tensor, "tolist", recorded_tolist)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.waits(func, args, kwargs):
            self.sites.append(f"{func}\n" + _where())
        return func(*args, **kwargs)

    @staticmethod
    def waits(func, args, kwargs) -> bool:
        if func in WAITING_OPS:
            return True
        if func is aten.repeat_interleave.Tensor:
            return kwargs.get("output_size") is None
        if func in INDEXING_OPS:  # a boolean index is a nonzero
            return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
        return False


def _lora_model():
    model, _ = apply_lora(tiny_model("olmoe-tiny"), FinetuneConfig.build(LORA), None)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def _qlora_model():
    from tests.test_qlora import qlora_pair

    model, _ = qlora_pair(lora=LORA, attention=True)
    return model.train()


MODELS = {
    "pretrain": lambda: tiny_model("olmoe-tiny").train(),
    "pretrain-aux-free": lambda: tiny_model("deepseek-tiny", num_experts=8).train(),
    "lora": _lora_model,
    "qlora-nf4": _qlora_model,
}


@pytest.mark.parametrize("case", list(MODELS))
def test_a_grouped_mm_training_step_never_reads_back_from_the_device(case, monkeypatch):
    model = MODELS[case]()
    input_ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    routers = [m for m in model.modules() if isinstance(m, AuxLossFreeRouter)]
    assert (case == "pretrain-aux-free") == bool(routers)
    with HostReads(monkeypatch) as reads:
        out = model(input_ids=input_ids, labels=input_ids, expert_impl="grouped_mm")
        out.loss.backward()
        for router in routers:  # the aux-loss-free bias step, after the optimizer's
            router.update_bias()
    assert any(p.grad is not None for p in model.parameters())
    assert not reads.sites, f"{len(reads.sites)} reads back in one step:\n" + "\n".join(reads.sites)


def test_the_detector_sees_each_kind_of_read(monkeypatch):
    """The check above can fail: each read this module names is seen, and the grouped path's ops are not."""
    ids_A, mask_A = torch.tensor([2, 0, 1, 2]), torch.tensor([True, False, True, True])
    reads_back = [
        lambda: ids_A.tolist(),
        lambda: ids_A.sum().item(),
        lambda: bool(mask_A.any()),
        lambda: torch.bincount(ids_A, minlength=3),
        lambda: mask_A.nonzero(),
        lambda: ids_A[mask_A],
        lambda: ids_A.repeat_interleave(ids_A),
    ]
    for read in reads_back:
        with HostReads(monkeypatch) as reads:
            read()
        assert len(reads.sites) >= 1, reads.sites
    with HostReads(monkeypatch) as reads:
        ids_A.sort(stable=True)
        torch.searchsorted(ids_A.sort().values, torch.arange(4)).diff()
        ids_A.repeat_interleave(ids_A, output_size=5)
        ids_A[torch.tensor([0, 2])]
    assert not reads.sites, reads.sites
