"""The table of which op gets which sharding rule. One place to review coverage.

Names are the ``__name__`` of the torch callable (``torch.add``, ``Tensor.add`` and
``Tensor.__add__`` are ``"add"``/``"__add__"``); in-place forms end with ``_`` or are
``__i*__`` dunders and keep the placements of their first argument. An op missing here runs
through the fallback: gather, compute on every rank, return a replicated result (correct,
slow, warned about once per op).
"""

from __future__ import annotations

from functools import partial

from ._complex import (
    contraction_rule,
    einsum_rule,
    embedding_rule,
    log_softmax_rule,
    loss_rule,
    matmul_labels,
    norm_rule,
    rotary_rule,
    sdpa_rule,
    softmax_rule,
)
from ._core import Call, register_sharding_rule
from ._pointwise import cast_rule, like_factory_rule, pointwise_rule, safe
from ._reduction import reduction_rule
from ._view import cat_rule, getitem_rule, permute_like_rule, reshape_rule, split_rule, stack_rule

# fmt: off
# -- pointwise -----------------------------------------------------------------------------
#: Linear in every tensor argument: Partial inputs give a Partial output.
POINTWISE_LINEAR = (
    "add", "sub", "subtract", "rsub", "neg", "negative", "positive", "clone", "contiguous",
    "real", "conj", "zero", "copy",
)
#: Casts: the output follows the first tensor (``type_as(other)`` never moves ``other``).
#: Widening float casts let Partial values through; narrowing and integer casts reduce first.
CASTS_LINEAR = ("float", "double", "cpu", "cuda")
CASTS = ("to", "type", "type_as", "half", "bfloat16", "bool", "int", "long", "short", "byte",
         "char")
#: Linear in any single tensor when the others are replicated.
POINTWISE_MUL = ("mul", "multiply")
#: Linear in the first tensor when the others are replicated.
POINTWISE_DIV = ("div", "divide", "true_divide")
#: Elementwise but not linear: Partial inputs are reduced first.
POINTWISE = (
    "abs", "absolute", "acos", "arccos", "acosh", "asin", "arcsin", "asinh", "atan", "arctan",
    "atan2", "arctan2", "atanh", "bitwise_and", "bitwise_not", "bitwise_or", "bitwise_xor",
    "ceil", "clamp", "clamp_min", "clamp_max", "clip", "copysign", "cos", "cosh", "deg2rad",
    "digamma", "elu", "eq", "erf", "erfc", "erfinv", "exp", "exp2", "expm1", "fill", "floor",
    "floor_divide", "fmod", "frac", "ge", "gelu", "greater", "greater_equal", "gt",
    "hardsigmoid", "hardswish", "hardtanh", "heaviside", "hypot", "isfinite", "isinf", "isnan",
    "le", "leaky_relu", "lerp", "less", "less_equal", "lgamma", "log", "log10", "log1p", "log2",
    "logical_and", "logical_not", "logical_or", "logical_xor", "logit", "lt", "masked_fill",
    "maximum", "minimum", "fmax", "fmin", "mish", "nan_to_num", "ne", "not_equal", "pow",
    "float_power", "rad2deg", "reciprocal", "relu", "relu6", "remainder", "round", "rsqrt",
    "selu", "celu", "sigmoid", "sign", "sgn", "signbit", "silu", "sin", "sinc", "sinh",
    "softplus", "softsign", "sqrt", "square", "tan", "tanh", "tanhshrink", "threshold", "trunc",
    "fix", "where", "xlogy", "addcmul", "addcdiv", "logsigmoid", "int_repr", "isclose",
    "nextafter", "bitwise_left_shift", "bitwise_right_shift", "i0",
)
#: Python operators: dunder name -> (op family, in-place).
DUNDERS = {
    "__add__": ("all", False),
    "__radd__": ("all", False),
    "__iadd__": ("all", True),
    "__sub__": ("all", False),
    "__rsub__": ("all", False),
    "__isub__": ("all", True),
    "__neg__": ("all", False),
    "__pos__": ("all", False),
    "__mul__": ("one", False),
    "__rmul__": ("one", False),
    "__imul__": ("one", True),
    "__truediv__": ("first", False),
    "__itruediv__": ("first", True),
    "__div__": ("first", False),
    "__idiv__": ("first", True),
    "__rtruediv__": ("none", False),
    "__rdiv__": ("none", False),
    "__floordiv__": ("none", False),
    "__rfloordiv__": ("none", False),
    "__ifloordiv__": ("none", True),
    "__mod__": ("none", False),
    "__rmod__": ("none", False),
    "__imod__": ("none", True),
    "__pow__": ("none", False),
    "__rpow__": ("none", False),
    "__ipow__": ("none", True),
    "__abs__": ("none", False),
    "__invert__": ("none", False),
    "__and__": ("none", False),
    "__rand__": ("none", False),
    "__iand__": ("none", True),
    "__or__": ("none", False),
    "__ror__": ("none", False),
    "__ior__": ("none", True),
    "__xor__": ("none", False),
    "__rxor__": ("none", False),
    "__ixor__": ("none", True),
    "__lshift__": ("none", False),
    "__rshift__": ("none", False),
    "__eq__": ("none", False),
    "__ne__": ("none", False),
    "__lt__": ("none", False),
    "__le__": ("none", False),
    "__gt__": ("none", False),
    "__ge__": ("none", False),
    "__matmul__": ("matmul", False),
    "__rmatmul__": ("rmatmul", False),
    "__getitem__": ("getitem", False),
}
#: ``*_like`` factories: same sharding, replicated values; inputs never move.
LIKE_FACTORIES = ("zeros_like", "ones_like", "empty_like", "full_like")

