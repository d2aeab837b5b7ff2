"""``DeviceMesh``: an n-dimensional grid of ranks with named dimensions and cached groups."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from . import _groups
from ._backend import get_platform
from .errors import HPDTensorTypeError, MeshError

__all__ = ["DeviceMesh", "init_device_mesh", "mesh_from_layout"]


def _flatten_nested(mesh) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, row-major ranks) of a nested list / tensor / array of ranks."""
    if hasattr(mesh, "tolist"):
        mesh = mesh.tolist()
    if isinstance(mesh, int):
        return (), (mesh,)
    shape: list[int] = []
    level = mesh
    while isinstance(level, (list, tuple)):
        shape.append(len(level))
        if not level:
            break
        level = level[0]
    ranks: list[int] = []

    def walk(x, depth):
        if depth == len(shape):
            if isinstance(x, bool) or not isinstance(x, int):
                raise HPDTensorTypeError(
                    f"mesh={mesh!r} holds {x!r}, a {type(x).__name__}: give a nested list of int "
                    "global ranks, e.g. [[0, 1], [2, 3]]"
                )
            ranks.append(x)
            return
        if not isinstance(x, (list, tuple)) or len(x) != shape[depth]:
            raise MeshError(f"mesh={mesh!r} is ragged: give a rectangular nested list of ranks")
        for y in x:
            walk(y, depth + 1)

    walk(mesh, 0)
    return tuple(shape), tuple(ranks)


def _check_device_type(device_type, fn: str) -> None:
    if not isinstance(device_type, str):
        raise HPDTensorTypeError(
            f"{fn}: device_type={device_type!r} is a {type(device_type).__name__}: give the "
            "device type as a str, e.g. 'cpu', 'cuda' or 'npu'"
        )


def _check_names(names, fn: str) -> None:
    if names is None:
        return
    if isinstance(names, str):
        raise HPDTensorTypeError(
            f"{fn}: mesh_dim_names={names!r} is a str: give a tuple of names, one per mesh "
            f"dimension, e.g. ({names!r},)"
        )
    for n in names:
        if not isinstance(n, str):
            raise HPDTensorTypeError(
                f"{fn}: mesh_dim_names={tuple(names)!r} holds {n!r}, a {type(n).__name__}: "
                "names are strs"
            )


