"""The one place the library reaches into transformers' non-public names (transformers 5.x; checked at 5.24).

- `no_init_weights` (``transformers/initialization.py``; 4.x had it in ``modeling_utils.py``): builds a model
  without running its initializers, for a loader that overwrites every tensor (`moe_core.convert.from_hf`).
- `generation_default_keys` (``GenerationConfig._get_default_generation_params``,
  ``transformers/generation/configuration_utils.py``; 4.x: ``PretrainedConfig._get_global_generation_defaults``):
  the generation fields a config.json may still carry, which ``PreTrainedConfig`` pops when it loads one
  (`moe_core.config.model_fields` accepts them); their values are what ``generate`` uses for a field a
  generation_config.json leaves unset (`generation_default`, for the lab's ONNX Runtime ``generate``).

tests/test_transformers_seam.py fails loudly when an upgrade moves or renames either.
"""

from __future__ import annotations

from transformers import GenerationConfig
from transformers.initialization import no_init_weights

UPSTREAM = "transformers 5.24 (initialization.py, generation/configuration_utils.py)"

__all__ = ["UPSTREAM", "generation_default", "generation_default_keys", "no_init_weights"]


def generation_default_keys() -> set[str]:
    """The generation parameters ``PreTrainedConfig`` pops from a config.json (they belong in
    generation_config.json)."""
    return set(GenerationConfig._get_default_generation_params())


def generation_default(config: GenerationConfig, name: str):
    """``config.<name>``, or what ``generate`` uses when it is unset: transformers 5's GenerationConfig leaves
    sampling fields None (temperature, top_k, top_p) and fills them from these defaults at generate time."""
    value = getattr(config, name, None)
    return GenerationConfig._get_default_generation_params()[name] if value is None else value
