"""In-loop evaluation: perplexity on held-out token files (``type: lm``), zero-shot multiple choice on
``ai2-olmo-eval`` tasks (``type: downstream``) and samples from prompts (``type: generate``).

Build the evaluators once, then call ``evaluate`` on every rank at each evaluation, with the train module (the
trainer does this through :class:`EvalRunner`) or a bare model::

    evaluators = evaluators_of_run(cfg, env.world_size, env.rank)  # build_evaluators with cfg's sections
    for evaluator in evaluators:
        metrics.update(evaluator.evaluate(train_module, env.device))
        # or: evaluator.evaluate(model, env.device, autocast_dtype=autocast_dtype(cfg, env.device))

May import: ``olmo.data``, ``olmo.tokenizer``, ``olmo.distributed``, ``olmo.model``, ``olmo.config``, ``olmo.util``,
``olmo.exceptions``.

Metric names follow OLMo: ``eval/{label}/CrossEntropyLoss``, ``eval/{label}/Perplexity`` and
``eval/downstream/{label}_{acc,len_norm,f1,ce_loss,bpb}``; samples: ``eval/{label}/samples`` (texts, in
``metrics.jsonl`` and a wandb table), ``eval/{label}/new_tokens`` and ``eval/{label}/tokens_per_second``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Union

from ..config import EvaluatorConfig, EvaluatorType, ModelConfig, TokenizerConfig, TrainConfig
from ..config.validation import evaluator_problems, task_labels
from ..data import DataCollator, DataContext, build_dataset, data_order_seed
from ..distributed.run_shape import RunShape
from ..model.generation import build_sampler
from ..tokenizer import Tokenizer
from .downstream import OLMO_06_CONTEXT, DownstreamEvaluator, build_task
from .evaluator import EvalRunner, EvalTarget, Evaluator, ModelEval
from .lm import LMEvaluator
from .samples import GenerationEvaluator

__all__ = [
    "Evaluator",
    "EvalRunner",
    "EvalTarget",
    "ModelEval",
    "LMEvaluator",
    "DownstreamEvaluator",
    "GenerationEvaluator",
    "build_evaluators",
    "evaluators_of_run",
    "evaluator_problems",
    "task_labels",
]

log = logging.getLogger(__name__)


def build_evaluators(
    evaluators: Sequence[EvaluatorConfig],
    model: ModelConfig,
    context: DataContext,
    *,
    tokenizer: Union[TokenizerConfig, Tokenizer],
    batch_size: int,
    subset_num_batches: int,
    world_size: int = 1,
    rank: int = 0,
) -> list[Evaluator]:
    """One evaluator per entry of ``evaluators`` (the config's ``evaluators``, validated with it: see
    :func:`evaluator_problems`), in order, scoring this rank's share of the data.

    The order instances are dealt to ranks is seeded by ``data.seed`` of the evaluator, else ``context.seed``.
    Downstream tasks are tokenized with ``tokenizer`` (a ``tokenizer`` config is loaded for ``model`` only when an
    evaluator needs it) and truncated to ``model.max_sequence_length``.

    Every LM evaluator's files are validated as training data is (:meth:`MemMapDataset.validate`) and the
    tokenizer is loaded here, so a bad evaluator stops a launch before training, not at the first evaluation.

    :param context: the run's data settings; an LM evaluator's files are opened as the training data's are.
    :param batch_size: instances per forward pass of an evaluator without its own (``device_eval_batch_size``).
    :param subset_num_batches: batches an evaluator without its own scores (``eval_subset_num_batches``; -1: all).
    :raises OLMoDataError: for a missing or malformed evaluation data file.
    """
    built: list[Evaluator] = []
    for i, ecfg in enumerate(evaluators):
        common = dict(
            batch_size=batch_size if ecfg.device_eval_batch_size is None else ecfg.device_eval_batch_size,
            subset_num_batches=subset_num_batches if ecfg.subset_num_batches is None else ecfg.subset_num_batches,
            world_size=world_size,
            rank=rank,
            seed=data_order_seed(ecfg.data, context.seed),
        )
        if ecfg.type != EvaluatorType.downstream and ecfg.definitions != "olmo_eval":
            log.warning("evaluators[%d].definitions has no effect on a %s evaluator.", i, ecfg.type)
        if ecfg.type != EvaluatorType.generate and ecfg.prompts:
            log.warning(
                "evaluators[%d].prompts has no effect on a %s evaluator (only type: generate).", i, ecfg.type
            )
        if ecfg.type == EvaluatorType.generate:
            if ecfg.data.paths or ecfg.data.datasets:
                log.warning("evaluators[%d].data has no effect on a generate evaluator.", i)
            if isinstance(tokenizer, TokenizerConfig):
                tokenizer = Tokenizer.for_model(tokenizer, model)
            built.append(
                GenerationEvaluator(
                    ecfg.label,
                    ecfg.prompts,
                    tokenizer,
                    max_new_tokens=ecfg.max_new_tokens,
                    sampler=build_sampler(ecfg.temperature, ecfg.top_k, ecfg.top_p),
                    end_index=model.eos_token_id,
                    max_sequence_length=model.max_sequence_length,
                    seed=common["seed"],  # type: ignore[arg-type]
                    world_size=world_size,
                    rank=rank,
                )
            )
        elif ecfg.type == EvaluatorType.downstream:
            if ecfg.data.paths or ecfg.data.datasets:
                log.warning("evaluators[%d].data has no effect on a downstream evaluator.", i)
            if isinstance(tokenizer, TokenizerConfig):
                tokenizer = Tokenizer.for_model(tokenizer, model)
            legacy = ecfg.definitions == "olmo-0.6"
            task = build_task(ecfg.label, tokenizer, OLMO_06_CONTEXT if legacy else model.max_sequence_length)
            built.append(DownstreamEvaluator(ecfg.label, task, definitions=ecfg.definitions, **common))
        else:
            dataset = build_dataset(
                ecfg.data, model, context, include_instance_metadata=True, key=f"evaluators[{i}].data"
            )
            # Checked now, before training starts, not when the first evaluation runs; rank 0 scans the ids.
            dataset.validate(model.vocab_size, 2**31 if rank == 0 else 0)
            built.append(
                LMEvaluator(
                    ecfg.label,
                    dataset,
                    dataset_labels=sorted(ecfg.data.datasets) if ecfg.data.datasets else None,
                    num_workers=ecfg.data.num_workers,
                    collator=DataCollator(pad_direction=ecfg.data.pad_direction, pad_token_id=model.pad_token_id),
                    **common,
                )
            )
    return built


def evaluators_of_run(cfg: TrainConfig, world_size: int = 1, rank: int = 0) -> list[Evaluator]:
    """:func:`build_evaluators` with the sections of a run's config, as ``train.py`` and ``eval.py`` build them. The
    ranks of a tensor-parallel group (and of a pipeline) compute each forward pass together, so they score the same
    share (the group counts as one rank; their reduced sums count each instance ``degree`` times, which the metrics'
    ratios cancel)."""
    layout = RunShape.from_train_config(cfg).layout(world_size)
    # A pipeline's ranks (each holding a stage) compute each forward pass together too.
    tp, stage = layout.tensor, layout.stage_size
    world_size, rank = stage // tp, (rank % stage) // tp
    return build_evaluators(
        cfg.evaluators,
        cfg.model,
        DataContext.from_train_config(cfg),
        tokenizer=cfg.tokenizer,
        batch_size=cfg.device_eval_batch_size,
        subset_num_batches=cfg.eval_subset_num_batches,
        world_size=world_size,
        rank=rank,
    )
