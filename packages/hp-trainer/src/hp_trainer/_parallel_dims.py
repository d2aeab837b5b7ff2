"""``ParallelDims``: parallelism degrees, checked before any process group exists, and the named
device meshes built from them. Degree arithmetic is pure Python."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import ConfigError

__all__ = ["ParallelDims"]

# the config keys (TOML section [parallelism]) each degree comes from, for messages
KEYS = {
    "dp_replicate": "parallelism.data_parallel_replicate_degree",
    "dp_shard": "parallelism.data_parallel_shard_degree",
    "cp": "parallelism.context_parallel_degree",
    "tp": "parallelism.tensor_parallel_degree",
    "pp": "parallelism.pipeline_parallel_degree",
    "ep": "parallelism.expert_parallel_degree",
    "etp": "parallelism.expert_tensor_parallel_degree",
}


@dataclass
class ParallelDims:
    """Degrees of data (replicate x shard), context, tensor, pipeline and expert parallelism.

    ``dp_shard=-1`` takes what the others leave of ``world_size``. Every problem is reported at
    once, one line each, naming its config key. Mesh dimensions, outermost first:
    ``pp, dp_replicate, dp_shard, cp, tp``. Expert parallelism borrows ``ep`` of the
    ``dp_shard`` ranks (the experts' mesh splits ``dp_shard`` into ``efsdp x ep``, ``ep``
    inner): each expert is sharded over the ``efsdp`` ranks by FSDP. ``etp`` is 1 (every
    tensor-parallel rank runs the experts on the same tokens) or ``tp`` (the experts' hidden
    dimension split over ``tp``). Unlike torchtitan, ``ep`` never borrows ``tp`` ranks: the MoE
    takes the whole sequence (all-gathered under sequence parallelism).
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    world_size: int = 1

    def __post_init__(self) -> None:
        problems = []
        for name in KEYS:
            v = getattr(self, name)
            if (
                isinstance(v, bool)
                or not isinstance(v, int)
                or (v < 1 and not (name == "dp_shard" and v == -1))
            ):
                problems.append(f"{KEYS[name]}={v!r}: must be a positive integer")
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int):
            problems.append(f"world_size={self.world_size!r}: must be a positive integer")
        elif self.world_size < 1:
            problems.append(f"world_size={self.world_size}: must be at least 1")
        if problems:
            raise ConfigError("\n".join(problems))
        others = self.dp_replicate * self.cp * self.tp * self.pp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ConfigError(
                    f"world size {self.world_size} is not divisible by dp_replicate x cp x tp x pp "
                    f"= {others}: change {KEYS['tp']}, {KEYS['pp']}, {KEYS['cp']} or "
                    f"{KEYS['dp_replicate']}, or the number of processes"
                )
            self.dp_shard = self.world_size // others
        product = others * self.dp_shard
        if product != self.world_size:
            problems.append(
                f"degrees multiply to {product} (dp_replicate {self.dp_replicate} x dp_shard "
                f"{self.dp_shard} x cp {self.cp} x tp {self.tp} x pp {self.pp}) but the world size "
                f"is {self.world_size}: set {KEYS['dp_shard']} = -1 to fill it"
            )
        if self.etp not in (1, self.tp):
            problems.append(f"{KEYS['etp']}={self.etp}: must be 1 or the tensor parallel degree")
        if self.ep > 1 and self.dp_shard % self.ep:
            problems.append(
                f"{KEYS['ep']}={self.ep} must divide {KEYS['dp_shard']} = {self.dp_shard} "
                f"(expert parallelism borrows data-parallel ranks)"
            )
        if self.ep > 1 and self.cp > 1:
            problems.append(f"{KEYS['ep']}={self.ep} with {KEYS['cp']}={self.cp} is not supported")
        if self.ep > 1 and self.dp_replicate > 1:
            problems.append(
                f"{KEYS['ep']}={self.ep} with {KEYS['dp_replicate']}={self.dp_replicate}: the "
                f"experts (DTensors over ep) would need fully_shard over a 2-D (dp_replicate, "
                f"efsdp) mesh, which hp_fsdp does not compose with another mesh's DTensors: set "
                f"{KEYS['dp_replicate']} = 1 and shard over every data-parallel rank instead"
            )
        elif self.dp_replicate > 1 and self.tp > 1:
            problems.append(
                f"{KEYS['dp_replicate']}={self.dp_replicate} with {KEYS['tp']}={self.tp}: "
                f"replicated or HSDP parameters would need fully_shard over a 2-D (dp_replicate, "
                f"dp_shard) mesh, which hp_fsdp does not compose with tensor parallelism's "
                f"DTensors: set {KEYS['dp_replicate']} = 1 and {KEYS['dp_shard']} = "
                f"{self.dp_replicate * self.dp_shard} (shard over "
                f"every data-parallel rank)"
            )
        elif self.ep > 1 and self.etp > 1 and self.dp_shard != self.ep:
            problems.append(
                f"{KEYS['etp']}={self.etp} with {KEYS['ep']}={self.ep} shards each expert over "
                f"ep x tp already: give {KEYS['dp_shard']} = {KEYS['ep']} "
                f"(fully_shard does not shard 2-D expert meshes further)"
            )
        if problems:
            raise ConfigError("\n".join(problems))

    @property
    def dp(self) -> int:
        """Data-parallel degree (replicate x shard): how many different batches are processed."""
        return self.dp_replicate * self.dp_shard

    def check_model(
        self,
        *,
        n_heads: int,
        n_kv_heads: int,
        n_layers: int,
        ffn_hidden: int | None = None,
        num_experts: int | None = None,
        expert_hidden: int | None = None,
        linear_heads: tuple[int, int] | None = None,
        global_batch_size: int | None = None,
        seq_len: int | None = None,
        stages_per_rank: int = 1,
        mtp_layers: int = 0,
        cp_load_balance: bool = True,
        conv_kernel: int | None = None,
    ) -> None:
        """Raise one :class:`ConfigError` listing every way the model, batch or sequence does not
        fit these degrees."""
        problems = []
        if mtp_layers and self.pp > 1:
            problems.append(
                f"{KEYS['pp']}={self.pp}: the model's {mtp_layers} multi-token prediction "
                "module(s) need the embedding and the output head on one stage: set it to 1, "
                "or model.mtp_layers = 0"
            )
        if mtp_layers and self.tp > 1:
            problems.append(
                f"{KEYS['tp']}={self.tp}: multi-token prediction is not supported with "
                "tensor parallelism yet (each depth shifts the whole sequence by one token, "
                "which its sequence shards cannot do in place): set it to 1, or "
                "model.mtp_layers = 0"
            )
        tp = KEYS["tp"]
        if n_heads % self.tp:
            problems.append(f"{tp}={self.tp} does not divide the model's {n_heads} attention heads")
        if n_kv_heads % self.tp:
            problems.append(
                f"{tp}={self.tp} does not divide the model's {n_kv_heads} key/value heads"
            )
        if linear_heads is not None:  # Gated DeltaNet (key heads, value heads)
            for what, n in zip(("key", "value"), linear_heads):
                if n % self.tp:
                    problems.append(
                        f"{tp}={self.tp} does not divide the model's {n} linear-attention "
                        f"{what} heads"
                    )
        if ffn_hidden is not None and ffn_hidden % self.tp:
            problems.append(f"{tp}={self.tp} does not divide the feed-forward width {ffn_hidden}")
        if self.pp * stages_per_rank > n_layers:
            problems.append(
                f"{KEYS['pp']}={self.pp} x {stages_per_rank} stage(s) per rank exceeds the "
                f"model's {n_layers} layers"
            )
        if self.ep > 1 and num_experts is None:
            problems.append(f"{KEYS['ep']}={self.ep}: the model has no MoE layers to split")
        if num_experts is not None and self.ep > 1 and num_experts % self.ep:
            problems.append(f"{KEYS['ep']}={self.ep} does not divide the {num_experts} experts")
        if expert_hidden is not None and self.etp > 1 and expert_hidden % self.etp:
            problems.append(
                f"{KEYS['etp']}={self.etp} does not divide the experts' hidden width "
                f"{expert_hidden}"
            )
        if global_batch_size is not None and global_batch_size % self.dp:
            problems.append(
                f"training.global_batch_size={global_batch_size} is not divisible by the data "
                f"parallel degree {self.dp}"
            )
        chunks = (2 if cp_load_balance else 1) * self.cp
        if seq_len is not None and self.cp > 1 and seq_len % chunks:
            how = f"2 x {KEYS['cp']}" if cp_load_balance else KEYS["cp"]
            problems.append(f"training.seq_len={seq_len} must be divisible by {how} = {chunks}")
        if conv_kernel and linear_heads is not None and self.cp > 1 and seq_len is not None:
            piece = seq_len // chunks
            if piece < conv_kernel - 1:
                problems.append(
                    f"{KEYS['cp']}={self.cp}: each rank's pieces of the sequence are {piece} "
                    f"tokens, shorter than the linear attention's {conv_kernel - 1}-token "
                    "convolution halo: use longer sequences or a lower degree"
                )
        if mtp_layers and self.cp > 1:
            problems.append(
                f"{KEYS['cp']}={self.cp}: multi-token prediction shifts whole sequences, which "
                "context parallelism splits (not supported yet): set it to 1, or "
                "model.mtp_layers = 0"
            )

        if problems:
            raise ConfigError("\n".join(problems))

    def mesh_shape(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The world mesh's shape and dimension names (dimensions of degree 1 left out; a
        1-D ``("dp_shard",)`` mesh when every degree is 1). ``dp_shard`` of 1 is kept beside a
        ``dp_replicate`` > 1 with nothing else to shard over (``cp`` 1): FSDP then gets its 2-D
        ``(dp_replicate, dp_shard)`` mesh, whole parameters on every rank and gradients
        all-reduced, as torchtitan's data-parallel replication (it would otherwise shard over
        the replicate dimension)."""
        keep = {"dp_shard"} if self.dp_replicate > 1 and self.cp == 1 else set()
        dims = [(n, getattr(self, n)) for n in ("pp", "dp_replicate", "dp_shard", "cp", "tp")]
        dims = [(n, d) for n, d in dims if d > 1 or n in keep] or [("dp_shard", 1)]
        return tuple(d for _, d in dims), tuple(n for n, _ in dims)

    def expert_mesh_shape(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The experts' mesh: the world mesh with ``dp_shard`` split into ``efsdp x ep``
        (``ep`` inner; both kept even when 1)."""
        dims = [
            ("pp", self.pp),
            ("dp_replicate", self.dp_replicate),
            ("efsdp", self.dp_shard // self.ep),
            ("ep", self.ep),
            ("tp", self.tp),
        ]
        dims = [(n, d) for n, d in dims if d > 1 or n in ("efsdp", "ep")]
        return tuple(d for _, d in dims), tuple(n for n, _ in dims)

    def build_expert_mesh(self, device_type: str = "cpu"):
        """The experts' ``DeviceMesh`` over the same ranks as :meth:`build_mesh`'s (see
        :meth:`expert_mesh_shape`); None without expert parallelism."""
        if self.ep == 1:
            return None
        import hp_dtensor as hp

        shape, names = self.expert_mesh_shape()
        return hp.init_device_mesh(device_type, shape, mesh_dim_names=names)

    def build_mesh(self, device_type: str = "cpu"):
        """The world ``DeviceMesh`` with named dimensions plus flattened ``dp`` (dp_replicate x
        dp_shard), ``dp_shard_cp`` (what FSDP shards over) and ``dp_cp`` (where losses are
        averaged) where those have more than one dimension. Needs the default process group."""
        import hp_dtensor as hp

        shape, names = self.mesh_shape()
        if math.prod(shape) != self.world_size:
            raise ConfigError(f"mesh {shape} does not cover world size {self.world_size}")
        mesh = hp.init_device_mesh(device_type, shape, mesh_dim_names=names)
        for flat, parts in (
            ("dp", ("dp_replicate", "dp_shard")),
            ("dp_shard_cp", ("dp_shard", "cp")),
            ("dp_cp", ("dp_replicate", "dp_shard", "cp")),
        ):
            present = tuple(p for p in parts if p in names)
            if len(present) > 1:
                mesh[present].flatten(flat)
        return mesh
