"""``Layout``: HyperParallel's concise description of how a tensor maps onto a device mesh.

Pure Python. A ``Layout`` names the axes of a device mesh; calling it with one entry per tensor
dimension gives a *bound* layout (a new immutable value; the original is not changed)::

    layout = Layout((2, 2), ("dp", "tp"))
    layout("dp", "None")            # dim 0 split over dp, dim 1 replicated
    layout(("dp", "tp"), "None")    # dim 0 split over dp, then each piece over tp

An entry is an alias, a tuple of aliases (split over those axes, in the order given), or
``"None"`` for a dimension that is not split. Axes no tensor dimension uses hold the tensor
replicated, or partial when named in ``partial``. ``to_placements()`` / ``from_placements()``
convert to and from the (mesh shape, placements) form DTensor uses.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

from ._placement import Partial, Placement, Replicate, Shard
from .errors import HPDTensorTypeError, LayoutError

__all__ = ["Layout"]

_NONE = "None"


def _int_tuple(values, arg: str) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise HPDTensorTypeError(
            f"Layout: {arg}={values!r} is a {type(values).__name__}: give a tuple of ints"
        )
    out = []
    for v in values:
        try:
            if isinstance(v, bool):
                raise TypeError
            out.append(operator.index(v))
        except TypeError:
            raise HPDTensorTypeError(
                f"Layout: {arg}={tuple(values)!r} holds {v!r}, a {type(v).__name__}: give ints"
            ) from None
    return tuple(out)


class Layout:
    """A named device-mesh shape, optionally bound to the dimensions of one tensor.

    Args:
        mesh_shape: size of each mesh axis, e.g. ``(2, 4)``.
        alias_names: one unique name per mesh axis, e.g. ``("dp", "tp")``. ``"None"`` is reserved.
        rank_list: the global ranks of the mesh in row-major order; ``range(prod(mesh_shape))``
            when omitted.

    Example::

        >>> lay = Layout((2, 2), ("dp", "tp"))(("dp", "tp"), "None")
        >>> lay.to_placements()
        (Shard(dim=0), Shard(dim=0))
    """

    __slots__ = ("_mesh_shape", "_alias_names", "_rank_list", "_tensor_map", "_partial", "_hash")

    def __init__(
        self,
        mesh_shape: Sequence[int],
        alias_names: Sequence[str],
        rank_list: Sequence[int] | None = None,
        *,
        tensor_map: Sequence[tuple[str, ...]] | None = None,
        partial: dict[str, str] | None = None,
    ) -> None:
        mesh_shape = _int_tuple(mesh_shape, "mesh_shape")
        if isinstance(alias_names, str):
            raise HPDTensorTypeError(
                f"Layout: alias_names={alias_names!r} is a str: give a tuple of names, one per "
                f"mesh axis, e.g. ({alias_names!r},)"
            )
        alias_names = tuple(alias_names)
        if not mesh_shape or any(s < 1 for s in mesh_shape):
            raise LayoutError(f"mesh_shape={mesh_shape}: give one positive size per mesh axis")
        if len(alias_names) != len(mesh_shape):
            raise LayoutError(
                f"alias_names={alias_names} has {len(alias_names)} names but mesh_shape="
                f"{mesh_shape} has {len(mesh_shape)} axes: give one name per axis"
            )
        for a in alias_names:
            if not isinstance(a, str) or not a or a == _NONE:
                raise LayoutError(
                    f"alias_names contains {a!r}: names are non-empty strings, not 'None'"
                )
        if len(set(alias_names)) != len(alias_names):
            raise LayoutError(f"alias_names={alias_names} repeats a name: names must be unique")
        n = math.prod(mesh_shape)
        ranks = tuple(range(n)) if rank_list is None else _int_tuple(rank_list, "rank_list")
        if len(ranks) != n or len(set(ranks)) != n:
            raise LayoutError(
                f"rank_list has {len(ranks)} entries ({len(set(ranks))} distinct) but mesh_shape="
                f"{mesh_shape} needs {n} distinct ranks"
            )
        self._mesh_shape = mesh_shape
        self._alias_names = alias_names
        self._rank_list = ranks
        self._tensor_map = None if tensor_map is None else tuple(tuple(t) for t in tensor_map)
        part = dict(partial or {})
        for a, op in part.items():
            if a not in alias_names:
                raise LayoutError(f"partial names axis {a!r}, which is not one of {alias_names}")
            Partial(op)  # validates the op name
        self._partial = tuple(sorted(part.items()))
        self._hash = hash((mesh_shape, alias_names, ranks, self._tensor_map, self._partial))

    # -- binding to a tensor -------------------------------------------------------------
    def __call__(self, *dims: str | tuple[str, ...]) -> Layout:
        """Bind to a tensor: one alias, tuple of aliases, or ``"None"`` per tensor dimension."""
        seen: dict[str, int] = {}
        tmap = []
        for i, entry in enumerate(dims):
            if not isinstance(entry, (str, tuple, list)):
                raise HPDTensorTypeError(
                    f"Layout(...)(...): tensor dim {i} is {entry!r}, a {type(entry).__name__}: "
                    f"give an alias (one of {self._alias_names}), a tuple of aliases, or 'None'"
                )
            names = (entry,) if isinstance(entry, str) else tuple(entry)
            if names == (_NONE,):
                tmap.append(())
                continue
            for name in names:
                if name == _NONE or name not in self._alias_names:
                    raise LayoutError(
                        f"tensor dim {i} uses alias {name!r}, which is not a mesh axis: use one of "
                        f"{self._alias_names} or 'None'"
                    )
                if name in seen:
                    raise LayoutError(
                        f"alias {name!r} is used by tensor dims {seen[name]} and {i}: a mesh axis "
                        f"can split at most one tensor dimension"
                    )
                seen[name] = i
            tmap.append(names)
        for a, _ in self._partial:
            if a in seen:
                raise LayoutError(f"axis {a!r} is partial and also splits tensor dim {seen[a]}")
        return Layout(
            self._mesh_shape,
            self._alias_names,
            self._rank_list,
            tensor_map=tmap,
            partial=dict(self._partial),
        )

    def with_partial(self, alias: str, reduce_op: str = "sum") -> Layout:
        """A copy whose axis ``alias`` holds partial values to be reduced with ``reduce_op``."""
        part = dict(self._partial)
        part[alias] = reduce_op
        out = Layout(self._mesh_shape, self._alias_names, self._rank_list, partial=part)
        return out if self._tensor_map is None else out(*self._entries())

    # -- properties -----------------------------------------------------------------------
    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """Size of each mesh axis."""
        return self._mesh_shape

    @property
    def alias_names(self) -> tuple[str, ...]:
        """Name of each mesh axis."""
        return self._alias_names

    @property
    def rank_list(self) -> tuple[int, ...]:
        """Global ranks of the mesh, row-major."""
        return self._rank_list

    @property
    def tensor_map(self) -> tuple[tuple[str, ...], ...] | None:
        """Per tensor dimension, the mesh axes that split it (empty tuple: not split)."""
        return self._tensor_map

    @property
    def partial(self) -> dict[str, str]:
        """Mesh axes holding partial values, with their reduce op."""
        return dict(self._partial)

    def _entries(self):
        return [(_NONE if not t else (t[0] if len(t) == 1 else t)) for t in self._tensor_map]

    def _require_bound(self) -> tuple[tuple[str, ...], ...]:
        if self._tensor_map is None:
            raise LayoutError(
                "this Layout is not bound to a tensor: call it with one alias per tensor "
                "dimension first, e.g. layout('dp', 'None')"
            )
        return self._tensor_map

    # -- conversions ----------------------------------------------------------------------
    def to_placements(self) -> tuple[Placement, ...]:
        """Placements, one per mesh axis, equivalent to this bound layout.

        A tensor dimension split over several axes must name them in mesh order (outer axis
        first), since placements split a dimension over mesh dimensions in that order.
        """
        tmap = self._require_bound()
        out: list[Placement] = [Replicate()] * len(self._mesh_shape)
        for a, op in self._partial:
            out[self._alias_names.index(a)] = Partial(op)
        for dim, names in enumerate(tmap):
            idx = [self._alias_names.index(n) for n in names]
            if idx != sorted(idx):
                ordered = tuple(sorted(names, key=self._alias_names.index))
                raise LayoutError(
                    f"tensor dim {dim} is split over {names}, not in mesh order "
                    f"{self._alias_names}: name the axes outer first, e.g. {ordered}"
                )
            for i in idx:
                out[i] = Shard(dim)
        return tuple(out)

    @classmethod
    def from_placements(
        cls,
        mesh_shape: Sequence[int],
        alias_names: Sequence[str],
        placements: Sequence[Placement],
        tensor_ndim: int,
        rank_list: Sequence[int] | None = None,
    ) -> Layout:
        """The bound layout equivalent to ``placements`` on a mesh with these axis names."""
        from ._placement import normalize_placements

        if isinstance(tensor_ndim, bool) or not isinstance(tensor_ndim, int) or tensor_ndim < 0:
            raise HPDTensorTypeError(
                f"Layout.from_placements: tensor_ndim={tensor_ndim!r} must be an int >= 0"
            )
        placements = normalize_placements(placements, len(tuple(mesh_shape)), tensor_ndim)
        tmap: list[list[str]] = [[] for _ in range(tensor_ndim)]
        partial = {}
        for name, p in zip(alias_names, placements):
            if isinstance(p, Shard):
                tmap[p.dim].append(name)
            elif isinstance(p, Partial):
                partial[name] = p.reduce_op
        return cls(mesh_shape, alias_names, rank_list, tensor_map=tmap, partial=partial)

    def to_dict(self) -> dict:
        """A JSON-ready dict; ``Layout.from_dict`` reads it back."""
        return {
            "mesh_shape": list(self._mesh_shape),
            "alias_names": list(self._alias_names),
            "rank_list": list(self._rank_list),
            "tensor_map": None if self._tensor_map is None else [list(t) for t in self._tensor_map],
            "partial": dict(self._partial),
        }

    @classmethod
    def from_dict(cls, d: dict) -> Layout:
        """Inverse of ``to_dict``."""
        return cls(
            d["mesh_shape"],
            d["alias_names"],
            d.get("rank_list"),
            tensor_map=d.get("tensor_map"),
            partial=d.get("partial"),
        )

    # -- value semantics --------------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and (
            self._mesh_shape,
            self._alias_names,
            self._rank_list,
            self._tensor_map,
            self._partial,
        ) == (
            other._mesh_shape,
            other._alias_names,
            other._rank_list,
            other._tensor_map,
            other._partial,
        )

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        s = f"Layout(mesh_shape={self._mesh_shape}, alias_names={self._alias_names}"
        if self._rank_list != tuple(range(len(self._rank_list))):
            s += f", rank_list={self._rank_list}"
        if self._tensor_map is not None:
            s += f", tensor_map={self._tensor_map}"
        if self._partial:
            s += f", partial={dict(self._partial)}"
        return s + ")"
