"""AdamW on DTensors, ChainedOptimizer and the optimizer factory."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

import torch

from ._clip import OptimError

__all__ = ["AdamW", "ChainedOptimizer", "get_hyper_optimizer"]


class AdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` on the multi-tensor (foreach) path.

    With DTensor parameters every foreach op runs on the local shards in one call per op (specs
    agree position by position: a parameter, its gradient and its states share placements), so
    nothing is gathered and the result equals AdamW on the whole tensors.
    """

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=1e-2,
        *,
        amsgrad=False,
        maximize=False,
        capturable=False,
    ):
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            foreach=True,
            maximize=maximize,
            capturable=capturable,
            fused=False,
        )


class ChainedOptimizer:
    """Several optimizers as one: ``step``, ``zero_grad``, ``state_dict``, ``load_state_dict``
    and ``param_groups`` (all groups, so one LR scheduler drives them all)."""

    def __init__(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        self.optimizers = list(optimizers)
        if not self.optimizers:
            raise OptimError("ChainedOptimizer needs at least one optimizer")
        seen: set[int] = set()
        for opt in self.optimizers:
            for g in opt.param_groups:
                for p in g["params"]:
                    if id(p) in seen:
                        raise OptimError("a parameter appears in two chained optimizers")
                    seen.add(id(p))

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    @property
    def state(self):
        merged = {}
        for opt in self.optimizers:
            merged.update(opt.state)
        return merged

    def step(self, closure=None):
        """Step every optimizer (a closure is evaluated once)."""
        loss = closure() if closure is not None else None
        for opt in self.optimizers:
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state: dict) -> None:
        states = state["optimizers"]
        if len(states) != len(self.optimizers):
            raise OptimError(
                f"state_dict holds {len(states)} optimizers, this chain has {len(self.optimizers)}"
            )
        for opt, st in zip(self.optimizers, states):
            opt.load_state_dict(st)


def get_hyper_optimizer(model: torch.nn.Module, config: dict):
    """Build an optimizer from rules, e.g.::

        {"lr": 3e-4, "weight_decay": 0.1,
         "groups": [{"match": ["*.norm*.weight", "*.bias"], "weight_decay": 0.0},
                    {"match": ["tok.*"], "lr": 1e-3}]}

    Parameters go to the first group whose fnmatch patterns (or ``"ndim"``) match; the rest use
    the defaults. Groups may set ``lr``, ``weight_decay``, ``betas``, ``eps``. Returns an
    ``AdamW`` (a ``ChainedOptimizer`` when several optimizer types are asked for in a later
    version). Unknown keys raise ``OptimError``.
    """
    known = {"lr", "weight_decay", "betas", "eps", "groups", "optimizer"}
    unknown = sorted(set(config) - known)
    if unknown:
        raise OptimError(f"optimizer config has unknown keys {unknown}: use {sorted(known)}")
    kind = config.get("optimizer", "adamw")
    if kind != "adamw":
        raise OptimError(f"optimizer={kind!r}: this version builds 'adamw' only")
    defaults = {k: config[k] for k in ("lr", "weight_decay", "betas", "eps") if k in config}
    rules = list(config.get("groups", []))
    buckets: list[list] = [[] for _ in rules] + [[]]
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        for i, rule in enumerate(rules):
            pats = rule.get("match", [])
            by_name = any(fnmatch.fnmatchcase(name, pat) for pat in pats)
            by_ndim = "ndim" in rule and p.ndim == rule["ndim"]
            if by_name or by_ndim:
                buckets[i].append(p)
                break
        else:
            buckets[-1].append(p)
    groups = []
    for rule, params in zip(rules + [{}], buckets):
        if params:
            extra = {k: v for k, v in rule.items() if k in ("lr", "weight_decay", "betas", "eps")}
            groups.append({"params": params, **extra})
    return AdamW(groups, **defaults)
