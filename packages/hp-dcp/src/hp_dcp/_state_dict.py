"""Model and optimizer state dicts keyed by parameter name, and the RNG state, as *Statefuls*.

PyTorch optimizers key their state by parameter *index*, which changes when the parameters are
grouped differently; keyed by fully qualified name (FQN) the same checkpoint loads into a model
sharded another way. A fresh optimizer has no state to load into: its state is created first
(one step with zero gradients and learning rate 0, which changes no parameter), as PyTorch DCP
does.
"""

from __future__ import annotations

import random
from typing import Any

import torch
import torch.nn as nn

from hp_dtensor import DTensor

from .errors import DCPTypeError, StateDictError

__all__ = [
    "ModelState",
    "OptimizerState",
    "RNGState",
    "get_optimizer_state_dict",
    "set_optimizer_state_dict",
]


def _optimizers(optimizer) -> list:
    subs = getattr(optimizer, "optimizers", None)  # hp_optim.ChainedOptimizer
    return list(subs) if subs is not None else [optimizer]


def _names(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def _init_state(opt: torch.optim.Optimizer) -> None:
    params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
    if all(p in opt.state and opt.state[p] for p in params):
        return
    saved_grads = [p.grad for p in params]
    lrs = [g["lr"] for g in opt.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in opt.param_groups:
        g["lr"] = 0.0 if not isinstance(g["lr"], torch.Tensor) else torch.zeros_like(g["lr"])
    with torch.no_grad():
        opt.step()
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr
    for p, grad in zip(params, saved_grads):
        p.grad = grad


_NO_OPT = object()


def _check_model_optimizer(fn: str, model, optimizer=_NO_OPT) -> None:
    if not isinstance(model, nn.Module):
        raise DCPTypeError(f"{fn}: model is a {type(model).__name__}: give the torch.nn.Module")
    if optimizer is _NO_OPT:
        return
    for i, opt in enumerate(_optimizers(optimizer)):
        if not isinstance(getattr(opt, "param_groups", None), list):
            where = "optimizer" if opt is optimizer else f"optimizer.optimizers[{i}]"
            raise DCPTypeError(
                f"{fn}: {where} is a {type(opt).__name__}, not an optimizer: give a "
                "torch.optim.Optimizer (or an hp_optim.ChainedOptimizer)"
            )


def get_optimizer_state_dict(model: nn.Module, optimizer) -> dict:
    """``{"state": {fqn: {name: value}}, "param_groups": [{..., "params": [fqn, ...]}]}`` holding
    the optimizer's own state tensors (so loading into it in place updates the optimizer).
    Creates the state of a fresh optimizer first. Accepts a ``ChainedOptimizer``."""
    _check_model_optimizer("get_optimizer_state_dict", model, optimizer)
    names = _names(model)
    state: dict[str, Any] = {}
    groups = []
    for opt in _optimizers(optimizer):
        _init_state(opt)
        for g in opt.param_groups:
            fqns = []
            for p in g["params"]:
                if id(p) not in names:
                    raise StateDictError(
                        "the optimizer holds a parameter that is not in the model: pass the model "
                        "whose parameters the optimizer updates"
                    )
                fqns.append(names[id(p)])
                if p in opt.state:
                    state[names[id(p)]] = dict(opt.state[p])
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": fqns})
    return {"state": state, "param_groups": groups}


def set_optimizer_state_dict(model: nn.Module, optimizer, state_dict: dict) -> None:
    """Put a :func:`get_optimizer_state_dict`-shaped dict back into the optimizer."""
    _check_model_optimizer("set_optimizer_state_dict", model, optimizer)
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("param_groups"), list):
        raise DCPTypeError(
            f"set_optimizer_state_dict: state_dict is a {type(state_dict).__name__}"
            f"{' without param_groups' if isinstance(state_dict, dict) else ''}: give the dict "
            "get_optimizer_state_dict returned"
        )
    by_name = dict(model.named_parameters())
    groups = [g for opt in _optimizers(optimizer) for g in opt.param_groups]
    saved = state_dict["param_groups"]
    if len(saved) != len(groups):
        raise StateDictError(
            f"the state dict has {len(saved)} param groups, the optimizer {len(groups)}"
        )
    for g, s in zip(groups, saved):
        ids = {id(q) for q in g["params"]}
        mine = [n for n, p in by_name.items() if id(p) in ids]
        if sorted(mine) != sorted(s["params"]):
            raise StateDictError(
                "param group parameters differ between the state dict and the optimizer: "
                f"{sorted(set(mine) ^ set(s['params']))[:5]}"
            )
        for k, v in s.items():
            if k != "params":
                g[k] = v
    name_of = {id(p): n for n, p in by_name.items()}
    for opt in _optimizers(optimizer):
        for g in opt.param_groups:
            for p in g["params"]:
                name = name_of[id(p)]
                if name in state_dict["state"]:
                    st = opt.state[p]
                    for k, v in state_dict["state"][name].items():
                        if st.get(k) is not v:
                            st[k] = v


class ModelState:
    """A model as a Stateful: its ``state_dict()`` (DTensors stay sharded)."""

    def __init__(self, model: nn.Module) -> None:
        _check_model_optimizer("ModelState", model)
        self.model = model

    def state_dict(self) -> dict:
        return self.model.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        # ``load`` fills the model's own tensors in place; only entries that are not the
        # model's storage (a state dict built elsewhere, a module whose state_dict copies) are
        # loaded through the module
        current = self.model.state_dict()
        other = {k: v for k, v in state_dict.items() if not _aliases(v, current.get(k))}
        if other:
            self.model.load_state_dict(other, strict=False)


def _storage_ptr(t) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.untyped_storage().data_ptr()


def _aliases(a, b) -> bool:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return a is b
    return _storage_ptr(a) == _storage_ptr(b)


class OptimizerState:
    """An optimizer as a Stateful, keyed by parameter name (see module docs)."""

    def __init__(self, model: nn.Module, optimizer) -> None:
        _check_model_optimizer("OptimizerState", model, optimizer)
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)


class RNGState:
    """Python's, NumPy's (when installed), torch's CPU and CUDA random states, per rank."""

    def state_dict(self) -> dict:
        out: dict[str, Any] = {
            "python": random.getstate(),
            "torch": torch.get_rng_state().numpy().tobytes(),
        }
        try:
            import numpy as np

            out["numpy"] = np.random.get_state()
        except ImportError:  # pragma: no cover - torch's CPU build here ships without numpy
            pass
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["cuda"] = [s.numpy().tobytes() for s in torch.cuda.get_rng_state_all()]
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        random.setstate(state_dict["python"])
        torch.set_rng_state(torch.frombuffer(bytearray(state_dict["torch"]), dtype=torch.uint8))
        if "numpy" in state_dict:
            import numpy as np

            np.random.set_state(state_dict["numpy"])
        if "cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(
                [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in state_dict["cuda"]]
            )
