"""moe_core/transformers_seam.py: the transformers internals the lab reaches for still exist and mean what it
assumes (transformers 5.24). An upgrade that moves or renames one fails here, naming it."""

from __future__ import annotations

import inspect

import torch
import transformers
from torch import nn
from transformers import GenerationConfig, PreTrainedConfig

from moe_core.transformers_seam import UPSTREAM, generation_default_keys, no_init_weights


def test_the_seam_names_the_transformers_it_was_written_against():
    assert transformers.__version__.split(".")[0] == "5", (
        f"transformers {transformers.__version__}: moe_core/transformers_seam.py was written against {UPSTREAM}"
    )


def test_no_init_weights_skips_initializers():
    with no_init_weights():
        layer = nn.Linear(4, 4)
        nn.init.constant_(layer.weight, 3.0)  # transformers patches torch's init functions to do nothing
    assert not torch.all(layer.weight == 3.0)


def test_generation_keys_are_the_ones_a_config_pops():
    keys = generation_default_keys()
    assert {"max_length", "do_sample", "num_beams", "temperature", "top_p"} <= keys
    assert "_get_default_generation_params" in dict(inspect.getmembers(GenerationConfig))
    config = PreTrainedConfig(max_length=7, do_sample=True)  # generation fields in a config.json: popped
    assert not hasattr(config, "max_length") or config.max_length != 7


def test_unset_sampling_fields_take_generates_defaults():
    from moe_core.transformers_seam import generation_default

    unset = GenerationConfig()  # transformers 5 leaves them None
    assert (unset.temperature, unset.top_k, unset.top_p) == (None, None, None)
    assert [generation_default(unset, k) for k in ("temperature", "top_k", "top_p")] == [1.0, 50, 1.0]
    assert generation_default(GenerationConfig(top_k=3), "top_k") == 3


def test_the_old_checkpointing_names_still_warn_with_the_text_the_seam_silences():
    """If transformers drops the old names (v6) or rewords the warning, this fails: then the seam can go, or
    its pattern needs the new text."""
    import re
    import warnings

    from moe_core import MoEForCausalLM, get_config
    from moe_core.transformers_seam import OLD_CHECKPOINTING_NAMES, old_checkpointing_names_quiet

    model = MoEForCausalLM(get_config("mixtral-tiny"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not model.is_gradient_checkpointing
        model.gradient_checkpointing_enable()
        model.gradient_checkpointing_disable()
    said = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert len(said) == 3 and all(re.match(OLD_CHECKPOINTING_NAMES, text) for text in said), said
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with old_checkpointing_names_quiet():
            assert not model.is_gradient_checkpointing
    assert not caught
