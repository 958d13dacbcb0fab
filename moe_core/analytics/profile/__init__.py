"""Router profile: what the router did, per MoE layer, over an evaluation set.

Legend: B = batch, S = sequence, T = B*S tokens, K = expert slots per token, E = experts (F = experts of the
next MoE layer), C = token classes, M = document domains, V = vocabulary.

`collect_profile` runs the model in eval mode under ``torch.no_grad`` with ``output_routing=True`` (so
evaluation never moves load-balancing state: routers only observe in training) and feeds each batch's
`RoutingRecord`s to a `ProfileCollector`, which keeps count tables only; nothing re-derives routing.

What is counted, per MoE layer (a "slot" is one (token, k) assignment; "kept" = not dropped over capacity;
for ``expert_choice`` a dropped slot is an expert that did not pick the token):
- ``kept_E``: the router's ``tokens_per_expert_E`` summed; ``routed_E``: slots sent before capacity.
- dropped slots and dropped tokens (tokens none of whose slots was kept).
- router entropy ``-sum_e p log p`` (nats) and confidence ``max_e p`` per token, summed; scores are
  normalized per token first (so sigmoid routers read like softmax ones).
- co-activation ``[E, E]``: tokens whose kept slots include both i and j; the diagonal is tokens using i.
- flow between consecutive MoE layers ``[E, F]``, two ways: ``top1`` counts each token once, from its
  primary expert in layer l to its primary expert in layer l+1 (primary = the kept slot with the largest
  combine weight; tokens with no kept slot in either layer are left out), and ``pairs`` counts every
  (kept slot in l, kept slot in l+1) pair of a token, i.e. ``multihot_l^T @ multihot_l+1``.
- ``[E, C]`` kept slots per token class and ``[E, M]`` per document domain; their mutual information with
  the expert choice, in bits, is taken over kept slots (a token with K kept slots counts K times).
- top tokens per expert: the most frequent token ids among its kept slots, with their decoded strings
  (vocabulary entries, never running text) only when ``ProfileConfig.include_vocab_pieces`` asks for them.

Modules: `config` (ProfileConfig, ProfileError), `collect` (ProfileCollector, collect_profile, profile_split),
`layer` (LayerProfile, FlowProfile: count tables and the statistics computed from them), `router_profile`
(RouterProfile), `files` (the directory format below). Every public name is importable from this package.

A `RouterProfile` is saved as a versioned directory (`to_dir`, written to a temporary directory and renamed
into place) that the inference-optimization work reads back with `RouterProfile.from_dir`::

    profile.json            version, model (config hash, experts, layers), dataset fingerprint, per-layer
                            scalars and summaries, top tokens per expert
    experts.parquet         layer, expert, kept, routed, share
    coactivation.parquet    layer, expert_i, expert_j, tokens
    flow.parquet            from_layer, to_layer, from_expert, to_expert, top1, pairs
    expert_classes.parquet  layer, expert, token_class, slots
    expert_domains.parquet  layer, expert, domain, slots
    top_tokens.parquet      layer, expert, rank, token_id, count, token
"""

from moe_core.analytics.profile.collect import (
    ProfileCollector,
    collect_profile,
    config_hash,
    model_info,
    profile_split,
)
from moe_core.analytics.profile.config import ProfileConfig, ProfileError
from moe_core.analytics.profile.files import PROFILE_FILES, PROFILE_VERSION
from moe_core.analytics.profile.layer import FlowProfile, LayerProfile, TopToken
from moe_core.analytics.profile.router_profile import RouterProfile
from moe_core.analytics.token_classes import TOKEN_CLASSES

__all__ = [
    "PROFILE_FILES",
    "PROFILE_VERSION",
    "TOKEN_CLASSES",
    "FlowProfile",
    "LayerProfile",
    "ProfileCollector",
    "ProfileConfig",
    "ProfileError",
    "RouterProfile",
    "TopToken",
    "collect_profile",
    "config_hash",
    "model_info",
    "profile_split",
]
