"""Learning-rate schedules: linear warmup, then cosine, linear, constant or warmup-stable-decay.

The schedule itself is a pure function of the step (``lr_factor``), so it can be tabulated and
tested; ``HyperLRScheduler`` applies it to any optimizer with ``param_groups`` (including
``ChainedOptimizer``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from ._checks import check_int, check_number
from .errors import OptimError, OptimTypeError

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
        fn = "LRScheduleConfig"
        check_int(self.warmup_steps, "warmup_steps", fn)
        check_int(self.total_steps, "total_steps", fn, low=1)
        check_int(self.decay_steps, "decay_steps", fn)
        check_number(self.min_lr_ratio, "min_lr_ratio", fn, high=1.0)
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
        if not isinstance(config, dict):
            raise OptimTypeError(
                f"scheduler config is a {type(config).__name__}: give a dict such as "
                "{'warmup_steps': 100, 'total_steps': 10000} (or an LRScheduleConfig)"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise OptimError(f"scheduler config has unknown keys {unknown}: use {sorted(known)}")
        return cls(**config)


def lr_factor(step: int, cfg: LRScheduleConfig) -> float:
    """The LR multiplier at ``step`` (0-based)."""
    if not isinstance(cfg, LRScheduleConfig):
        raise OptimTypeError(
            f"lr_factor: cfg is a {type(cfg).__name__}: give an LRScheduleConfig "
            "(LRScheduleConfig.from_dict(d) builds one from a dict)"
        )
    check_int(step, "step", "lr_factor")
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


def _check_optimizer(optimizer, fn: str) -> None:
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, list) or not all(isinstance(g, dict) and "lr" in g for g in groups):
        raise OptimTypeError(
            f"{fn}: optimizer is a {type(optimizer).__name__}, not an optimizer: give one with "
            "param_groups (AdamW, Muon, ChainedOptimizer, any torch.optim.Optimizer)"
        )


class HyperLRScheduler:
    """Applies ``lr_factor`` to every param group of ``optimizer`` (base LR = the group's LR at
    construction). ``step()`` after each optimizer step, like torch's schedulers."""

    def __init__(self, optimizer, cfg: LRScheduleConfig) -> None:
        _check_optimizer(optimizer, "HyperLRScheduler")
        if not isinstance(cfg, LRScheduleConfig):
            raise OptimTypeError(
                f"HyperLRScheduler: cfg is a {type(cfg).__name__}: give an LRScheduleConfig "
                "(or use get_hyper_lr_scheduler(optimizer, dict))"
            )
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
        if not isinstance(state, dict) or "last_step" not in state:
            raise OptimTypeError(
                f"HyperLRScheduler.load_state_dict: state is a {type(state).__name__}"
                f"{' without last_step' if isinstance(state, dict) else ''}: give the dict "
                "{'last_step': n} that state_dict() returned"
            )
        v = state["last_step"]
        if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:  # a 0-d tensor from a checkpoint
            v = v.item()
        self.last_step = check_int(v, "state['last_step']", "load_state_dict")
        self._apply()


def get_hyper_lr_scheduler(optimizer, config: dict | LRScheduleConfig) -> HyperLRScheduler:
    """A scheduler from a config dict (see ``LRScheduleConfig``), e.g.
    ``{"warmup_steps": 100, "total_steps": 10000, "decay_style": "cosine", "min_lr_ratio": 0.1}``.
    """
    _check_optimizer(optimizer, "get_hyper_lr_scheduler")
    cfg = config if isinstance(config, LRScheduleConfig) else LRScheduleConfig.from_dict(config)
    return HyperLRScheduler(optimizer, cfg)
