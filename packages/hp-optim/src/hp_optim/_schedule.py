"""Learning-rate schedules: linear warmup, then cosine, linear, constant or warmup-stable-decay.

The schedule itself is a pure function of the step (``lr_factor``), so it can be tabulated and
tested; ``HyperLRScheduler`` applies it to any optimizer with ``param_groups`` (including
``ChainedOptimizer``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from ._clip import OptimError

__all__ = ["LRScheduleConfig", "lr_factor", "HyperLRScheduler", "get_hyper_lr_scheduler"]

_STYLES = ("cosine", "linear", "constant", "wsd")


@dataclass(frozen=True)
class LRScheduleConfig:
    """Attributes:
    warmup_steps: steps of linear warmup from 0 to the base LR.
    total_steps: steps of the whole schedule (after it, the LR stays at its last value).
    decay_style: "cosine", "linear", "constant" or "wsd" (warmup-stable-decay).
    min_lr_ratio: the final LR as a fraction of the base LR.
    decay_steps: for "wsd", the length of the final decay (linear); the rest is stable.
    """

    warmup_steps: int = 0
    total_steps: int = 1
    decay_style: str = "cosine"
    min_lr_ratio: float = 0.0
    decay_steps: int = 0

    def __post_init__(self):
        if self.decay_style not in _STYLES:
            raise OptimError(f"decay_style={self.decay_style!r}: use one of {_STYLES}")
        if self.total_steps < 1 or self.warmup_steps < 0 or self.warmup_steps > self.total_steps:
            raise OptimError(
                f"warmup_steps={self.warmup_steps}, total_steps={self.total_steps}: need "
                "0 <= warmup_steps <= total_steps and total_steps >= 1"
            )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise OptimError(f"min_lr_ratio={self.min_lr_ratio}: give a value in [0, 1]")

    @classmethod
    def from_dict(cls, config: dict) -> LRScheduleConfig:
        """Build from a dict; unknown keys raise ``OptimError`` naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise OptimError(f"scheduler config has unknown keys {unknown}: use {sorted(known)}")
        return cls(**config)


def lr_factor(step: int, cfg: LRScheduleConfig) -> float:
    """The LR multiplier at ``step`` (0-based)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    lo = cfg.min_lr_ratio
    span = max(cfg.total_steps - cfg.warmup_steps, 1)
    t = min(max(step - cfg.warmup_steps, 0), span) / span
    if cfg.decay_style == "constant":
        return 1.0
    if cfg.decay_style == "linear":
        return lo + (1 - lo) * (1 - t)
    if cfg.decay_style == "cosine":
        return lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * t))
    decay = min(cfg.decay_steps, span)
    start = cfg.total_steps - decay
    if step < start:
        return 1.0
    u = min(step - start, decay) / decay if decay else 1.0
    return lo + (1 - lo) * (1 - u)


class HyperLRScheduler:
    """Applies ``lr_factor`` to every param group of ``optimizer`` (base LR = the group's LR at
    construction). ``step()`` after each optimizer step, like torch's schedulers."""

    def __init__(self, optimizer, cfg: LRScheduleConfig) -> None:
        self.optimizer, self.cfg = optimizer, cfg
        for g in optimizer.param_groups:
            g.setdefault("initial_lr", g["lr"])
        self.last_step = 0
        self._apply()

    def _apply(self) -> None:
        f = lr_factor(self.last_step, self.cfg)
        for g in self.optimizer.param_groups:
            g["lr"] = g["initial_lr"] * f

    def step(self) -> None:
        """Advance one step."""
        self.last_step += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        """Current LR of each param group."""
        return [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"last_step": self.last_step}

    def load_state_dict(self, state: dict) -> None:
        self.last_step = int(state["last_step"])
        self._apply()


def get_hyper_lr_scheduler(optimizer, config: dict | LRScheduleConfig) -> HyperLRScheduler:
    """A scheduler from a config dict (see ``LRScheduleConfig``), e.g.
    ``{"warmup_steps": 100, "total_steps": 10000, "decay_style": "cosine", "min_lr_ratio": 0.1}``.
    """
    cfg = config if isinstance(config, LRScheduleConfig) else LRScheduleConfig.from_dict(config)
    return HyperLRScheduler(optimizer, cfg)
