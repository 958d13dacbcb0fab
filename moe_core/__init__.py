"""Open MoE Trainer Lab: the library.

    from moe_core import MoEForCausalLM, get_config, load
    model = MoEForCausalLM(get_config("mixtral-tiny"))
    loaded = load("runs/my-run")  # any checkpoint the lab writes or converts: .model, .tokenizer, .kind

Loading the model module (``from moe_core import MoEForCausalLM`` or ``import moe_core.model``) registers
``model_type="moe_lab"`` with transformers' Auto classes; nothing else happens on import.
"""

from __future__ import annotations

import importlib

# The re-exports below resolve on first use (PEP 562) rather than on `import moe_core`: every `moe_core.*`
# import runs this file, and importing torch + transformers here would make `moe-lab --help` (and every
# argument error) take 10+ seconds. Only these few names are lazy; submodules import normally.
_EXPORTS = {
    "PRESETS": "moe_core.presets",
    "MoEConfig": "moe_core.config",
    "dense_baseline": "moe_core.config",
    "get_config": "moe_core.config",
    "load": "moe_core.loading",
    "Loaded": "moe_core.loading",
    "parameter_counts": "moe_core.config",
    "MoEForCausalLM": "moe_core.model",
    "MoEModel": "moe_core.model",
    "ROUTERS": "moe_core.routing",
    "Router": "moe_core.routing",
    "RoutingRecord": "moe_core.routing",
    "register_router": "moe_core.routing",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'moe_core' has no attribute {name!r}")
    if name in ("MoEConfig", "get_config", "dense_baseline", "parameter_counts"):
        importlib.import_module("moe_core.model")  # a config is only useful with the Auto classes registered
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
