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


_HYPER = ("lr", "weight_decay", "betas", "eps", "momentum", "nesterov", "ns_steps", "adjust_lr")
_ADAMW_KEYS = ("lr", "weight_decay", "betas", "eps")
_MUON_KEYS = ("lr", "weight_decay", "momentum", "nesterov", "ns_steps", "adjust_lr")


def get_hyper_optimizer(model: torch.nn.Module, config: dict):
    """Build an optimizer from rules, e.g.::

        {"optimizer": "muon", "lr": 0.02, "weight_decay": 0.1,
         "groups": [{"match": ["tok.*", "out.*"], "optimizer": "adamw", "lr": 3e-4},
                    {"ndim": 1, "optimizer": "adamw", "lr": 3e-4, "weight_decay": 0.0}]}

    Each parameter goes to the first group whose fnmatch patterns (``"match"``) or ``"ndim"``
    match it, else to the defaults. A group may set ``optimizer`` ("adamw" or "muon") and the
    hyper-parameters ``lr``, ``weight_decay``, ``betas``, ``eps`` (AdamW) or ``momentum``,
    ``nesterov``, ``ns_steps``, ``adjust_lr`` (Muon). Returns an ``AdamW``, a ``Muon``, or a
    ``ChainedOptimizer`` of both. Unknown keys raise ``OptimError``; Muon raises for a
    parameter that is not 2-D (route it to an AdamW group).
    """
    from ._muon import Muon

    known = set(_HYPER) | {"groups", "optimizer"}
    unknown = sorted(set(config) - known)
    if unknown:
        raise OptimError(f"optimizer config has unknown keys {unknown}: use {sorted(known)}")
    default_kind = config.get("optimizer", "adamw")
    rules = list(config.get("groups", []))
    for i, rule in enumerate(rules):
        bad = sorted(set(rule) - (set(_HYPER) | {"match", "ndim", "optimizer"}))
        if bad:
            raise OptimError(f"config['groups'][{i}] has unknown keys {bad}")
    for kind in [default_kind] + [r.get("optimizer", default_kind) for r in rules]:
        if kind not in ("adamw", "muon"):
            raise OptimError(f"optimizer={kind!r}: use 'adamw' or 'muon'")
    buckets: list[list] = [[] for _ in rules] + [[]]
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        for i, rule in enumerate(rules):
            by_name = any(fnmatch.fnmatchcase(name, pat) for pat in rule.get("match", []))
            by_ndim = "ndim" in rule and p.ndim == rule["ndim"]
            if by_name or by_ndim:
                buckets[i].append(p)
                break
        else:
            buckets[-1].append(p)
    groups: dict[str, list] = {"adamw": [], "muon": []}
    for rule, params in zip(rules + [{}], buckets):
        if params:
            kind = rule.get("optimizer", default_kind)
            keys = _ADAMW_KEYS if kind == "adamw" else _MUON_KEYS
            extra = {k: v for k, v in {**config, **rule}.items() if k in keys}
            groups[kind].append({"params": params, **extra})
    opts = []
    if groups["muon"]:
        opts.append(Muon(groups["muon"]))
    if groups["adamw"]:
        opts.append(AdamW(groups["adamw"]))
    if not opts:
        raise OptimError("the model has no trainable parameters")
    return opts[0] if len(opts) == 1 else ChainedOptimizer(opts)
