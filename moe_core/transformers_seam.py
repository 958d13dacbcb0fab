"""The one place the library reaches into transformers' non-public names (transformers 5.x; checked at 5.24).

- `no_init_weights` (``transformers/initialization.py``; 4.x had it in ``modeling_utils.py``): builds a model
  without running its initializers, for a loader that overwrites every tensor (`moe_core.convert.from_hf`).
- `generation_default_keys` (``GenerationConfig._get_default_generation_params``,
  ``transformers/generation/configuration_utils.py``; 4.x: ``PretrainedConfig._get_global_generation_defaults``):
  the generation fields a config.json may still carry, which ``PreTrainedConfig`` pops when it loads one
  (`moe_core.config.model_fields` accepts them); their values are what ``generate`` uses for a field a
  generation_config.json leaves unset (`generation_default`, for the lab's ONNX Runtime ``generate``).

And one deprecation the lab's libraries trip over: transformers 5.24 renamed gradient checkpointing to
activation checkpointing (``modeling_utils.py``: ``is_gradient_checkpointing``,
``gradient_checkpointing_enable`` / ``_disable`` warn with a FutureWarning at every use). The lab uses the new
names; PEFT 0.21 (``PeftModel.__init__``) and TRL 1.16 (``trl/models/utils.py``) still call the old ones, so
every fine-tune printed warnings about names the user never typed. `old_checkpointing_names_quiet` silences
those warnings alone, around the PEFT and TRL calls that make them.

tests/test_transformers_seam.py fails loudly when an upgrade moves or renames any of these.
"""

from __future__ import annotations

import contextlib
import warnings

from transformers import GenerationConfig
from transformers.initialization import no_init_weights

UPSTREAM = "transformers 5.24 (initialization.py, generation/configuration_utils.py)"

__all__ = [
    "UPSTREAM",
    "generation_default",
    "generation_default_keys",
    "no_init_weights",
    "old_checkpointing_names_quiet",
]

# the start of transformers 5.24's FutureWarning for each old name (`old_checkpointing_names_quiet`)
OLD_CHECKPOINTING_NAMES = r"`(is_gradient_checkpointing|gradient_checkpointing_enable|gradient_checkpointing_disable)` is deprecated"


@contextlib.contextmanager
def old_checkpointing_names_quiet():
    """Run PEFT's or TRL's code without transformers' FutureWarnings about the old checkpointing names they use
    (only those)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=OLD_CHECKPOINTING_NAMES, category=FutureWarning)
        yield


def generation_default_keys() -> set[str]:
    """The generation parameters ``PreTrainedConfig`` pops from a config.json (they belong in
    generation_config.json)."""
    return set(GenerationConfig._get_default_generation_params())


def generation_default(config: GenerationConfig, name: str):
    """``config.<name>``, or what ``generate`` uses when it is unset: transformers 5's GenerationConfig leaves
    sampling fields None (temperature, top_k, top_p) and fills them from these defaults at generate time."""
    value = getattr(config, name, None)
    return GenerationConfig._get_default_generation_params()[name] if value is None else value
