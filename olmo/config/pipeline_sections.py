"""The ``pipeline_parallel`` section (issue 54): the model's layers split into stages over ranks, with the checks of its
values against the model, the other degrees and the processes launched (``problems``).

Pipeline parallelism is the mesh's outermost dimension: of ``W`` ranks, rank ``r`` holds stage ``r // (W / degree)``
(with ``stages_per_rank`` above 1, the virtual stages ``k * degree + r // (W / degree)``), and the ``W / degree`` ranks
of one stage shard it as any run of that many ranks would (FSDP). The ranks of one pipeline read the same instances,
so the data order and each step's batch are those of a run on ``W / degree`` ranks. Each rank's device batch is cut
into ``microbatches`` that flow through the stages as the ``schedule`` orders them (``torch.distributed.pipelining``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from .base import BaseConfig
from .sections import StrEnum

if TYPE_CHECKING:
    from .train_config import TrainConfig

__all__ = ["PipelineParallelConfig", "PipelineSchedule"]


class PipelineSchedule(StrEnum):
    """The order in which micro-batches' forwards and backwards run on the stages."""

    one_f_one_b = "1f1b"
    """One forward, one backward, alternating once the pipeline is full (PipeDream-flush): at most ``degree``
    micro-batches' activations held by the first stage; bubble ``(degree - 1) / (microbatches + degree - 1)``."""
    interleaved_1f1b = "interleaved_1f1b"
    """1F1B over ``stages_per_rank`` virtual stages per rank (Megatron's interleaving): the bubble shrinks by that
    factor, at more point-to-point traffic."""
    zero_bubble = "zero_bubble"
    """Interleaved, with each backward split into its input-gradient and weight-gradient halves, the latter filling
    the bubble (ZB-H1)."""
    zbv = "zbv"
    """Zero bubble on two stages per rank placed in a V (rank ``r`` holds stages ``r`` and ``2 * degree - 1 - r``):
    the first and last stage on one rank."""


