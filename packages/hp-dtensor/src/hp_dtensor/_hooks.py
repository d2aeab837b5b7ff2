"""Forward hooks that lay a module's inputs and outputs out, for either framework.

``PrepareModuleInput`` / ``PrepareModuleOutput`` and ``shard_module``'s ``"forward"`` plan build
their hooks here, from a ``convert`` (or ``to_layout``) function that the caller supplies for its
framework's tensors: the torch front ends pass DTensor conversions, the MindSpore binding passes
``MSDTensor`` ones. Pure Python over the style's or plan's layouts: no framework is imported, so
the bindings can use these hooks without importing the front ends that call them.
"""

from __future__ import annotations

from .errors import LayoutError

__all__ = ["as_tuple", "check_len", "forward_hooks", "input_hook", "output_hook"]


def as_tuple(x):
    """``x`` as a tuple: None stays None, a tuple or list is converted, one value is wrapped."""
    if x is None:
        return None
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def check_len(values, layouts, arg):
    """``layouts`` (None: anything goes) must give one entry per value."""
    if layouts is not None and len(layouts) != len(values):
        raise LayoutError(
            f"{arg} has {len(layouts)} entries for {len(values)} values: give one (or None) each"
        )


def input_hook(style, convert):
    """``PrepareModuleInput``'s forward pre-hook (with keyword inputs), for either framework:
    ``convert(value, layout, desired)`` handles one annotated input."""
    ins = as_tuple(style.input_layouts) or ()
    des = as_tuple(style.desired_input_layouts) or (None,) * len(ins)
    kw_in = dict(style.input_kwarg_layouts or {})
    kw_des = dict(style.desired_input_kwarg_layouts or {})

    def pre(mod, args, kwargs):
        new_args = tuple(
            convert(a, ins[i], des[i]) if i < len(ins) else a for i, a in enumerate(args)
        )
        new_kwargs = {
            k: convert(v, kw_in.get(k), kw_des.get(k)) if k in kw_in else v
            for k, v in kwargs.items()
        }
        return new_args, new_kwargs

    return pre


def output_hook(style, convert):
    """``PrepareModuleOutput``'s forward hook, for either framework: ``convert(value, layout,
    desired)`` handles one annotated output (and leaves non-tensors alone)."""
    outs = as_tuple(style.output_layouts) or ()
    des = as_tuple(style.desired_output_layouts) or (None,) * len(outs)

    def post(mod, inputs, out):
        single = not isinstance(out, tuple)
        items = (out,) if single else out
        res = [convert(o, outs[i], des[i]) if i < len(outs) else o for i, o in enumerate(items)]
        return res[0] if single else tuple(res)

    return post


def forward_hooks(fwd: dict, to_layout, to_local):
    """The forward pre-hook and hook (None where the plan needs none) of a ``shard_module``
    plan's ``"forward"`` entry, for either framework: ``to_layout(value, layout, arg)`` lays
    one input or output out, ``to_local(value)`` unwraps a DTensor for ``use_local_output``."""
    in_layouts = fwd.get("input")
    out_layouts = fwd.get("output")
    use_local = bool(fwd.get("use_local_output", False))
    pre = post = None
    if in_layouts is not None:
        ins = tuple(in_layouts)

        def pre(mod, args):
            check_len(args[: len(ins)], ins, "forward input layouts")
            return tuple(
                to_layout(a, ins[i], f"forward input {i}") if i < len(ins) else a
                for i, a in enumerate(args)
            )

    if out_layouts is not None or use_local:
        outs = tuple(out_layouts) if out_layouts is not None else None

        def post(mod, args, out):
            single = not isinstance(out, tuple)
            items = (out,) if single else out
            res = []
            for i, o in enumerate(items):
                lay = outs[i] if outs is not None and i < len(outs) else None
                o = to_layout(o, lay, f"forward output {i}")
                res.append(to_local(o) if use_local else o)
            return res[0] if single else tuple(res)

    return pre, post
