"""Quantization of a trained model (being split by backend; see weight_only.py)."""

from moe_core.inference.quantize.weight_only import *  # noqa: F403
from moe_core.inference.quantize.weight_only import _calibrated_codes, _collect_expert_inputs  # noqa: F401
