"""Pipeline parallelism's model (issue 54): this rank's stages of the layers, built as one process would build the
whole model and initialised with the same numbers, sharded within the stage by FSDP, and run by
``torch.distributed.pipelining``'s schedules (:mod:`olmo.train.pipeline_module`).

:class:`PipelineStageModule` is one stage: blocks ``a .. b - 1`` of the model (keyed by their index, so parameter
names are the whole model's), with the embedding on the first stage and the final norm, output layer and loss on the
last. :class:`PipelineModel` holds every stage of this rank under the whole model's names (``transformer.wte``,
``transformer.blocks.7``, ...): the optimizer, checkpoints and metrics see it as the part of the model this rank
holds, so a checkpoint written under a pipeline is the model's and loads under any layout.

**The same numbers as one process.** The stages are carved from a model built on the meta device, and initialised in
the order :meth:`olmo.model.OLMo.reset_parameters` draws: a part this rank does not hold is drawn into a scratch
copy and dropped, so the random stream reaches every held parameter where one process's would. The loss of each
micro-batch is its summed cross entropy (and z-loss) over the step's label count, the gradients are not rescaled by
the schedule (``scale_grads=False``), and FSDP keeps a stage's parameters gathered between its micro-batches
(``reshard_after_forward=False``, which the zero-bubble schedules need to compute their weight gradients).
"""

from __future__ import annotations

import copy
import math
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from ..model import OLMo
from ..model.init import init_normal, init_scales
from ..model.layers import LayerNorm
from ..model.loss import LossSums
from ..model.recurrent_cache import recurrent_resets
from .pipeline_plan import block_flops, split_layers, stage_ranks

if TYPE_CHECKING:
    from ..config import ModelConfig, PipelineParallelConfig
    from .layout import ParallelLayout
    from .parallelize import ParallelizeOptions

__all__ = ["PipelineModel", "PipelineStageModule", "build_pipeline_model", "build_training_model"]