# -- reductions: name -> (partial kind, dim position, keepdim position, returns (values, idx))
REDUCTIONS = {
    "sum": ("sum", 1, 2, False),
    "nansum": ("nansum", 1, 2, False),
    "mean": ("avg", 1, 2, False),
    "nanmean": (None, 1, 2, False),
    "amax": ("max", 1, 2, False),
    "amin": ("min", 1, 2, False),
    "max": ("max", 1, 2, True),
    "min": ("min", 1, 2, True),
    "prod": (None, 1, 2, False),
    "argmax": (None, 1, 2, False),
    "argmin": (None, 1, 2, False),
    "logsumexp": (None, 1, 2, False),
    "all": (None, 1, 2, False),
    "any": (None, 1, 2, False),
    "norm": (None, 2, 3, False),
    "std": (None, 1, 3, False),
    "var": (None, 1, 3, False),
    "count_nonzero": (None, 1, None, False),
    "median": (None, 1, 2, True),
}

# -- views and shape ops ------------------------------------------------------------------
PERMUTE_LIKE = (
    "transpose", "swapaxes", "swapdims", "t", "permute", "movedim", "moveaxis", "unsqueeze",
    "squeeze", "get_T", "get_mT",
)
RESHAPES = (
    "view", "reshape", "view_as", "reshape_as", "expand", "expand_as", "flatten", "unflatten",
)
SPLITS = ("split", "chunk", "unbind", "tensor_split", "split_with_sizes")
CATS = ("cat", "concat", "concatenate", "stack")

# -- complex ops ---------------------------------------------------------------------------
COMPLEX = (
    "mm", "bmm", "matmul", "addmm", "linear", "baddbmm", "einsum", "embedding", "softmax",
    "log_softmax", "layer_norm", "rms_norm", "scaled_dot_product_attention", "cross_entropy",
    "nll_loss", "rotary_position_embedding",
)
# fmt: on