class DeviceMesh:
    """An n-dimensional grid of global ranks on one device type, with optional dimension names.

    Every process that belongs to the mesh must build it the same way; the process groups of
    each mesh dimension are created once, when the mesh is built, and cached.

    Args:
        device_type: ``"cpu"``, ``"cuda"`` or ``"npu"``.
        mesh: nested list (or tensor) of global ranks, e.g. ``[[0, 1], [2, 3]]``.
        mesh_dim_names: one unique name per mesh dimension, e.g. ``("dp", "tp")``.

    Example::

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        tp = mesh["tp"]                        # 1-D sub-mesh along tp holding this rank
        dp_cp = mesh["dp", "tp"].flatten("dp_tp")
    """

    __slots__ = (
        "device_type",
        "_shape",
        "_ranks",
        "_names",
        "_coord",
        "_groups",
        "_hash",
        "_root",
        "_root_dims",
        "_flat",
        "_children",
        "_device",
        "_framework",
        "__weakref__",
    )

    def __init__(
        self,
        device_type: str,
        mesh: Any,
        *,
        mesh_dim_names: Sequence[str] | None = None,
    ) -> None:
        _check_device_type(device_type, "DeviceMesh")
        _check_names(mesh_dim_names, "DeviceMesh")
        shape, ranks = _flatten_nested(mesh)
        if 0 in shape:
            raise MeshError(f"mesh={mesh!r} has a dimension of size 0: give at least one rank")
        self._setup(device_type, shape, ranks, mesh_dim_names, root=None, root_dims=None)
        platform = get_platform(device_type)
        if platform.is_initialized():  # the same answer on every rank, before any group exists
            world = platform.get_world_size()
            bad = [r for r in self._ranks if not 0 <= r < world]
            if bad:
                raise MeshError(
                    f"mesh ranks {bad} are not ranks of the default group (world size {world}): "
                    f"give global ranks in [0, {world})"
                )
        self._create_groups()

    # -- construction ----------------------------------------------------------------------
    def _setup(self, device_type, shape, ranks, names, *, root, root_dims):
        if not shape:
            raise MeshError("mesh has no dimensions: give at least a 1-D list of ranks")
        if len(set(ranks)) != len(ranks):
            raise MeshError(f"mesh ranks {list(ranks)} repeat a rank: every rank appears once")
        if names is not None:
            names = tuple(names)
            if len(names) != len(shape):
                raise MeshError(
                    f"mesh_dim_names={names} has {len(names)} names for a mesh of shape "
                    f"{shape}: give one name per mesh dimension"
                )
            if len(set(names)) != len(names):
                raise MeshError(f"mesh_dim_names={names} repeats a name: names must be unique")
        self.device_type = device_type
        self._shape = tuple(shape)
        self._ranks = tuple(ranks)
        self._names = names
        platform = get_platform(device_type)
        self._framework = getattr(platform, "framework", "torch")  # plugins: torch unless said
        me = platform.get_rank()
        if me in self._ranks:
            idx = self._ranks.index(me)
            coord = []
            for s in reversed(self._shape):
                coord.append(idx % s)
                idx //= s
            self._coord = tuple(reversed(coord))
        else:
            self._coord = None
        self._groups: list[Any] = [None] * len(shape)
        self._hash = hash((device_type, self._shape, self._ranks, self._names, self._framework))
        self._root = root if root is not None else self
        self._root_dims = (
            root_dims if root_dims is not None else tuple((d,) for d in range(len(shape)))
        )
        self._flat: dict[str, tuple[int, ...]] = {}
        self._children: dict[Any, DeviceMesh] = {}
        self._device = None

    def _line(self, d: int) -> list[int]:
        """Ranks that share this rank's coordinates on every mesh dimension but ``d``."""
        coord = list(self._coord)
        out = []
        for i in range(self._shape[d]):
            coord[d] = i
            idx = 0
            for c, s in zip(coord, self._shape):
                idx = idx * s + c
            out.append(self._ranks[idx])
        return out

    def _create_groups(self) -> None:
        if self._coord is None:
            return
        for d in range(len(self._shape)):
            self._groups[d] = _groups.new_group(self._line(d))

    @classmethod
    def _derived(cls, parent, shape, ranks, names, root_dims, groups) -> DeviceMesh:
        m = cls.__new__(cls)
        m._setup(parent.device_type, shape, ranks, names, root=parent._root, root_dims=root_dims)
        m._device = parent._device
        for d, g in enumerate(groups):
            m._groups[d] = (
                g
                if g is not None
                else (_groups.new_group(m._line(d)) if m._coord is not None else None)
            )
        return m

    @property
    def framework(self) -> str:
        """The framework whose tensors this mesh holds (``"torch"`` or ``"mindspore"``): the
        backend chosen when it was built. A mesh serves one framework."""
        return self._framework

    # -- sub-meshes and flattening ----------------------------------------------------------
    def _dim(self, mesh_dim: int | str) -> int:
        if isinstance(mesh_dim, str):
            if self._names is None or mesh_dim not in self._names:
                raise MeshError(
                    f"mesh_dim={mesh_dim!r} is not a dimension of this mesh: its dimensions are "
                    f"{self._names}"
                )
            return self._names.index(mesh_dim)
        if isinstance(mesh_dim, int) and -len(self._shape) <= mesh_dim < len(self._shape):
            return mesh_dim % len(self._shape)
        raise MeshError(
            f"mesh_dim={mesh_dim!r} is out of range for a mesh of {len(self._shape)} dimension(s)"
        )

    def __getitem__(self, names: str | Sequence[str]) -> DeviceMesh:
        """The sub-mesh along the named dimensions that holds this rank."""
        if isinstance(names, str):
            key = (names,)
        elif isinstance(names, (tuple, list)):
            key = tuple(names)
        else:
            raise HPDTensorTypeError(
                f"mesh[{names!r}]: mesh dims are selected by name, e.g. mesh['dp'] or "
                f"mesh['dp', 'tp']; this mesh's names are {self._names}"
            )
        cached = self._children.get(key)
        if cached is not None:
            return cached
        if self._coord is None:
            raise MeshError("this rank is not in the mesh: it has no sub-mesh")
        root = self._root
        if self is not root:
            # Resolve through the root so flattened names registered there are found.
            if self._names is None or not all(n in self._names for n in key):
                raise MeshError(
                    f"mesh dims {key} are not all dimensions of this mesh ({self._names})"
                )
            sub = root[tuple(key)]
            self._children[key] = sub
            return sub
        root_dims: list[tuple[int, ...]] = []
        for n in key:
            if not isinstance(n, str):
                raise MeshError(f"mesh dims are selected by name, got {n!r}")
            if self._names is not None and n in self._names:
                root_dims.append((self._names.index(n),))
            elif n in self._flat:
                root_dims.append(self._flat[n])
            else:
                raise MeshError(
                    f"mesh dim {n!r} does not exist: the mesh has {self._names}"
                    + (f" and flattened {tuple(self._flat)}" if self._flat else "")
                )
        flat_dims = [d for group in root_dims for d in group]
        if flat_dims != sorted(flat_dims) or len(set(flat_dims)) != len(flat_dims):
            raise MeshError(f"mesh dims {key} must be distinct and in mesh order {self._names}")
        shape = tuple(math.prod(self._shape[d] for d in g) for g in root_dims)
        # ranks: iterate the selected root dims row-major, others fixed at this rank's coordinate
        ranks = []
        sel_shape = [self._shape[d] for d in flat_dims]
        for idx in range(math.prod(sel_shape)):
            coord = list(self._coord)
            rem = idx
            for d, s in reversed(list(zip(flat_dims, sel_shape))):
                coord[d] = rem % s
                rem //= s
            lin = 0
            for c, s in zip(coord, self._shape):
                lin = lin * s + c
            ranks.append(self._ranks[lin])
        groups = [self._groups[g[0]] if len(g) == 1 else None for g in root_dims]
        sub = DeviceMesh._derived(self, shape, ranks, key, tuple(root_dims), groups)
        self._children[key] = sub
        return sub

    def flatten(self, mesh_dim_name: str | None = None) -> DeviceMesh:
        """This mesh as one dimension (row-major), registered on the root mesh by name.

        ``mesh["dp", "cp"].flatten("dp_cp")`` makes ``mesh["dp_cp"]`` available afterwards.
        """
        if mesh_dim_name is not None and not isinstance(mesh_dim_name, str):
            raise HPDTensorTypeError(
                f"flatten: mesh_dim_name={mesh_dim_name!r} is a {type(mesh_dim_name).__name__}: "
                "give the new dimension's name as a str (or None)"
            )
        names = self._names or tuple(str(d) for d in range(self.ndim))
        name = mesh_dim_name or "_".join(names)
        root = self._root
        dims = tuple(d for g in self._root_dims for d in g)
        existing = root._flat.get(name)
        if existing is not None and existing != dims:
            raise MeshError(f"mesh_dim_name={name!r} is already used for root dims {existing}")
        if root._names is not None and name in root._names:
            raise MeshError(f"mesh_dim_name={name!r} is already a dimension of the mesh")
        root._flat[name] = dims
        if len(self._shape) == 1 and self._names == (name,):
            return self
        return root[name] if self._coord is not None else self

    # -- queries ------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        """Size of each mesh dimension."""
        return self._shape

    @property
    def ndim(self) -> int:
        """Number of mesh dimensions."""
        return len(self._shape)

    @property
    def mesh_dim_names(self) -> tuple[str, ...] | None:
        """Names of the mesh dimensions, or None."""
        return self._names

    @property
    def rank_list(self) -> tuple[int, ...]:
        """Global ranks of the mesh, row-major."""
        return self._ranks

    @property
    def mesh(self):
        """The ranks as a tensor of the mesh's shape (torch's ``DeviceMesh.mesh``)."""
        import torch

        return torch.tensor(self._ranks, dtype=torch.int64).reshape(self._shape)

    @property
    def device(self):
        """The device this rank's local tensors live on."""
        if self._device is None:
            self._device = get_platform(self.device_type).device_for_rank(self.device_type)
        return self._device

    def size(self, mesh_dim: int | str | None = None) -> int:
        """Number of ranks in the mesh, or along ``mesh_dim``."""
        return len(self._ranks) if mesh_dim is None else self._shape[self._dim(mesh_dim)]

    def get_coordinate(self) -> tuple[int, ...] | None:
        """This rank's coordinate, or None when it is not in the mesh."""
        return self._coord

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        """This rank's index along ``mesh_dim`` (required for meshes of more than one dim)."""
        if mesh_dim is None:
            if self.ndim != 1:
                raise MeshError(f"mesh_dim is required for a {self.ndim}-D mesh: name a dimension")
            mesh_dim = 0
        if self._coord is None:
            raise MeshError("this rank is not in the mesh")
        return self._coord[self._dim(mesh_dim)]

    def get_rank(self) -> int:
        """This process's global rank."""
        return get_platform(self.device_type).get_rank()

    def get_group(self, mesh_dim: int | str | None = None) -> Any:
        """The process group along ``mesh_dim`` that holds this rank."""
        if mesh_dim is None:
            if self.ndim != 1:
                raise MeshError(f"mesh_dim is required for a {self.ndim}-D mesh: name a dimension")
            mesh_dim = 0
        return self._groups[self._dim(mesh_dim)]

    def get_all_groups(self) -> list[Any]:
        """The process groups of every mesh dimension, in order."""
        return list(self._groups)

    # -- value semantics ------------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        return (
            isinstance(other, DeviceMesh)
            and self._hash == other._hash
            and (self.device_type, self._shape, self._ranks, self._names, self._framework)
            == (other.device_type, other._shape, other._ranks, other._names, other._framework)
        )

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        names = f", mesh_dim_names={self._names}" if self._names else ""
        ranks = list(self._ranks)
        return f"DeviceMesh({self.device_type!r}, shape={self._shape}, ranks={ranks}{names})"

    def __reduce__(self):
        raise TypeError("a DeviceMesh holds process groups and cannot be pickled")