class PipelineStageModule(nn.Module):
    """One stage of the model (see the module's docstring). The last stage's forward returns the micro-batch's loss
    times :attr:`loss_scale` (what the schedule runs backward on) and keeps its detached sums in :attr:`sums`."""

    shell: OLMo
    transformer: Any

    def __init__(self, shell: OLMo, index: int, blocks: range, first: bool, last: bool):
        super().__init__()
        object.__setattr__(self, "shell", shell)  # the attention inputs' helpers, not a submodule
        self.index, self.first, self.last = index, first, last
        t = shell.transformer
        self.transformer = nn.Module()
        held: dict[str, Optional[nn.Module]] = {"blocks": nn.ModuleDict({str(i): t.blocks[i] for i in blocks})}
        if first:
            held.update(wte=t.wte, emb_drop=t.emb_drop, emb_norm=t.emb_norm, wpe=t.wpe)
        if last:
            held.update(ln_f=t.ln_f, ff_out=t.ff_out)
        for name, module in held.items():
            if module is not None:
                self.transformer.add_module(name, module)
        self.loss_scale: Optional[torch.Tensor] = None
        self.z_loss_multiplier: Optional[float] = None
        self.fused_loss = False
        self.sums: list[LossSums] = []

    def forward(
        self,
        x: torch.Tensor,
        labels: Optional[torch.Tensor] = None,
        doc_lens: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        shell, cfg, t = self.shell, self.shell.config, self.transformer
        if self.first:  # token ids in; the embedding as OLMo.forward computes it
            x = t.wte(x)
            if getattr(t, "emb_norm", None) is not None:
                x = t.emb_norm(x)
            if getattr(t, "wpe", None) is not None:
                x = x + t.wpe(torch.arange(x.shape[1], device=x.device))
            x = t.emb_drop(x)
        inputs, doc_spans = shell.attention_inputs(x, attention_mask, doc_lens, None, 0, None)
        resets = recurrent_resets(cfg, attention_mask, doc_lens, None, 0, x.shape[1])
        for block in t.blocks.values():
            if block.is_recurrent:
                x = block(x, resets)
                continue
            bias, rope = inputs[block.window]
            x = block(x, bias, rope, doc_spans)
        if not self.last:
            return x
        x = t.ln_f(x)
        scale = 1 / math.sqrt(cfg.d_model) if cfg.scale_logits else 1.0
        if labels is None:  # evaluation: the logits
            logits, _ = t.ff_out(x, None, None, False, scale, None)
            return logits
        assert self.loss_scale is not None, "the last stage's loss needs the step's scale"
        _, loss = t.ff_out(x, labels, self.z_loss_multiplier, self.fused_loss, scale, None)
        assert isinstance(loss, LossSums)
        self.sums.append(
            LossSums(loss.total.detach(), loss.ce.detach(), None if loss.z is None else loss.z.detach(), None)
        )
        return loss.total * self.loss_scale


class PipelineModel(nn.Module):
    """This rank's stages under the whole model's parameter names (see the module's docstring)."""

    shell: OLMo
    stages: list[PipelineStageModule]
    transformer: Any
    pipeline_group: Any

    def __init__(self, shell: OLMo, stages: list[PipelineStageModule], stage_indices: list[int], num_stages: int):
        super().__init__()
        object.__setattr__(self, "shell", shell)
        object.__setattr__(self, "stages", stages)  # not submodules: their modules are registered below once
        self.config = shell.config
        self.stage_indices, self.num_stages = stage_indices, num_stages
        self.schedule = "1f1b"
        """The schedule whose placement of the stages the model has (set by :func:`build_pipeline_model`)."""
        self.transformer = nn.Module()
        blocks = nn.ModuleDict()
        for stage in stages:
            for name, module in stage.transformer.named_children():
                if name == "blocks":
                    for key, block in module.items():
                        blocks[key] = block
                else:
                    self.transformer.add_module(name, module)
        self.transformer.add_module("blocks", blocks)

    def logits(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], group: Any) -> torch.Tensor:
        """The whole model's logits (B, T, embedding size) of ``input_ids`` on every rank of the pipeline, in
        float32: each stage in turn, its hidden states sent to the next stage's rank, the logits broadcast from the
        last's (a forward alone, for evaluation: no schedule, any batch shape)."""
        import torch.distributed as dist

        ranks = stage_ranks(self.num_stages, dist.get_world_size(group), self.schedule)
        me = dist.get_rank(group)
        local = dict(zip(self.stage_indices, self.stages))
        x: Optional[torch.Tensor] = None
        shape = (*input_ids.shape, self.config.d_model)
        for s in range(self.num_stages):
            if ranks[s] != me:
                continue
            if s == 0:
                x = input_ids
            elif ranks[s - 1] != me:  # the previous stage's hidden states, as float32
                x = torch.empty(shape, dtype=torch.float32, device=input_ids.device)
                dist.recv(x, group_src=ranks[s - 1], group=group)
            assert x is not None
            x = local[s](x, attention_mask=attention_mask)
            if s + 1 < self.num_stages and ranks[s + 1] != me:
                dist.send(x.float().contiguous(), group_dst=ranks[s + 1], group=group)
        last = ranks[self.num_stages - 1]
        logits = x.float() if me == last and x is not None else None
        out = torch.empty((*input_ids.shape, self.config.effective_embedding_size), device=input_ids.device)
        if logits is not None:
            out.copy_(logits)
        dist.broadcast(out, group_src=last, group=group)
        return out

    holds_part = True
    """This module holds part of the model: a checkpoint's other keys belong to the other stages."""

    def complete_state(self, state: dict[str, Any], full: bool, group: Any) -> None:
        """Make ``state`` (``{"model": ..., "optim": ...}`` of this rank, as checkpoints hold it) the whole model's
        where a checkpoint needs it: the optimizer's parameter groups list every stage's parameters (a sharded
        checkpoint keeps rank 0's groups), and, ``full``, the first pipeline rank gathers every stage's whole tensors
        (an unsharded checkpoint is written by rank 0). ``group``: the pipeline's process group."""
        import torch.distributed as dist

        size = dist.get_world_size(group)
        optim = state.get("optim")
        if optim is not None:
            everyone: list[Any] = [None] * size
            dist.all_gather_object(everyone, [_group_key(g) for g in optim["param_groups"]], group=group)
            merged: dict[tuple[Any, ...], set[str]] = {}
            for groups in everyone:
                for key, names in groups:
                    merged.setdefault(key, set()).update(names)
            template = {_group_key(g)[0]: g for g in optim["param_groups"]}
            first = optim["param_groups"][0]
            optim["param_groups"] = [
                {**template.get(key, {**first, "weight_decay": key[0]}), "params": sorted(names)}
                for key, names in merged.items()
            ]
        if not full:
            return
        parts: Optional[list[Any]] = [None] * size if dist.get_rank(group) == 0 else None
        mine = _on_cpu({"model": state["model"], "optim": None if optim is None else optim["state"]})
        dist.gather_object(mine, parts, group_dst=0, group=group)
        if parts is not None:
            state["model"] = {k: v for part in parts for k, v in part["model"].items()}
            if optim is not None:
                optim["state"] = {k: v for part in parts for k, v in part["optim"].items()}

    def num_flops_per_token(self, seq_len: Optional[int] = None) -> int:
        """The whole model's training FLOPs per token (the MFU counts each rank's share of the work as one process)."""
        return self.shell.num_flops_per_token(seq_len)


def _on_cpu(value: Any) -> Any:
    """``value`` (nested dicts of tensors) with every tensor on the CPU."""
    if isinstance(value, dict):
        return {k: _on_cpu(v) for k, v in value.items()}
    return value.cpu() if isinstance(value, torch.Tensor) else value