@dataclass
class PipelineParallelConfig(BaseConfig):
    """Pipeline parallelism: ``{degree: N}`` splits the model's layers into stages over N groups of ranks."""

    degree: int = 1
    """Pipeline stages (groups of ranks; 1: none). Must divide the number of processes."""
    schedule: PipelineSchedule = PipelineSchedule.one_f_one_b
    """``1f1b``, ``interleaved_1f1b``, ``zero_bubble`` or ``zbv``."""
    microbatches: Optional[int] = None
    """Micro-batches each rank's device batch is cut into per step (null: the device batch over
    ``device_train_microbatch_size``, as gradient accumulation cuts it without pipelining). At least ``degree``
    keeps every stage busy in the steady state."""
    stages_per_rank: int = 1
    """Virtual stages per rank: 1 for ``1f1b``, at least 2 for ``interleaved_1f1b`` and ``zero_bubble``, exactly 2
    for ``zbv``."""

    def problems(self, cfg: TrainConfig, world_size: Optional[int]) -> list[str]:
        """One sentence per reason the section cannot train ``cfg`` on ``world_size`` ranks (None: any number the
        degrees divide; ``--dry_run``)."""
        d = self.degree
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            return [f"pipeline_parallel.degree={d!r} must be a whole number >= 1 (1 = none)."]
        if d == 1:
            return []
        out: list[str] = []
        if self.schedule not in PipelineSchedule.__members__.values():
            names = ", ".join(s.value for s in PipelineSchedule)
            out.append(f"pipeline_parallel.schedule={self.schedule!r} is not a schedule; use one of {names}.")
        v = self.stages_per_rank
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            out.append(f"pipeline_parallel.stages_per_rank={v!r} must be a whole number >= 1.")
            v = 1
        elif self.schedule == PipelineSchedule.one_f_one_b and v != 1:
            out.append(
                f"pipeline_parallel.stages_per_rank={v} needs an interleaved schedule (interleaved_1f1b, zero_bubble, "
                f"zbv); 1f1b runs one stage per rank: set stages_per_rank=1."
            )
        elif self.schedule == PipelineSchedule.zbv and v != 2:
            out.append("pipeline_parallel.schedule=zbv places exactly 2 stages per rank; set stages_per_rank=2.")
        elif self.schedule in (PipelineSchedule.interleaved_1f1b, PipelineSchedule.zero_bubble) and v < 2:
            out.append(
                f"pipeline_parallel.schedule={self.schedule} interleaves several stages per rank; set "
                f"stages_per_rank=2 or more (or use schedule 1f1b)."
            )
        m = self.microbatches
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            out.append(f"pipeline_parallel.microbatches={m!r} must be a whole number >= 1, or null.")
        stages = d * v
        if cfg.model.n_layers < stages:
            out.append(
                f"pipeline_parallel.degree={d} x stages_per_rank={v} = {stages} stages need at least as many layers "
                f"(model.n_layers={cfg.model.n_layers}); use fewer stages."
            )
        if world_size is not None and world_size % d:
            out.append(
                f"pipeline_parallel.degree={d} must divide the number of processes launched ({world_size}); launch a "
                f"multiple of {d}, or change the degree."
            )
        refused = {  # key: (whether the run sets it, why the pipeline cannot honour it yet, the fix)
            "context_parallel.degree": (cfg.context_parallel.degree > 1, "not built with pipelining yet", "set 1"),
            "expert_parallel.degree": (cfg.expert_parallel.degree > 1, "not built with pipelining yet", "set 1"),
            "model.moe": (
                cfg.model.moe is not None,
                "the experts' auxiliary losses would span stages",
                "remove it",
            ),
            "dpo.enabled": (cfg.dpo.enabled, "a pair's answers and the reference would span stages", "set false"),
            "rl.enabled": (cfg.rl.enabled, "sampling needs the whole model on each rank", "set false"),
            "stages": (
                bool(cfg.stages),
                "a staged run's step (and its KL reference) is not a pipeline's",
                "remove it",
            ),
            "evaluators[].type=generate": (
                any(str(e.type) == "generate" for e in cfg.evaluators or ()),
                "generating needs the whole model on each rank",
                "remove those evaluators",
            ),
            "model.float8.enabled": (
                cfg.model.trains_float8,
                "a pipeline's stages are not converted",
                "set false",
            ),
            "hf_export.enabled": (cfg.hf_export.enabled, "the export reads the whole model", "set false"),
            "data.mixture": (
                cfg.data.mixture is not None,
                "its per-source losses are not a pipeline's",
                "remove it",
            ),
            "distributed_strategy": (
                cfg.distributed_strategy != "fsdp",
                "each stage is sharded by FSDP",
                "set fsdp",
            ),
            "model.weight_tying": (
                cfg.model.weight_tying,
                "the embedding and the output layer are on the first and the last stage",
                "set false (an untied output layer)",
            ),
            "train_module": (cfg.train_module is not None, "its step is not a pipeline's", "remove it"),
        }
        if self.schedule in (PipelineSchedule.zero_bubble, PipelineSchedule.zbv) and cfg.compile is not None:
            refused["compile"] = (True, "torch's zero-bubble schedules refuse compiled stages", "set null")
        for key, (on, why, fix) in refused.items():
            if on:
                out.append(f"pipeline_parallel.degree={d} cannot be combined with {key} ({why}); {fix}.")
        out += self._microbatch_problems(cfg, world_size, stages)
        return out

    def _microbatch_problems(self, cfg: TrainConfig, world_size: Optional[int], stages: int) -> list[str]:
        """The micro-batches against each rank's batch and the schedule (with a known world size)."""
        if world_size is None or world_size % self.degree or not cfg.global_train_batch_size > 0:
            return []
        rows = cfg.device_batch_size(world_size)
        m = self.microbatches
        if m is None:
            micro = cfg.device_train_microbatch_size
            m = -(-rows // micro) if isinstance(micro, int) and micro > 0 else 1
        elif isinstance(m, bool) or not isinstance(m, int) or m < 1:
            return []
        out = []
        if rows % m:
            out.append(
                f"pipeline_parallel.microbatches={m} must divide each rank's batch ({rows} instances: "
                f"global_train_batch_size over {cfg.data_parallel_size(world_size)} data-parallel ranks); every "
                f"micro-batch crosses the stages with the same shape."
            )
        if self.schedule == PipelineSchedule.one_f_one_b and m < stages:
            out.append(
                f"pipeline_parallel.schedule=1f1b needs at least as many micro-batches as stages ({m} < {stages}); "
                f"raise pipeline_parallel.microbatches or lower device_train_microbatch_size."
            )
        rounds = max(1, m // self.degree)
        if self.schedule != PipelineSchedule.one_f_one_b and m % rounds:
            out.append(
                f"pipeline_parallel.schedule={self.schedule} needs micro-batches ({m}) divisible by their rounds over "
                f"the {self.degree} ranks ({rounds}); use a multiple of {self.degree}."
            )
        return out
