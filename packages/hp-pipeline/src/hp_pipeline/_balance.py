"""Stage balancing: split a model's layers into contiguous pipeline stages.

``balance_stages`` is the planner (pure Python). Given a cost and a memory figure per layer it
picks stage boundaries that minimise the slowest stage's summed cost while every stage fits a
memory limit, in the spirit of SAPP's pipeline-parallel balancing (PPB). Stage memory is

    sum(layer_memory) + inflight[stage] * sum(activation_memory)

over the stage's layers, where ``inflight[stage]`` is the number of microbatches whose
activations the stage holds at its peak (``num_stages - stage`` under 1F1B).

The optimum is exact: a dynamic programme over layer prefixes finds the smallest bottleneck,
then a backward pass picks, among all plans reaching it, the one whose last stage starts as late
as possible, then the second-to-last, and so on (later stages get as few layers as possible, so
with non-negative costs they are never more expensive than in another optimal plan that differs
only there). Costs and memory of a range are taken from prefix sums, so integer inputs are exact.

``profile_layers`` measures the inputs on a real model with torch (imported lazily) and
``plan_from_profile`` feeds its measurements to the planner.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BalanceError",
    "LayerProfile",
    "StagePlan",
    "balance_stages",
    "plan_from_profile",
    "profile_layers",
]

#: Bytes of training state per parameter byte assumed by ``plan_from_profile``: the parameter,
#: its gradient and Adam's two moment buffers, all in the parameter's dtype.
TRAIN_STATE_FACTOR = 4


class BalanceError(ValueError):
    """The balancing or profiling arguments are invalid, or no plan fits the memory limit."""


@dataclass(frozen=True)
class StagePlan:
    """A split of ``L`` layers into pipeline stages.

    ``boundaries[s]`` is the half-open layer range ``(start, stop)`` of stage ``s``; the ranges
    are non-empty, contiguous and cover ``0 .. L`` in order. ``stage_costs[s]`` and
    ``stage_memory[s]`` are the summed cost and the memory (parameters plus in-flight
    activations) of stage ``s``.
    """

    boundaries: tuple[tuple[int, int], ...]
    stage_costs: tuple[float, ...]
    stage_memory: tuple[float, ...]

    def __post_init__(self) -> None:
        n = len(self.boundaries)
        if n == 0:
            raise BalanceError("boundaries is empty; a plan needs at least one stage")
        if len(self.stage_costs) != n or len(self.stage_memory) != n:
            raise BalanceError(
                f"boundaries has {n} stages but stage_costs has {len(self.stage_costs)} and "
                f"stage_memory {len(self.stage_memory)}; give one value per stage"
            )
        expected = 0
        for s, (start, stop) in enumerate(self.boundaries):
            if start != expected or stop <= start:
                raise BalanceError(
                    f"boundaries[{s}] = {(start, stop)} must start at {expected} and be "
                    "non-empty; stages must be contiguous and cover the layers in order"
                )
            expected = stop

    @property
    def num_stages(self) -> int:
        """Number of stages."""
        return len(self.boundaries)

    @property
    def num_layers(self) -> int:
        """Number of layers covered."""
        return self.boundaries[-1][1]

    @property
    def bottleneck(self) -> float:
        """The cost of the slowest stage."""
        return max(self.stage_costs)

    def layers(self, stage: int) -> range:
        """The layer indices of ``stage``."""
        if not 0 <= stage < len(self.boundaries):
            raise BalanceError(f"stage must be in [0, {len(self.boundaries)}), got {stage}")
        return range(*self.boundaries[stage])


# -- planner -----------------------------------------------------------------------------------


def _check_values(name: str, values: Sequence[float], n: int) -> list[float]:
    vals = list(values)
    if len(vals) != n:
        raise BalanceError(
            f"{name} has {len(vals)} entries but layer_costs has {n}; give one value per layer"
        )
    for i, v in enumerate(vals):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise BalanceError(f"{name}[{i}] must be a number, got {v!r}")
        if not math.isfinite(v) or v < 0:
            raise BalanceError(f"{name}[{i}] must be finite and >= 0, got {v!r}")
    return vals


def _prefix(values: Sequence[float]) -> list[float]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out


def _minmax_dp(
    num_layers: int,
    num_stages: int,
    weight: Callable[[int, int, int], float],
    allowed: Callable[[int, int, int], bool],
) -> list[list[float]]:
    """``f[k][j]``: smallest possible max ``weight(stage, i, j)`` when the first ``j`` layers
    form ``k`` non-empty stages whose ranges all pass ``allowed(stage, i, j)``."""
    inf = math.inf
    f = [[inf] * (num_layers + 1) for _ in range(num_stages + 1)]
    f[0][0] = 0
    for k in range(num_stages):  # stage k covers [i, j)
        prev, cur = f[k], f[k + 1]
        # stage k needs k layers before it and leaves one layer for each later stage
        for j in range(k + 1, num_layers - (num_stages - 1 - k) + 1):
            best = inf
            for i in range(k, j):
                if prev[i] == inf or not allowed(k, i, j):
                    continue
                v = max(prev[i], weight(k, i, j))
                if v < best:
                    best = v
            cur[j] = best
    return f


def balance_stages(
    layer_costs: Sequence[float],
    layer_memory: Sequence[float],
    num_stages: int,
    *,
    memory_limit: float | None = None,
    activation_memory: Sequence[float] | None = None,
    inflight: Sequence[int] | None = None,
) -> StagePlan:
    """Split layers into ``num_stages`` contiguous non-empty stages, minimising the bottleneck.

    ``layer_costs[i]`` is layer ``i``'s time (any unit), ``layer_memory[i]`` its fixed memory
    (parameters, gradients, optimizer state) and ``activation_memory[i]`` (optional) the
    activation memory it keeps per in-flight microbatch. Stage ``s`` holds
    ``inflight[s]`` microbatches (default ``num_stages - s``, the 1F1B peak). With
    ``memory_limit`` every stage's memory must be ``<= memory_limit``.

    Returns the plan with the smallest maximum stage cost; among equally good plans, the one
    whose last stage starts latest, then the second-to-last, and so on. Runs in
    ``O(L**2 * S)``. Raises ``BalanceError`` for bad arguments or when no split fits
    ``memory_limit`` (the message gives the smallest limit that would fit).
    """
    if isinstance(num_stages, bool) or not isinstance(num_stages, int):
        raise BalanceError(f"num_stages must be an int, got {num_stages!r}")
    costs = list(layer_costs)
    n = len(costs)
    costs = _check_values("layer_costs", costs, n)
    memory = _check_values("layer_memory", layer_memory, n)
    if num_stages < 1 or num_stages > n:
        raise BalanceError(
            f"num_stages must be between 1 and the number of layers ({n}), got {num_stages}; "
            "every stage needs at least one layer"
        )
    if activation_memory is None:
        if inflight is not None:
            raise BalanceError(
                "inflight only scales activation_memory; pass activation_memory too or drop it"
            )
        act = [0] * n
        held = [0] * num_stages
    else:
        act = _check_values("activation_memory", activation_memory, n)
        if inflight is None:
            held = [num_stages - s for s in range(num_stages)]
        else:
            held = list(inflight)
            if len(held) != num_stages:
                raise BalanceError(
                    f"inflight has {len(held)} entries but num_stages is {num_stages}; "
                    "give one microbatch count per stage"
                )
            for s, h in enumerate(held):
                if isinstance(h, bool) or not isinstance(h, int) or h < 0:
                    raise BalanceError(f"inflight[{s}] must be an int >= 0, got {h!r}")
    if memory_limit is not None and (
        isinstance(memory_limit, bool)
        or not isinstance(memory_limit, (int, float))
        or math.isnan(memory_limit)
    ):
        raise BalanceError(f"memory_limit must be a number or None, got {memory_limit!r}")

    pc, pm, pa = _prefix(costs), _prefix(memory), _prefix(act)

    def cost(k: int, i: int, j: int) -> float:
        return pc[j] - pc[i]

    def mem(k: int, i: int, j: int) -> float:
        return (pm[j] - pm[i]) + held[k] * (pa[j] - pa[i])

    if memory_limit is None:

        def fits(k: int, i: int, j: int) -> bool:
            return True

    else:

        def fits(k: int, i: int, j: int) -> bool:
            return mem(k, i, j) <= memory_limit

    f = _minmax_dp(n, num_stages, cost, fits)
    best = f[num_stages][n]
    if best == math.inf:
        g = _minmax_dp(n, num_stages, mem, lambda k, i, j: True)
        need = g[num_stages][n]
        raise BalanceError(
            f"memory_limit={memory_limit!r} is too small: no split of {n} layers into "
            f"{num_stages} stages fits it; the smallest memory_limit that fits is {need!r} "
            "(raise it, add stages, or lower activation memory / inflight)"
        )

    # Among optimal plans, make the last stage start as late as possible, then the one before.
    starts: list[int] = []
    j = n
    for k in range(num_stages - 1, -1, -1):
        prev = f[k]
        for i in range(j - 1, k - 1, -1):
            if prev[i] <= best and cost(k, i, j) <= best and fits(k, i, j):
                starts.append(i)
                j = i
                break
        else:  # pragma: no cover - f guarantees a choice exists
            raise AssertionError("balance_stages: backtracking found no stage")
    starts.reverse()
    stops = starts[1:] + [n]
    bounds = tuple(zip(starts, stops))
    return StagePlan(
        boundaries=bounds,
        stage_costs=tuple(float(cost(k, i, j)) for k, (i, j) in enumerate(bounds)),
        stage_memory=tuple(mem(k, i, j) for k, (i, j) in enumerate(bounds)),
    )


# -- profiling -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerProfile:
    """Measurements of one layer from ``profile_layers``.

    ``time_s`` is the median forward plus backward time in seconds; ``param_bytes`` the bytes of
    its parameters (a parameter shared by several layers counts for the first only);
    ``activation_bytes`` the bytes of the tensors autograd saved for backward while its forward
    ran (each storage once, parameters excluded), per call of ``model(sample_input)``.
    """

    name: str
    time_s: float
    param_bytes: int
    activation_bytes: int


def _default_layers(model: Any) -> list[tuple[str, Any]]:
    from torch import nn

    out: list[tuple[str, Any]] = []
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            out.extend((f"{name}.{key}", sub) for key, sub in child.named_children())
        else:
            out.append((name, child))
    if not out:
        raise BalanceError(
            f"model ({type(model).__name__}) has no child modules to profile; "
            "pass layers=[(name, module), ...]"
        )
    return out


def _tensors(obj: Any) -> list[Any]:
    """Every tensor inside ``obj`` (tensors, lists, tuples, dicts, dataclasses)."""
    import dataclasses

    import torch

    found: list[Any] = []
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, (list, tuple)):
            stack.extend(reversed(x))
        elif isinstance(x, dict):
            stack.extend(reversed(list(x.values())))
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            stack.extend(getattr(x, f.name) for f in reversed(dataclasses.fields(x)))
    return found


def _default_loss(output: Any) -> Any:
    parts = [t.sum() for t in _tensors(output) if t.is_floating_point() and t.requires_grad]
    if not parts:
        raise BalanceError(
            "the model output has no floating tensor that requires grad; pass loss_fn="
        )
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total


class _Probe:
    """Hook state for one layer during one profiled iteration."""

    __slots__ = ("fwd", "fwd_start", "bwd_start", "bwd_end", "saved", "calls")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.fwd = 0.0
        self.fwd_start = 0.0
        self.bwd_start = math.inf
        self.bwd_end = -math.inf
        self.saved: dict[int, int] = {}
        self.calls = 0


def profile_layers(
    model: Any,
    sample_input: Any,
    *,
    layers: Sequence[tuple[str, Any]] | None = None,
    repeats: int = 3,
    warmup: int = 1,
    loss_fn: Callable[[Any], Any] | None = None,
) -> list[LayerProfile]:
    """Measure time, parameter bytes and saved-activation bytes of each layer of ``model``.

    ``sample_input`` is passed as ``model(*sample_input)`` if it is a tuple or list,
    ``model(**sample_input)`` if a dict, else ``model(sample_input)``. ``layers`` is a list of
    ``(name, module)`` pairs of submodules (if one is nested in another, the outer one's
    figures include the inner's). Default: the model's direct children, with the items of any
    child ``ModuleList``/``ModuleDict`` (say ``layers``) expanded in place as ``layers.0``,
    ``layers.1``, ...

    Runs ``warmup + repeats`` iterations of forward, ``loss_fn(output)`` (default: the sum of
    all floating output tensors that require grad) and backward, and reports the median of the
    last ``repeats``. Forward time comes from forward pre/post hooks. Backward time runs from
    the first gradient reaching one of the layer's outputs to the last of: gradients of its
    inputs that require grad, and gradient accumulation into its own parameters (so a layer
    whose input needs no grad, like an embedding, is still timed). On CUDA each hook
    synchronises the device, which serialises the run but makes host clocks valid.
    The ``.grad`` of parameters and of leaf inputs is restored afterwards. Returns profiles
    in ``layers`` order.
    """
    import torch

    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise BalanceError(f"repeats must be an int >= 1, got {repeats!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise BalanceError(f"warmup must be an int >= 0, got {warmup!r}")
    if layers is None:
        pairs = _default_layers(model)
    else:
        pairs = list(layers)
        if not pairs:
            raise BalanceError("layers is empty; pass at least one (name, module) pair")
        for k, pair in enumerate(pairs):
            if (
                not isinstance(pair, (tuple, list))
                or len(pair) != 2
                or not isinstance(pair[1], torch.nn.Module)
            ):
                raise BalanceError(f"layers[{k}] must be a (name, nn.Module) pair, got {pair!r}")
    names = [str(name) for name, _ in pairs]
    if len(set(names)) != len(names):
        raise BalanceError(f"layers has repeated names {names}; give each layer its own name")
    loss = _default_loss if loss_fn is None else loss_fn

    # Parameters: each counted once, for the first layer that holds it.
    seen: set[int] = set()
    owned: list[list[Any]] = []
    for _, module in pairs:
        mine = []
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                mine.append(p)
        owned.append(mine)
    param_bytes = [sum(p.numel() * p.element_size() for p in ps) for ps in owned]
    all_params = list(model.parameters()) + [p for ps in owned for p in ps]
    param_storages = {p.untyped_storage().data_ptr() for p in all_params}

    on_cuda = any(p.is_cuda for p in all_params) or any(t.is_cuda for t in _tensors(sample_input))

    def now() -> float:
        if on_cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    probes = [_Probe() for _ in pairs]
    active: list[_Probe] = []
    tensor_handles: list[Any] = []  # hooks on this iteration's tensors (inputs may be leaves)

    def make_hooks(probe: _Probe) -> tuple[Callable, Callable, Callable]:
        def mark_bwd_start(grad: Any) -> None:
            probe.bwd_start = min(probe.bwd_start, now())

        def mark_bwd_end(*_: Any) -> None:
            probe.bwd_end = max(probe.bwd_end, now())

        def pre(module: Any, args: Any) -> None:
            probe.calls += 1
            for t in _tensors(args):
                if t.requires_grad:
                    tensor_handles.append(t.register_hook(mark_bwd_end))
            active.append(probe)
            probe.fwd_start = now()

        def post(module: Any, args: Any, output: Any) -> None:
            probe.fwd += now() - probe.fwd_start
            if active and active[-1] is probe:
                active.pop()
            elif probe in active:
                active.remove(probe)
            for t in _tensors(output):
                if t.requires_grad:
                    tensor_handles.append(t.register_hook(mark_bwd_start))

        return pre, post, mark_bwd_end

    def pack(t: Any) -> Any:
        if active:
            try:
                storage = t.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
            except (RuntimeError, NotImplementedError):  # sparse, nested, ...
                key, size = id(t), t.numel() * t.element_size()
            if key not in param_storages:
                for probe in active:
                    probe.saved.setdefault(key, size)
        return t

    def unpack(t: Any) -> Any:
        return t

    handles = []
    leaf_inputs = [t for t in _tensors(sample_input) if t.requires_grad and t.is_leaf]
    saved_grads = {id(t): (t, t.grad) for t in [*all_params, *leaf_inputs]}
    times: list[list[float]] = [[] for _ in pairs]
    act_bytes = [0] * len(pairs)
    try:
        for probe, (_, module), mine in zip(probes, pairs, owned):
            pre, post, end = make_hooks(probe)
            handles.append(module.register_forward_pre_hook(pre))
            handles.append(module.register_forward_hook(post))
            for p in mine:
                if p.requires_grad:
                    handles.append(p.register_post_accumulate_grad_hook(end))
        if isinstance(sample_input, (tuple, list)):
            args, kwargs = tuple(sample_input), {}
        elif isinstance(sample_input, dict):
            args, kwargs = (), dict(sample_input)
        else:
            args, kwargs = (sample_input,), {}
        for it in range(warmup + repeats):
            for p, _ in saved_grads.values():
                p.grad = None
            for probe in probes:
                probe.reset()
            active.clear()
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                out = model(*args, **kwargs)
            total = loss(out)
            total.backward()
            now()
            del out, total
            for h in tensor_handles:
                h.remove()
            tensor_handles.clear()
            for k, probe in enumerate(probes):
                if probe.calls == 0:
                    raise BalanceError(
                        f"layer {names[k]!r} never ran during model(sample_input); pass "
                        "layers= with modules the model calls"
                    )
                bwd = probe.bwd_end - probe.bwd_start
                if not math.isfinite(bwd) or bwd < 0:
                    bwd = 0.0  # no gradient flowed through this layer
                if it >= warmup:
                    times[k].append(probe.fwd + bwd)
                    act_bytes[k] = sum(probe.saved.values())
    finally:
        for h in handles + tensor_handles:
            h.remove()
        for p, g in saved_grads.values():
            p.grad = g
    return [
        LayerProfile(
            name=names[k],
            time_s=float(statistics.median(times[k])),
            param_bytes=int(param_bytes[k]),
            activation_bytes=int(act_bytes[k]),
        )
        for k in range(len(pairs))
    ]


def plan_from_profile(
    profiles: Sequence[LayerProfile], num_stages: int, *, memory_limit: float | None = None
) -> StagePlan:
    """Balance profiled layers: cost ``time_s``, fixed memory ``param_bytes * 4`` (parameters,
    gradients and two Adam moments, all in the parameter dtype; see ``TRAIN_STATE_FACTOR``),
    activation memory ``activation_bytes`` per in-flight microbatch with the 1F1B default."""
    profiles = list(profiles)
    if not profiles:
        raise BalanceError("profiles is empty; run profile_layers first")
    return balance_stages(
        [p.time_s for p in profiles],
        [p.param_bytes * TRAIN_STATE_FACTOR for p in profiles],
        num_stages,
        memory_limit=memory_limit,
        activation_memory=[p.activation_bytes for p in profiles],
    )
