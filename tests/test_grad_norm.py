"""The clipping norm (`moe_core.train.parallel.global_grad_norm`) on one process: the L2 norm of every gradient,
equal to a float64 computation, and non-finite when a gradient is (the trainers skip such a step on it).
The multi-process layouts (experts over an EP group, FSDP shards) are held to the one-process norm step by step
in tests/test_train_parallel.py and tests/test_finetune_parallel.py."""

import math

import torch

from moe_core.train.parallel import ParallelState, global_grad_norm
from tests.finetune_helpers import tiny_model


def _model_with_grads():
    model = tiny_model("olmoe-tiny")
    input_ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    return model


def test_the_norm_is_every_gradients_l2_norm():
    model = _model_with_grads()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert any(g.dim() == 3 for g in grads)  # stacked experts among them
    expected = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
    norm = global_grad_norm(model, ParallelState())
    assert norm.dtype == torch.float64 and norm.dim() == 0
    assert math.isclose(float(norm), expected, rel_tol=1e-5)


def test_a_non_finite_gradient_makes_the_norm_non_finite():
    for bad in (math.inf, math.nan):
        model = _model_with_grads()
        expert = next(p for n, p in model.named_parameters() if ".experts." in n and p.grad is not None)
        expert.grad[0, 0, 0] = bad
        assert not torch.isfinite(global_grad_norm(model, ParallelState()))


def test_no_gradient_at_all_is_a_zero_norm():
    model = tiny_model("olmoe-tiny")
    assert float(global_grad_norm(model, ParallelState())) == 0.0
