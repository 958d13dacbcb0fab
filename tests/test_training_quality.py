"""Training quality: the load-balancing loss's normalisation and scope, and routing that balances in training.

- `GlobalBatchBalance` (Qiu et al. 2025): f_e accumulates over the micro-batches of a step, so the last
  micro-batch's loss is the big batch's f with its own P; one micro-batch equals the plain loss.
"""

import pytest
import torch

from moe_core import MoEForCausalLM, get_config
from moe_core.routing import GlobalBatchBalance, load_balancing_loss, slot_counts


def _model(preset="switch-tiny", **overrides):
    torch.manual_seed(0)
    model = MoEForCausalLM(get_config(preset, **overrides))
    for router in model.routers():  # decisive routing, so the batches' loads differ clearly
        torch.nn.init.normal_(router.gate.weight, std=0.5)
    return model.train()


def test_global_batch_f_accumulates_over_micro_batches_and_resets():
    model = _model(capacity_factor=None)  # dropless: later layers see the same inputs in both batchings
    x = torch.randint(0, model.config.vocab_size, (2, 24))
    big = model(x, labels=x, output_routing=True)
    model.load_balance = GlobalBatchBalance()
    model.load_balance.reset()
    first = model(x[:1], labels=x[:1], output_routing=True)
    second = model(x[1:], labels=x[1:], output_routing=True)
    E = model.config.num_experts
    for layer, (r_big, r1, r2) in enumerate(zip(big.routing, first.routing, second.routing)):
        counts_big = slot_counts(r_big.expert_ids_TK, E).double()
        torch.testing.assert_close(model.load_balance.counts_LE[layer], counts_big)
        # micro-batch 1 saw only its own slots; micro-batch 2 the whole batch's f with its own P
        torch.testing.assert_close(r1.aux_loss, load_balancing_loss(r1.probs_TE, r1.expert_ids_TK))
        f_big = counts_big / counts_big.sum()
        torch.testing.assert_close(r2.aux_loss, load_balancing_loss(r2.probs_TE, r2.expert_ids_TK, f_big))
    # the micro-batches really were unbalanced differently: the global scope changes the loss
    assert any(not torch.allclose(r2.aux_loss, load_balancing_loss(r2.probs_TE, r2.expert_ids_TK))
               for r2 in second.routing)
    model.load_balance.reset()
    assert model.load_balance.counts_LE is None


def test_global_batch_with_one_micro_batch_equals_the_plain_loss_and_gradient():
    model = _model()
    x = torch.randint(0, model.config.vocab_size, (2, 24))
    plain = model(x, labels=x)
    (g_plain,) = torch.autograd.grad(plain.aux_loss, model.routers()[0].gate.weight)
    model.load_balance = GlobalBatchBalance()
    model.load_balance.reset()
    scoped = model(x, labels=x)
    (g_scoped,) = torch.autograd.grad(scoped.aux_loss, model.routers()[0].gate.weight)
    torch.testing.assert_close(scoped.aux_loss, plain.aux_loss)
    torch.testing.assert_close(g_scoped, g_plain)


def test_global_batch_leaves_eval_and_bias_routers_alone():
    model = _model("mixtral-tiny", router="aux_free", router_bias_update_rate=0.01)
    model.load_balance = GlobalBatchBalance()
    x = torch.randint(0, model.config.vocab_size, (2, 16))
    out = model(x, labels=x, output_routing=True)
    assert all(not r.aux_loss.requires_grad for r in out.routing)  # still the detached statistic
    model.eval()
    model.load_balance.reset()
    with torch.no_grad():
        model(x, labels=x)
    assert model.load_balance.counts_LE is None  # evaluation never feeds the training statistics
