"""The typed sections of flow parameters that stage tasks take whole (a flow passes ``params.evaluate``, never
its fields one by one). They live below the flows (`flows.params` builds its forms from them) so a task can
name its own parameter types without importing a flow."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class FlowParams(BaseModel):
    """Flow parameters and their sections: unknown fields are refused."""

    model_config = ConfigDict(extra="forbid")


class EvaluateParams(FlowParams):
    """What the evaluation stages read (`tasks.evaluate`): loss and perplexity, the router profile, the cost."""

    splits: list[str] = Field(default_factory=lambda: ["validation", "test"])
    batch_size: int = Field(8, ge=1)
    max_batches: int | None = Field(8, ge=1)
    profile_batches: int = Field(8, ge=1)
    plots: bool = True
    vocab_pieces: bool = Field(
        False,
        description="record the router profile's top tokens as vocabulary "
        "pieces (strings) too, not only ids and counts",
    )
    device_name: str | None = Field(None, description="device to price (default: this machine's)")