def _register_all() -> None:
    for name in POINTWISE_LINEAR:
        register_sharding_rule(name, safe(partial(pointwise_rule, linear="all")))
        register_sharding_rule(
            name + "_", safe(partial(pointwise_rule, linear="all", inplace=True))
        )
    for names, lin in ((POINTWISE_MUL, "one"), (POINTWISE_DIV, "first"), (POINTWISE, "none")):
        for name in names:
            register_sharding_rule(name, safe(partial(pointwise_rule, linear=lin)))
            register_sharding_rule(
                name + "_", safe(partial(pointwise_rule, linear=lin, inplace=True))
            )
    register_sharding_rule("fill_", safe(partial(pointwise_rule, linear="none", inplace=True)))
    register_sharding_rule("zero_", safe(partial(pointwise_rule, linear="all", inplace=True)))
    for dunder, (fam, inplace) in DUNDERS.items():
        if fam in ("all", "one", "first", "none"):
            register_sharding_rule(
                dunder, safe(partial(pointwise_rule, linear=fam, inplace=inplace))
            )
    for name in CASTS_LINEAR:
        register_sharding_rule(name, partial(cast_rule, linear=True))
    for name in CASTS:
        register_sharding_rule(name, partial(cast_rule, linear=False))
    for name in LIKE_FACTORIES:
        register_sharding_rule(name, like_factory_rule)
    for name, (kind, dpos, kpos, tup) in REDUCTIONS.items():
        register_sharding_rule(name, _reduction(kind, dpos, kpos, tup))
    for name in PERMUTE_LIKE:
        register_sharding_rule(name, permute_like_rule)
    for name in RESHAPES:
        register_sharding_rule(name, _reshape)
    for name in SPLITS:
        register_sharding_rule(name, _split)
    register_sharding_rule(("cat", "concat", "concatenate"), _cat)
    register_sharding_rule("stack", _stack)
    register_sharding_rule("__getitem__", getitem_rule)
    register_sharding_rule(("select", "narrow"), _select_narrow)
    register_sharding_rule(("mm", "bmm", "matmul", "__matmul__", "__rmatmul__"), _matmul)
    register_sharding_rule(("addmm", "baddbmm"), _addmm)
    register_sharding_rule("linear", _linear)
    register_sharding_rule("einsum", einsum_rule)
    register_sharding_rule("embedding", embedding_rule)
    register_sharding_rule(("softmax", "_softmax"), softmax_rule)
    register_sharding_rule(("log_softmax", "_log_softmax"), log_softmax_rule)
    register_sharding_rule(("layer_norm", "rms_norm"), norm_rule)
    register_sharding_rule("scaled_dot_product_attention", sdpa_rule)
    register_sharding_rule(("cross_entropy", "nll_loss"), _loss)
    register_sharding_rule("rotary_position_embedding", rotary_rule)


def _reduction(kind, dpos, kpos, tup):
    def rule(call: Call):
        if call.name in ("max", "min") and len(call.tensors) > 1:
            return pointwise_rule(call, linear="none")  # torch.max(a, b) is elementwise
        return reduction_rule(call, kind=kind, dim_pos=dpos, keepdim_pos=kpos, tuple_out=tup)

    rule.__name__ = f"reduction_{kind}"
    return rule


def _reshape(call: Call):
    st = _reshape_strategy(call)
    if st is not None:
        st.kernel = "reshape"
    return st


