"""Evaluation as a loop callback: :class:`EvaluationCallback` runs the :class:`~olmo.eval.EvalRunner`'s evaluators
every ``eval_interval`` steps, at the last step and, with ``eval_on_load``, right after a restore. In-loop samples
are its ``type: generate`` evaluators: their texts are logged as records (a ``metrics.jsonl`` line, a wandb table)."""

from __future__ import annotations

from typing import Any

from ..distributed import DistEnv
from ..eval import EvalRunner
from .callback import Callback, Loop, RunContext, StepContext

__all__ = ["EvaluationCallback"]


class EvaluationCallback(Callback):
    """Every evaluator on every rank (they reduce across ranks), when due; the results logged in full.

    :param train_module: what the evaluators run the model through (``eval_batch``).
    :param eval_on_load: also evaluate right after a restore, before the first step.
    """

    def __init__(self, runner: EvalRunner, train_module: Any, env: DistEnv, eval_on_load: bool):
        self.runner, self.train_module, self.env, self.eval_on_load = runner, train_module, env, eval_on_load

    def pre_train(self, ctx: RunContext) -> None:
        if self.eval_on_load and ctx.restored_step:
            with ctx.loop.phase("evaluation"):
                self.evaluate(ctx.loop, ctx.step, ctx.stop_at, force=True)

    def post_step(self, ctx: StepContext) -> None:
        # With several processes, a signal during an evaluation is agreed on at the next step instead.
        with ctx.loop.phase("evaluation"), ctx.loop.waiting(self.env.world_size == 1):
            evaluated = self.evaluate(ctx.loop, ctx.step, ctx.stop_at)
        if evaluated:
            ctx.loop.restart_clock()  # evaluation time is not training throughput

    def evaluate(self, loop: Loop, step: int, stop_at: int, force: bool = False) -> bool:
        """Run the evaluators if due after ``step`` and log the results; return whether anything ran."""
        if not self.runner.due(step, stop_at, force):
            return False
        loop.flush_metrics()  # training steps first, so metrics.jsonl stays in step order
        metrics = self.runner.run(self.train_module, self.env.device)
        loop.log_results(step, metrics, self.runner.records)
        return True
