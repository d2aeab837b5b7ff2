"""Deferred initialisation: build on the meta device, shard, then materialise and initialise."""

from __future__ import annotations

import contextlib

import torch

from ._checks import check_callable, check_module
from ._dtensor import DTensor, _make

__all__ = ["init_empty_weights", "init_on_device", "init_parameters"]


@contextlib.contextmanager
def init_empty_weights():
    """Build modules with parameters and buffers on the meta device (no memory, no RNG draws).

    Example::

        with init_empty_weights():
            model = MyModel()
        parallelize(model, mesh)          # shard the meta parameters
        manual_seed(0, mesh)
        init_parameters(model)            # materialise and initialise the local shards
    """
    with torch.device("meta"):
        yield


@contextlib.contextmanager
def init_on_device(device: str | torch.device):
    """Build modules with parameters and buffers created directly on ``device``."""
    with torch.device(device):
        yield


def _materialize(t: torch.Tensor, device) -> torch.Tensor:
    if isinstance(t, DTensor):
        if t._local.device.type != "meta":
            return t
        mesh = t._spec.mesh
        local = torch.empty(t._local.shape, dtype=t._local.dtype, device=mesh.device)
        return _make(local, t._spec)
    if t.device.type != "meta":
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=device)


def init_parameters(module: torch.nn.Module, *, init_fn=None, device=None) -> torch.nn.Module:
    """Materialise meta parameters and buffers of ``module`` (in place) and initialise them.

    Sharded parameters get local storage on their mesh's device, plain ones on ``device``
    (default: CPU, or the current accelerator). Initialisation runs ``init_fn(module)`` when
    given, else ``reset_parameters()`` of every submodule in ``module.modules()`` order -- the
    order in which a model that builds its submodules in registration order initialised them.
    Under ``manual_seed(seed, mesh)`` each shard then equals the slice of a single-device
    initialisation after ``torch.manual_seed(seed)`` (NOTE [Random guarantee]).
    Buffers computed in ``__init__`` (not in ``reset_parameters``) must be recomputed by
    ``init_fn``.
    """
    check_module(module, "module", "init_parameters")
    check_callable(init_fn, "init_fn", "init_parameters")
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is None:
                continue
            new = _materialize(p, device)
            if new is not p:
                sub._parameters[name] = torch.nn.Parameter(new, requires_grad=p.requires_grad)
        for name, b in list(sub._buffers.items()):
            if b is not None:
                sub._buffers[name] = _materialize(b, device)
    with torch.no_grad():
        if init_fn is not None:
            init_fn(module)
        else:
            for sub in module.modules():
                reset = getattr(sub, "reset_parameters", None)
                if callable(reset):
                    reset()
    return module