def _reshape_strategy(call: Call):
    x = call.tensors[0]
    name = call.name
    if name in ("view_as", "reshape_as", "expand_as"):
        out = call.tensors[1].shape
        st = reshape_rule(Call(name, call.args, call.kwargs, call.mesh_shape, [x]), out)
        if st is None:
            return None
        st.inputs.append(None)
        return st
    if name == "flatten":
        nd = x.ndim
        if nd == 0:
            return None
        s = call.arg(1, "start_dim", 0) % nd
        e = call.arg(2, "end_dim", -1) % nd
        mid = 1
        for k in range(s, e + 1):
            mid *= x.shape[k]
        out = x.shape[:s] + (mid,) + x.shape[e + 1 :]
    elif name == "unflatten":
        dim = call.arg(1, "dim") % x.ndim
        sizes = tuple(call.arg(2, "sizes"))
        out = x.shape[:dim] + sizes + x.shape[dim + 1 :]
        if -1 in sizes:
            known = 1
            for s in sizes:
                if s != -1:
                    known *= s
            out = (
                x.shape[:dim]
                + tuple(x.shape[dim] // known if s == -1 else s for s in sizes)
                + x.shape[dim + 1 :]
            )
    else:
        rest = call.args[1:]
        if len(rest) == 1 and isinstance(rest[0], (tuple, list)):
            rest = tuple(rest[0])
        if not rest and "size" in call.kwargs:
            rest = tuple(call.kwargs["size"])
        if not rest and "shape" in call.kwargs:
            rest = tuple(call.kwargs["shape"])
        if not all(isinstance(s, int) for s in rest):
            return None  # view(dtype) and friends
        out = tuple(rest)
        if name == "expand":
            lead = len(out) - x.ndim
            out = tuple(x.shape[k - lead] if s == -1 else s for k, s in enumerate(out))
    return reshape_rule(call, out)


def _split(call: Call):
    x = call.tensors[0]
    name = call.name
    if name == "unbind":
        dim = call.arg(1, "dim", 0)
        n = x.shape[dim]
        return split_rule(call, dim, n, drop_dim=True)
    if name == "chunk":
        dim = call.arg(2, "dim", 0)
        chunks = call.arg(1, "chunks")
        size = x.shape[dim]
        step = -(-size // chunks) if size else 0
        n = -(-size // step) if step else 0
        return split_rule(call, dim, n)
    dim = call.arg(2, "dim", 0)
    spec = call.arg(1, "split_size_or_sections", None)
    if spec is None:
        spec = call.kwargs.get(
            "split_size", call.kwargs.get("indices_or_sections", call.kwargs.get("split_sizes"))
        )
    size = x.shape[dim]
    if name == "tensor_split":
        n = spec if isinstance(spec, int) else len(spec) + 1
    elif isinstance(spec, int):
        n = -(-size // spec) if spec else 0
    else:
        n = len(spec)
    return split_rule(call, dim, n)


def _cat(call: Call):
    return cat_rule(call, call.arg(1, "dim", 0))


def _stack(call: Call):
    return stack_rule(call, call.arg(1, "dim", 0))


def _select_narrow(call: Call):
    x = call.tensors[0]
    dim = call.arg(1, "dim") % x.ndim
    st = split_rule(call, dim, 1, drop_dim=call.name == "select")
    st.output = st.output[0]
    return st


def _matmul(call: Call):
    if len(call.tensors) != 2:
        return None
    a, b = call.tensors
    if call.name == "__rmatmul__":
        a, b = b, a
    if call.name == "mm":
        la, lb, lo = "MK", "KN", "MN"
    elif call.name == "bmm":
        la, lb, lo = "BMK", "BKN", "BMN"
    else:
        labs = matmul_labels(a.shape, b.shape)
        if labs is None:
            return None
        la, lb, lo = labs
    labels = [la, lb] if call.name != "__rmatmul__" else [lb, la]
    return contraction_rule(call, labels, lo)


def _bias_labels(shape, out_labels):
    lab = ""
    for k, s in enumerate(shape):
        o = len(out_labels) - len(shape) + k
        lab += "." if s == 1 else out_labels[o]
    return lab


def _addmm(call: Call):
    if len(call.tensors) != 3:
        return None
    bias, a, b = call.tensors
    if call.name == "addmm":
        la, lb, lo = "MK", "KN", "MN"
    else:
        la, lb, lo = "BMK", "BKN", "BMN"
    return contraction_rule(call, [_bias_labels(bias.shape, lo), la, lb], lo, bias=(0,))


def _linear(call: Call):
    ts = call.tensors
    x, w = ts[0], ts[1]
    if w.ndim != 2 or x.ndim < 1:
        return None
    batch = "abcdefghij"[: x.ndim - 1]
    lx, lw, lo = batch + "K", "NK", batch + "N"
    labels = [lx, lw]
    bias = ()
    if len(ts) == 3:
        labels.append(_bias_labels(ts[2].shape, lo))
        bias = (2,)
    return contraction_rule(call, labels, lo, bias=bias)


def _loss(call: Call):
    return loss_rule(call)


_register_all()
