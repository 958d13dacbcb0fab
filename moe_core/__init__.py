"""Open MoE Trainer Lab: the library.

    from moe_core import MoEForCausalLM, get_config
    model = MoEForCausalLM(get_config("mixtral-tiny"))

Importing registers ``model_type="moe_lab"`` with transformers' Auto classes; nothing else happens on import.
"""

from moe_core.config import PRESETS, MoEConfig, dense_baseline, get_config, parameter_counts
from moe_core.model import MoEForCausalLM, MoEModel
from moe_core.routing import ROUTERS, Router, RoutingRecord, register_router

__all__ = [
    "PRESETS", "ROUTERS", "MoEConfig", "MoEForCausalLM", "MoEModel", "Router", "RoutingRecord",
    "dense_baseline", "get_config", "parameter_counts", "register_router",
]
__version__ = "0.1.0"