def init_device_mesh(
    device_type: str,
    mesh_shape: Sequence[int],
    *,
    mesh_dim_names: Sequence[str] | None = None,
) -> DeviceMesh:
    """A mesh of all ranks in row-major order; joins the default group first if needed.

    Raises ``MeshError`` before any collective when ``mesh_shape`` does not multiply to the world
    size or the names do not fit.

    Example::

        mesh = init_device_mesh("cuda", (2, 4), mesh_dim_names=("dp", "tp"))
    """
    _check_device_type(device_type, "init_device_mesh")
    if isinstance(mesh_shape, (str, bytes)) or not hasattr(mesh_shape, "__iter__"):
        raise HPDTensorTypeError(
            f"init_device_mesh: mesh_shape={mesh_shape!r} is a {type(mesh_shape).__name__}: give "
            "a tuple of sizes, one per mesh dimension, e.g. (8,) or (2, 4)"
        )
    mesh_shape = tuple(mesh_shape)
    if not mesh_shape or any(
        isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in mesh_shape
    ):
        raise MeshError(f"mesh_shape={mesh_shape}: give one positive int per mesh dimension")
    _check_names(mesh_dim_names, "init_device_mesh")
    _groups.init_process_group(device_type=device_type)
    platform = get_platform(device_type)
    world = platform.get_world_size()
    if math.prod(mesh_shape) != world:
        raise MeshError(
            f"mesh_shape={mesh_shape} holds {math.prod(mesh_shape)} ranks but the world has "
            f"{world}: choose sizes whose product is {world}"
        )
    if mesh_dim_names is not None and len(tuple(mesh_dim_names)) != len(mesh_shape):
        raise MeshError(
            f"mesh_dim_names={tuple(mesh_dim_names)} has {len(tuple(mesh_dim_names))} names for "
            f"mesh_shape={mesh_shape}: give one name per dimension"
        )
    nested: Any = list(range(world))
    for s in reversed(mesh_shape[1:]):
        nested = [nested[i : i + s] for i in range(0, len(nested), s)]
    return DeviceMesh(device_type, nested, mesh_dim_names=mesh_dim_names)


def mesh_from_layout(layout, device_type: str = "cpu") -> DeviceMesh:
    """The ``DeviceMesh`` a ``Layout`` describes (its axes named by the layout's aliases).

    Meshes over the same ranks share their process groups, so calling this twice is cheap.
    """
    from ._layout import Layout

    if not isinstance(layout, Layout):
        raise HPDTensorTypeError(
            f"mesh_from_layout: layout={layout!r} is a {type(layout).__name__}, not a Layout: "
            "give e.g. Layout((2, 2), ('dp', 'tp'))"
        )
    _check_device_type(device_type, "mesh_from_layout")
    shape = layout.mesh_shape
    nested: Any = list(layout.rank_list)
    for s in reversed(shape[1:]):
        nested = [nested[i : i + s] for i in range(0, len(nested), s)]
    return DeviceMesh(device_type, nested, mesh_dim_names=layout.alias_names)