def build_training_model(
    cfg: ModelConfig, layout: ParallelLayout, options: ParallelizeOptions, pipeline: PipelineParallelConfig
) -> tuple[nn.Module, OLMo]:
    """The model a launch trains on ``layout`` (``build_model``'s, or this rank's stages of a pipeline) and the
    whole model it is part of (for its counts: parameters, FLOPs per token; on the meta device under a pipeline)."""
    if layout.pipeline > 1:
        model = build_pipeline_model(cfg, layout, options, pipeline)
        return model, model.shell
    from .parallelize import build_model

    whole = build_model(cfg, layout, options)
    return whole, whole


def _group_key(group: dict[str, Any]) -> tuple[tuple[Any, ...], list[str]]:
    """An optimizer parameter group's identity across stages (its weight decay, whether Muon steps it) and names."""
    return (group.get("weight_decay"), bool(group.get("use_muon", False))), list(group["params"])


def build_pipeline_model(
    cfg: ModelConfig,
    layout: ParallelLayout,
    options: ParallelizeOptions,
    pipeline: PipelineParallelConfig,
    init_params: bool = True,
) -> PipelineModel:
    """This rank's stages of ``OLMo(cfg)`` for ``pipeline`` on ``layout``: split by FLOPs and placed by the schedule
    (:mod:`olmo.distributed.pipeline_plan`), activation-checkpointed and compiled as the options say, sharded by
    FSDP over the stage's ranks, materialised on the device and (``init_params``) initialised as one process would."""
    from .parallelize import apply_activation_checkpointing, compile_blocks, fsdp_unit_options, meta_build

    env = layout.launch
    shell = meta_build(cfg, layout, options)  # tensor parallelism within the stage, as build_model does
    tp_mesh = layout.tensor_mesh
    if options.activation_checkpointing is not None:
        apply_activation_checkpointing(shell, options.activation_checkpointing)
    if options.compile is not None:
        compile_blocks(shell, options.compile)
    num_stages = pipeline.degree * pipeline.stages_per_rank
    costs, head = block_flops(cfg, cfg.max_sequence_length)
    split = split_layers(costs, head, num_stages)
    ranks = stage_ranks(num_stages, pipeline.degree, str(pipeline.schedule))
    mine = [s for s in range(num_stages) if ranks[s] == layout.pipeline_rank]
    stages = [PipelineStageModule(shell, s, split[s], s == 0, s == num_stages - 1) for s in mine]
    mesh = layout.fsdp_mesh
    if mesh is not None and mesh.size() > 1:
        from torch.distributed.fsdp import fully_shard

        kwargs = {**fsdp_unit_options(options, env, mesh), "reshard_after_forward": False}
        for stage in stages:
            for block in stage.transformer.blocks.values():
                fully_shard(block, **kwargs)
            fully_shard(stage, **kwargs)
    for stage in stages:
        stage.to_empty(device=env.device)
    model = PipelineModel(shell, stages, mine, num_stages)
    model.schedule = str(pipeline.schedule)
    object.__setattr__(model, "pipeline_group", layout.pipeline_group)
    if init_params:
        _initialize(shell, model, env.device)
        if tp_mesh is not None:  # drawn in the canonical order, as one process draws them
            from .tensor_parallel import order_fused_rows

            order_fused_rows(model)
    return model


@torch.no_grad()
def _initialize(shell: OLMo, model: PipelineModel, device: torch.device) -> None:
    """Initialise the held parameters with the numbers one process draws for them: the parts of the model in
    :meth:`OLMo.reset_parameters`'s order, those not held drawn into a scratch copy on ``device`` (of a plain build:
    no tensor-parallel groups or compiled code to copy) and dropped."""
    cfg = shell.config
    cutoff, std, emb_std = init_scales(cfg)
    held = set(model.transformer.children()) | set(model.transformer.blocks.values())
    with torch.device("meta"):
        plain = OLMo(cfg).transformer

    def draw(module: Optional[nn.Module], twin: Optional[nn.Module], init: Any) -> None:
        if module is None or twin is None:
            return
        if module in held:
            init(module)
        else:  # not this rank's: the same draws into a copy, so the stream stays where one process's is
            init(copy.deepcopy(twin).to_empty(device=device))

    t = shell.transformer
    draw(t.wte, plain.wte, lambda m: init_normal(m, emb_std, cutoff))
    draw(t.wpe, plain.wpe, lambda m: init_normal(m, std, cutoff))
    out_std = std if str(cfg.init_fn) == "normal" else 1 / math.sqrt(cfg.d_model)
    draw(t.ff_out, plain.ff_out, lambda m: init_normal(m, out_std, cutoff))
    for module in model.modules():  # the norms draw nothing
        if isinstance(module, LayerNorm):
            module.reset_parameters()
    for block, twin in zip(t.typed_blocks(), plain.typed_blocks()):
        draw(block, twin, lambda m: m.reset_parameters())
