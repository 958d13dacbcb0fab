"""The torch internals `moe_core.torch_seam` reads (torch 2.13.0): each one checked here, so a torch
upgrade that moves any of them fails this file by name instead of a compiled step misbehaving silently."""

import dataclasses

import torch

from moe_core import torch_seam


def test_the_torch_this_seam_was_written_against():
    major, minor = (int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    assert (major, minor) in {(2, 13), (2, 14)}, (
        f"torch {torch.__version__}: re-check moe_core/torch_seam.py against it, then widen this"
    )


def test_dynamo_gives_the_bytecode_it_produced_and_its_graph_global():
    """`bytecode_of` (torch/_dynamo/convert_frame.py ``register_bytecode_hook``) sees the frame's new bytecode,
    which loads the graph from a ``__compiled_fn*`` global (what `GraphCall.record` swaps to record inputs)."""
    assert hasattr(torch._dynamo.config, "automatic_dynamic_shapes")

    def step(x):
        return torch.sin(x) + 1

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    with torch_seam.bytecode_of(step) as produced:
        compiled(torch.randn(3))
    assert len(produced) == 1
    names, ops = torch_seam.global_reads(produced[0])
    assert any(n.startswith("__compiled_fn") for n in names)
    assert any(n.startswith("__compiled_fn") for n in step.__globals__)
    assert not ops & torch_seam.SIDE_EFFECT_OPS  # a pure step stores nothing


def test_inductor_graph_exposes_its_callable_and_mutations():
    """`GraphCall` calls ``CompiledFxGraph.current_callable`` (torch/_inductor/output_code.py) on a boxed input
    list and reads ``mutated_input_idxs``."""
    from torch._inductor.output_code import CompiledFxGraph

    fields = {f.name for f in dataclasses.fields(CompiledFxGraph)}
    assert {"current_callable", "mutated_input_idxs"} <= fields


def test_ddp_skips_the_parameters_the_seam_names(tmp_path):
    """`ddp_ignore` (torch/nn/parallel/distributed.py ``_set_params_and_buffers_to_ignore_for_model``): DDP
    built afterwards neither reduces nor broadcasts the named parameters (the rank-local expert shards)."""
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        torch_seam.ddp_ignore(model, ["1.weight", "1.bias"])
        ddp = DistributedDataParallel(model)
        assert set(ddp.parameters_to_ignore) == {"1.weight", "1.bias"}
        ddp(torch.randn(2, 4)).sum().backward()
        assert model[0].weight.grad is not None and model[1].weight.grad is not None
    finally:
        dist.destroy_process_group()


def test_is_exporting_tells_torch_export_from_torch_compile():
    """`is_exporting` (torch/compiler/__init__.py ``_is_exporting_flag``): True while torch.export traces a
    forward, False eagerly and under torch.compile, read inside the traced code."""
    assert isinstance(torch.compiler._is_exporting_flag, bool)

    class Branch(torch.nn.Module):
        def forward(self, x):
            return x + (1.0 if torch_seam.is_exporting() else 2.0)

    x = torch.zeros(3)
    assert Branch()(x).tolist() == [2.0] * 3
    torch.compiler.reset()
    assert torch.compile(Branch(), backend="eager", fullgraph=True)(x).tolist() == [2.0] * 3
    exported = torch.export.export(Branch(), (x,))
    assert exported.module()(x).tolist() == [1.0] * 3
    for strict in (True, False):
        assert torch.export.export(Branch(), (x,), strict=strict).module()(x).tolist() == [1.0] * 3
