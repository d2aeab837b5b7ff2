"""AdamW on DTensors, ChainedOptimizer and the optimizer factory."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

import torch

from ._checks import check_bool, check_int, check_number, check_params
from .errors import OptimError, OptimTypeError

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
        fn = "AdamW"
        check_params(params, fn)
        check_number(lr, "lr", fn, tensor_ok=capturable is True)  # torch: tensor lr needs it
        if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") or len(betas) != 2:
            raise OptimTypeError(
                f"{fn}: betas={betas!r}: give a pair (beta1, beta2), e.g. (0.9, 0.999)"
            )
        for i, b in enumerate(betas):
            # torch takes tensor betas only with capturable (or fused) steps
            check_number(
                b, f"betas[{i}]", fn, high=1.0, high_open=True, tensor_ok=capturable is True
            )
        check_number(eps, "eps", fn)
        check_number(weight_decay, "weight_decay", fn)
        check_bool(amsgrad, "amsgrad", fn)
        check_bool(maximize, "maximize", fn)
        check_bool(capturable, "capturable", fn)
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
        if isinstance(optimizers, (torch.optim.Optimizer, ChainedOptimizer)):
            raise OptimTypeError(
                f"ChainedOptimizer: optimizers is a single {type(optimizers).__name__}: give a "
                "list of optimizers, e.g. ChainedOptimizer([muon, adamw])"
            )
        if isinstance(optimizers, (str, bytes, dict)) or not hasattr(optimizers, "__iter__"):
            raise OptimTypeError(
                f"ChainedOptimizer: optimizers is a {type(optimizers).__name__}: give a list of "
                "optimizers"
            )
        self.optimizers = list(optimizers)
        if not self.optimizers:
            raise OptimError("ChainedOptimizer needs at least one optimizer")
        for i, opt in enumerate(self.optimizers):
            if not all(hasattr(opt, a) for a in ("param_groups", "step", "state_dict")):
                raise OptimTypeError(
                    f"ChainedOptimizer: optimizers[{i}] is a {type(opt).__name__}, not an "
                    "optimizer: give torch.optim.Optimizer instances (AdamW, Muon, ...)"
                )
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
        if not isinstance(state, dict) or not isinstance(state.get("optimizers"), (list, tuple)):
            kind = type(state).__name__ if not isinstance(state, dict) else "dict without it"
            raise OptimTypeError(
                f"ChainedOptimizer.load_state_dict: state is a {kind}: give the dict "
                "{'optimizers': [...]} that ChainedOptimizer.state_dict() returned"
            )
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


def _check_hyper(d: dict, where: str, fn: str) -> None:
    """The hyper-parameters of one config level, checked as AdamW/Muon check their own."""
    for k in ("lr", "weight_decay", "eps"):
        if k in d:
            check_number(d[k], f"{where}['{k}']", fn, tensor_ok=k == "lr")
    if "momentum" in d:
        check_number(d["momentum"], f"{where}['momentum']", fn, high=1.0, high_open=True)
    if "nesterov" in d:
        check_bool(d["nesterov"], f"{where}['nesterov']", fn)
    if "ns_steps" in d:
        check_int(d["ns_steps"], f"{where}['ns_steps']", fn)
    if "betas" in d:
        b = d["betas"]
        if isinstance(b, (str, bytes)) or not hasattr(b, "__len__") or len(b) != 2:
            raise OptimTypeError(f"{fn}: {where}['betas']={b!r}: give a pair (beta1, beta2)")
        for i, x in enumerate(b):
            check_number(x, f"{where}['betas'][{i}]", fn, high=1.0, high_open=True)


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

    fn = "get_hyper_optimizer"
    if not isinstance(model, torch.nn.Module):
        raise OptimTypeError(f"{fn}: model is a {type(model).__name__}: give a torch.nn.Module")
    if not isinstance(config, dict):
        raise OptimTypeError(
            f"{fn}: config is a {type(config).__name__}: give a dict such as "
            "{'optimizer': 'adamw', 'lr': 1e-3}"
        )
    groups_cfg = config.get("groups", [])
    if not isinstance(groups_cfg, (list, tuple)):
        raise OptimTypeError(
            f"{fn}: config['groups'] is a {type(groups_cfg).__name__}: give a list of dicts"
        )
    for i, rule in enumerate(groups_cfg):
        if not isinstance(rule, dict):
            raise OptimTypeError(
                f"{fn}: config['groups'][{i}] is a {type(rule).__name__}: give a dict such as "
                "{'match': ['tok.*'], 'optimizer': 'adamw'}"
            )
        pats = rule.get("match", [])
        if isinstance(pats, (str, bytes)) or not isinstance(pats, (list, tuple)):
            raise OptimTypeError(
                f"{fn}: config['groups'][{i}]['match']={pats!r}: give a list of fnmatch "
                f"patterns, e.g. [{pats!r}]"
            )
        if "ndim" in rule:
            check_int(rule["ndim"], f"config['groups'][{i}]['ndim']", fn)
    _check_hyper(config, "config", fn)
    for i, rule in enumerate(groups_cfg):
        _check_hyper(rule, f"config['groups'][{i}]", fn)
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
