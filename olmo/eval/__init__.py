"""In-loop evaluation: perplexity on held-out token files (``type: lm``), zero-shot multiple choice on
``ai2-olmo-eval`` tasks (``type: downstream``) and samples from prompts (``type: generate``).

Build the evaluators once, then call ``evaluate`` on every rank at each evaluation, with the train module (the
trainer does this through :class:`EvalRunner`) or a bare model::

    evaluators = build_evaluators(cfg, world_size=env.world_size, rank=env.rank)
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
from typing import Optional

from ..config import EvaluatorType, TrainConfig
from ..config.validation import evaluator_batch_size, evaluator_problems, task_labels
from ..data import DataCollator, build_memmap_dataset, data_order_seed
from ..exceptions import OLMoConfigurationError
from ..model.generation import build_sampler
from ..tokenizer import Tokenizer
from .downstream import OLMO_06_CONTEXT, DownstreamEvaluator, build_task
from .evaluator import EvalRunner, EvalTarget, Evaluator, ModelEval
from .generation import GenerationEvaluator
from .lm import LMEvaluator

__all__ = [
    "Evaluator",
    "EvalRunner",
    "EvalTarget",
    "ModelEval",
    "LMEvaluator",
    "DownstreamEvaluator",
    "GenerationEvaluator",
    "build_evaluators",
    "evaluator_problems",
    "task_labels",
]

log = logging.getLogger(__name__)


def build_evaluators(
    cfg: TrainConfig, *, world_size: int = 1, rank: int = 0, tokenizer: Optional[Tokenizer] = None
) -> list[Evaluator]:
    """One evaluator per ``cfg.evaluators`` entry, in order, scoring this rank's share of the data.

    Batch size and subset fall back to ``device_eval_batch_size`` and ``eval_subset_num_batches``; the
    order instances are dealt to ranks is seeded by ``data.seed`` of the evaluator, else ``seed``.
    Downstream tasks are tokenized with ``tokenizer`` (default: ``Tokenizer.from_train_config(cfg)``,
    loaded only when there is a downstream evaluator) and truncated to ``model.max_sequence_length``.

    Every LM evaluator's files are validated as training data is (:meth:`MemMapDataset.validate`) and the
    tokenizer is loaded here, so a bad evaluator stops a launch before training, not at the first evaluation.

    :raises OLMoConfigurationError: listing every problem :func:`evaluator_problems` finds.
    :raises OLMoDataError: for a missing or malformed evaluation data file.
    """
    problems = evaluator_problems(cfg)
    if problems:
        raise OLMoConfigurationError("Invalid evaluators:\n  " + "\n  ".join(problems))
    evaluators: list[Evaluator] = []
    for i, ecfg in enumerate(cfg.evaluators):
        common = dict(
            batch_size=evaluator_batch_size(cfg, ecfg),
            subset_num_batches=(
                cfg.eval_subset_num_batches if ecfg.subset_num_batches is None else ecfg.subset_num_batches
            ),
            world_size=world_size,
            rank=rank,
            seed=data_order_seed(ecfg.data, cfg.seed),
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
            if tokenizer is None:
                tokenizer = Tokenizer.from_train_config(cfg)
            evaluators.append(
                GenerationEvaluator(
                    ecfg.label,
                    ecfg.prompts,
                    tokenizer,
                    max_new_tokens=ecfg.max_new_tokens,
                    sampler=build_sampler(ecfg.temperature, ecfg.top_k, ecfg.top_p),
                    end_index=cfg.model.eos_token_id,
                    max_sequence_length=cfg.model.max_sequence_length,
                    seed=common["seed"],  # type: ignore[arg-type]
                    world_size=world_size,
                    rank=rank,
                )
            )
        elif ecfg.type == EvaluatorType.downstream:
            if ecfg.data.paths or ecfg.data.datasets:
                log.warning("evaluators[%d].data has no effect on a downstream evaluator.", i)
            if tokenizer is None:
                tokenizer = Tokenizer.from_train_config(cfg)
            legacy = ecfg.definitions == "olmo-0.6"
            task = build_task(ecfg.label, tokenizer, OLMO_06_CONTEXT if legacy else cfg.model.max_sequence_length)
            evaluators.append(DownstreamEvaluator(ecfg.label, task, definitions=ecfg.definitions, **common))
        else:
            dataset = build_memmap_dataset(
                cfg, ecfg.data, include_instance_metadata=True, key=f"evaluators[{i}].data"
            )
            # Checked now, before training starts, not when the first evaluation runs; rank 0 scans the ids.
            dataset.validate(cfg.model.vocab_size, 2**31 if rank == 0 else 0)
            evaluators.append(
                LMEvaluator(
                    ecfg.label,
                    dataset,
                    dataset_labels=sorted(ecfg.data.datasets) if ecfg.data.datasets else None,
                    num_workers=ecfg.data.num_workers,
                    collator=DataCollator(
                        pad_direction=ecfg.data.pad_direction, pad_token_id=cfg.model.pad_token_id
                    ),
                    **common,
                )
            )
    return evaluators
