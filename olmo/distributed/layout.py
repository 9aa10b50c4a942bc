"""The run's parallel layout (:class:`ParallelLayout`): built once from the config's parallel sections and the launch,
it is the one place that knows how the ranks are arranged. Every other module asks it: which instances a rank reads,
which ranks share a sequence or a layer's matrices, and the device meshes of every parallelism.

The ranks, outermost first (rank ``r``, ``P`` = ``pipeline_parallel.degree``, ``C`` = ``context_parallel.degree``,
``T`` = ``tensor_parallel.degree``, ``S = W / P`` the ranks of one pipeline stage):

- **pipeline parallel**: ``r // S``, of ``P``: which stage of the model's layers the rank holds (1: every layer);
- **data parallel**: ``(r % S) // (C * T)``, of ``S / (C * T)``: which share of each batch's instances the rank reads
  (the data order, ``global_indices.npy`` and each step's batch are those of a run on that many ranks);
- **context parallel**: ``(r // T) % C``: the rank's place among the ``C`` ranks that share each instance's tokens;
- **tensor parallel**: ``r % T``: the rank's share of each block's heads and hidden units.

The meshes, each made on first use (every rank asks for them at the same points of the launch, as collectives
require) and kept for the rest of the process:

- :attr:`ParallelLayout.model_mesh`: FSDP2's, over every rank but the tensor-parallel ones (a context-parallel
  group's ranks shard the model like any other ranks), ``("shard",)`` or ``("replicate", "shard")`` for hybrid
  sharding, DDP and ``NO_SHARD``, then ``"tp"`` when ``T > 1``;
- :attr:`ParallelLayout.data_mesh`: ``("dp", "cp")``, then ``"tp"``: its ``cp`` dimension is the group of
  :attr:`ParallelLayout.context_parallel`;
- :attr:`ParallelLayout.expert_mesh`: ``("ep", "ep_dp")`` of shape ``(E, W / E)`` for ``expert_parallel.degree``
  ``E`` (:mod:`olmo.distributed.expert_parallel`).

``scripts/plan.py`` sizes the same object for a cluster it has not launched on (:meth:`ParallelLayout.from_sections`
without a process group: the arithmetic only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Optional

from ..config import DistributedStrategy, FSDPConfig, ShardingStrategy
from ..exceptions import OLMoConfigurationError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from ..config import (
        ContextParallelConfig,
        ExpertParallelConfig,
        PipelineParallelConfig,
        TensorParallelConfig,
        TrainConfig,
    )
    from .collectives import DistEnv
    from .context_parallel import ContextParallel

__all__ = ["ParallelLayout"]

_REPLICATED = (ShardingStrategy.NO_SHARD,)
_HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)


def _degree(section: Any) -> int:
    """A section's ``degree`` (1 without the section; a bad value, which validation reports first, counts as 1)."""
    d = getattr(section, "degree", 1)
    return d if isinstance(d, int) and not isinstance(d, bool) and d >= 1 else 1


