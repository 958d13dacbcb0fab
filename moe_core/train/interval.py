"""What the optimizer steps since the last logged row add up to (`Trainer` logs every ``log.every`` steps).

Losses and the gradient norm are averaged over the *finite* steps of the interval only (a skipped step's values
are not a stand-in for anything); throughput counts every step and the wall time they took.
"""

from __future__ import annotations

from dataclasses import dataclass

# the per-step values averaged over an interval's finite steps, in the order they are logged
AVERAGED = ("loss", "lm_loss", "aux_loss", "z_loss", "grad_norm")


@dataclass
class LogInterval:
    loss: float = 0.0  # sums over the finite steps of the interval
    lm_loss: float = 0.0
    aux_loss: float = 0.0
    z_loss: float = 0.0
    grad_norm: float = 0.0
    finite_steps: int = 0
    steps: int = 0  # every step, skipped ones too
    seconds: float = 0.0  # wall time of the steps (the device synchronized at the end of each)
    rank_loss: float | None = (
        None  # a distributed rank's own loss (before the all-reduce), where steps give it
    )

    def add(self, stats: dict[str, float], seconds: float) -> None:
        """One optimizer step's `Trainer.train_step` result and the time it took."""
        self.seconds += seconds
        if stats["finite"]:
            for key in AVERAGED:
                setattr(self, key, getattr(self, key) + stats[key])
            if "rank_loss" in stats:
                self.rank_loss = (self.rank_loss or 0.0) + stats["rank_loss"]
            self.finite_steps += 1
        self.steps += 1

    def means(self) -> dict[str, float]:
        """The averaged values over the finite steps; empty when every step of the interval was skipped."""
        if not self.finite_steps:
            return {}
        out = {key: getattr(self, key) / self.finite_steps for key in AVERAGED}
        if self.rank_loss is not None:
            out["rank_loss"] = self.rank_loss / self.finite_steps
        return out
