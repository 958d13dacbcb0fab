"""Open MoE Trainer Lab: the library.

    from moe_core import MoEForCausalLM, get_config, load
    model = MoEForCausalLM(get_config("mixtral-tiny"))
    loaded = load("runs/my-run")  # any checkpoint the lab writes or converts: .model, .tokenizer, .kind

Loading the model module (``from moe_core import MoEForCausalLM`` or ``import moe_core.model``) registers
``model_type="moe_lab"`` with transformers' Auto classes; nothing else happens on import. The names above are
resolved on first use (moe_core._lazy), so that importing any submodule, such as ``moe_core.cli`` for
``moe-lab --help``, does not load torch and transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moe_core._lazy import lazy_exports

# Lazy (PEP 562, through moe_core._lazy): every `moe_core.*` import runs this file first, and importing torch +
# transformers here would make `moe-lab --help` (and every argument error) take 10+ seconds. Only these few
# names are lazy; submodules import normally.
if TYPE_CHECKING:
    from moe_core.config import MoEConfig, dense_baseline, get_config, parameter_counts
    from moe_core.loading import Loaded, load
    from moe_core.model import MoEForCausalLM, MoEModel
    from moe_core.presets import PRESETS
    from moe_core.routing import ROUTERS, Router, RoutingRecord, register_router

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

__all__ = [
    "Loaded",
    "MoEConfig",
    "MoEForCausalLM",
    "MoEModel",
    "PRESETS",
    "ROUTERS",
    "Router",
    "RoutingRecord",
    "dense_baseline",
    "get_config",
    "load",
    "parameter_counts",
    "register_router",
]
__version__ = "0.1.0"

# a config is only useful with the Auto classes registered, which importing the model module does
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, requires={"moe_core.config": "moe_core.model"})