@dataclass(frozen=True)
class ParallelLayout:
    """How the run's ``world_size`` ranks are arranged, and the meshes and groups of that arrangement."""

    world_size: int = 1
    rank: int = 0
    """This process's rank (0 for a layout sized without a launch)."""
    replicate: int = 0
    """Model replicas FSDP all-reduces gradients over (DDP, ``NO_SHARD``, hybrid sharding); 0: fully sharded, the
    mesh has no ``replicate`` dimension."""
    context: int = 1
    """``context_parallel.degree``: ranks sharing each instance's tokens."""
    tensor: int = 1
    """``tensor_parallel.degree``: ranks sharing each block's matrices."""
    expert: int = 1
    """``expert_parallel.degree``: ranks sharing each mixture-of-experts layer's experts."""
    pipeline: int = 1
    """``pipeline_parallel.degree``: groups of ranks each holding a stage of the layers (the outermost dimension)."""
    device_type: str = "cpu"
    env: Optional[DistEnv] = field(default=None, compare=False, repr=False)
    """The launch this layout is of (None: sized for a cluster, without a process group)."""

    @classmethod
    def from_sections(
        cls,
        world_size: int,
        rank: int = 0,
        *,
        local_world_size: Optional[int] = None,
        device_type: str = "cpu",
        distributed_strategy: Optional[str] = None,
        fsdp: Optional[FSDPConfig] = None,
        context_parallel: Optional[ContextParallelConfig] = None,
        tensor_parallel: Optional[TensorParallelConfig] = None,
        expert_parallel: Optional[ExpertParallelConfig] = None,
        pipeline_parallel: Optional[PipelineParallelConfig] = None,
        env: Optional[DistEnv] = None,
    ) -> ParallelLayout:
        """The layout of ``world_size`` ranks (``local_world_size`` per node; None: one node) under these sections;
        ``env``: the launch (its process group makes the meshes), whose world size, rank and device it takes.

        :raises OLMoConfigurationError: when the tensor-parallel degree or the hybrid replicas do not divide the ranks
            (validation refuses such a launch earlier; tools that skip it get the same sentence).
        """
        if env is not None:
            world_size, rank, device_type = env.world_size, env.rank, env.device.type
            local_world_size = env.local_world_size
        tp, cp, pp = _degree(tensor_parallel), _degree(context_parallel), _degree(pipeline_parallel)
        if world_size == 1:  # one process shares nothing (a checkpoint evaluated or converted alone)
            tp = cp = pp = 1
        if world_size % (tp * pp):
            both = f" x pipeline_parallel.degree={pp}" if pp > 1 else ""
            raise OLMoConfigurationError(
                f"tensor_parallel.degree={tp}{both} must divide the number of processes ({world_size})."
            )
        data_parallel = world_size // (tp * pp)  # FSDP's ranks: a stage's, but the tensor-parallel ones
        fsdp = fsdp or FSDPConfig()
        replicate = 0
        if world_size == 1:
            pass
        elif distributed_strategy == DistributedStrategy.ddp or fsdp.sharding_strategy in _REPLICATED:
            replicate = data_parallel
        elif fsdp.sharding_strategy in _HYBRID:
            local = local_world_size or world_size
            replicate = fsdp.hybrid_sharding_num_model_replicas or max(1, world_size // pp // local)
            if data_parallel % replicate != 0:
                raise OLMoConfigurationError(
                    f"fsdp.hybrid_sharding_num_model_replicas={replicate} must divide the data-parallel ranks "
                    f"({data_parallel}: the world size {world_size} over tensor_parallel.degree={tp})."
                )
        return cls(world_size, rank, replicate, cp, tp, _degree(expert_parallel), pp, device_type, env)

    @classmethod
    def of_run(
        cls,
        cfg: TrainConfig,
        env: Optional[DistEnv] = None,
        world_size: int = 1,
        rank: int = 0,
        local_world_size: Optional[int] = None,
    ) -> ParallelLayout:
        """The layout of a run's config on the launched processes of ``env`` (without one: ``world_size`` ranks,
        ``local_world_size`` per node, seen from ``rank``, before any process group exists or for a cluster)."""
        return cls.from_sections(
            world_size,
            rank,
            local_world_size=local_world_size,
            env=env,
            distributed_strategy=cfg.distributed_strategy,
            fsdp=cfg.fsdp,
            context_parallel=cfg.context_parallel,
            tensor_parallel=cfg.tensor_parallel,
            expert_parallel=cfg.expert_parallel,
            pipeline_parallel=cfg.pipeline_parallel,
        )

    @classmethod
    def single(cls, env: DistEnv) -> ParallelLayout:
        """One process (``env``'s), nothing shared."""
        assert env.world_size == 1, env
        return cls(device_type=env.device.type, env=env)

    @property
    def launch(self) -> DistEnv:
        """The launch this layout is of (a layout sized for a cluster has none)."""
        if self.env is None:
            raise RuntimeError(
                "a layout sized without a launch (ParallelLayout.from_sections without env) has no process group"
            )
        return self.env

    # The arithmetic: what each rank reads and where it sits.

    @property
    def stage_size(self) -> int:
        """Ranks of one pipeline stage (every rank without pipeline parallelism)."""
        return max(1, self.world_size // self.pipeline)

    @property
    def pipeline_rank(self) -> int:
        """The pipeline stage this rank holds (0 without pipeline parallelism)."""
        return self.rank // self.stage_size

    @property
    def data_parallel_size(self) -> int:
        """Ranks that read different instances."""
        return max(1, self.stage_size // (self.context * self.tensor))

    def data_parallel_rank_of(self, rank: int) -> int:
        """Which share of each batch's instances the process of ``rank`` reads."""
        return (rank % self.stage_size) // (self.context * self.tensor)

    @property
    def data_parallel_rank(self) -> int:
        """Which share of each batch's instances this process reads."""
        return self.data_parallel_rank_of(self.rank)

    @property
    def context_rank(self) -> int:
        """This rank's place in its context-parallel group."""
        return (self.rank // self.tensor) % self.context

    @property
    def tensor_rank(self) -> int:
        """This rank's place in its tensor-parallel group."""
        return self.rank % self.tensor

    @property
    def shard(self) -> int:
        """Ranks FSDP splits parameters, gradients and optimizer state over (1: replicated)."""
        if self.world_size == 1:
            return 1
        return self.stage_size // self.tensor // (self.replicate or 1)

    @property
    def expert_sharded(self) -> bool:
        """Whether the experts are split over ranks (the degree divides the ranks; otherwise every rank holds every
        expert, as a checkpoint evaluated on fewer processes than it trained on does)."""
        return self.expert > 1 and self.world_size % self.expert == 0

    def degrees(self) -> dict[str, int]:
        """The layout's sizes by name, as ``scripts/plan.py`` shows them."""
        return {
            "replicate": self.replicate or 1,
            "shard": self.shard,
            "expert_parallel": self.expert,
            "tensor_parallel": self.tensor,
            "context_parallel": self.context,
            "pipeline_parallel": self.pipeline,
        }

    # The meshes and groups: made on first use (every rank at the same point) and kept.

    @cached_property
    def model_mesh(self) -> Optional[DeviceMesh]:
        """FSDP2's mesh, then ``"tp"`` (None for one process)."""
        if self.world_size == 1:
            return None
        replicate = [("replicate", self.replicate)] if self.replicate else []
        return self._init_mesh([*self._pipeline_dim, *replicate, ("shard", self.shard), *self._tensor_dim])

    @property
    def fsdp_mesh(self) -> Optional[DeviceMesh]:
        """The model mesh without its ``"tp"`` and ``"pp"`` dimensions: what FSDP shards and replicates over (with a
        pipeline, the ranks of this rank's stage)."""
        mesh = self.model_mesh
        if mesh is None or (self.tensor == 1 and self.pipeline == 1):
            return mesh
        return mesh[tuple(n for n in mesh.mesh_dim_names or () if n not in ("tp", "pp"))]

    @property
    def pipeline_group(self) -> Any:
        """The process group of this rank's pipeline (one rank of each stage; None without pipeline parallelism)."""
        mesh = self.model_mesh
        return mesh.get_group("pp") if mesh is not None and self.pipeline > 1 else None

    @property
    def tensor_mesh(self) -> Optional[DeviceMesh]:
        """The tensor-parallel group's one-dimensional mesh (None without tensor parallelism)."""
        mesh = self.model_mesh
        return mesh["tp"] if mesh is not None and self.tensor > 1 else None

    @cached_property
    def data_mesh(self) -> DeviceMesh:
        """``("dp", "cp")``, then ``"tp"`` (after ``"pp"`` with a pipeline): the ranks by the instances they read."""
        dims = [("dp", self.data_parallel_size), ("cp", self.context), *self._tensor_dim]
        return self._init_mesh([*self._pipeline_dim, *dims])

    @cached_property
    def context_parallel(self) -> Optional[ContextParallel]:
        """This rank's context-parallel group (None with ``context_parallel.degree`` 1)."""
        if self.context == 1:
            return None
        from .context_parallel import ContextParallel

        mesh = self.data_mesh
        return ContextParallel(self.context, mesh.get_local_rank("cp"), mesh.get_group("cp"))

    @cached_property
    def expert_mesh(self) -> Optional[DeviceMesh]:
        """``("ep", "ep_dp")`` of shape ``(degree, world_size / degree)`` (None when the experts are not split)."""
        if not self.expert_sharded:
            return None
        return self._init_mesh([("ep", self.expert), ("ep_dp", self.world_size // self.expert)])

    @property
    def _pipeline_dim(self) -> list[tuple[str, int]]:
        return [("pp", self.pipeline)] if self.pipeline > 1 else []

    @property
    def _tensor_dim(self) -> list[tuple[str, int]]:
        return [("tp", self.tensor)] if self.tensor > 1 else []

    def _init_mesh(self, dims: list[tuple[str, int]]) -> DeviceMesh:
        """A mesh of ``dims`` (name, size), outermost first, over this layout's ranks."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        names = tuple(name for name, _ in dims)
        if not dist.is_initialized() or dist.get_world_size() != self.world_size:
            raise RuntimeError(
                f"the {names} mesh of a layout of {self.world_size} ranks needs their process group "
                f"(initialized: {dist.is_initialized()})"
            )
        return init_device_mesh(self.device_type, tuple(size for _, size in dims), mesh_dim_names=names)
