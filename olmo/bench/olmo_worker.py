"""The worker code both sides of ``scripts/benchmark_olmo.py`` share, so that the two models are timed by the
same code around them: the line protocol (:func:`serve`), the round timer (:func:`time_round`) and :class:`Side`,
which answers the requests, runs measurement (a) and the bit-identity dump, and leaves only the model and its
training step (measurement (b)) to each side (:class:`olmo.cli.benchmark_olmo.OursSide` and the original's
``OriginalSide`` in ``scripts/olmo_original_worker.py``).

The original OLMo's worker loads this file by its path into the original's interpreter, where ``import olmo``
is the original package: so this module imports torch and the standard library only, never ``olmo``.

Protocol: one JSON request per line on stdin, ``{"cmd": NAME, ...}``; one JSON reply per line on the original
stdout (everything else the process prints is sent to stderr), ``{"ok": true, ...}`` or
``{"ok": false, "error": TRACEBACK}``. ``quit`` or the end of stdin ends the worker.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

Handler = Callable[[dict[str, Any]], dict[str, Any]]

AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16}
"""``--dtype`` of the driver -> the autocast dtype (None: no autocast, fp32 throughout)."""


def serve(handlers: dict[str, Handler]) -> None:
    """Answer requests from stdin until ``quit`` or end of input. Library output (warnings, prints) goes to
    stderr: only replies are written to the protocol stream, the process's original stdout."""
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stdout.flush()
    os.dup2(2, 1)
    for line in sys.stdin:
        request = json.loads(line)
        cmd = request.pop("cmd")
        if cmd == "quit":
            break
        try:
            reply = {"ok": True, **handlers[cmd](request)}
        except Exception:
            reply = {"ok": False, "error": traceback.format_exc()}
        protocol.write(json.dumps(reply) + "\n")
    protocol.close()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_round(
    step: Callable[[], Any], iters: int, device: torch.device, finish: Callable[[], Any] = lambda: None
) -> float:
    """Mean seconds per ``step()`` over ``iters`` calls, the device synchronized only before the first and after
    ``finish()`` (which reads back whatever the steps left queued), so a GPU's queue runs ahead as in training."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        step()
    finish()
    synchronize(device)
    return (time.perf_counter() - start) / iters


def profile_table(step: Callable[[], Any], iters: int, device: torch.device, row_limit: int = 30) -> str:
    """``torch.profiler`` over ``iters`` steps: the ops that cost the most time of their own (by input shape)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as prof:
        for _ in range(iters):
            step()
        synchronize(device)
    sort_by = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages(group_by_input_shape=True).table(
        sort_by=sort_by, row_limit=row_limit, max_name_column_width=40
    )


class Side:
    """One side of the comparison, inside its worker: the model, its inputs, and the requests it answers.

    A subclass builds the model (:meth:`build`) and defines measurement (b), its training step
    (:meth:`train_step`); measurement (a) and the bit-identity dump are the same code for both sides.
    """

    model: torch.nn.Module
    input_ids: torch.Tensor
    """(B, T) the batch of measurement (a) and of the bit-identity check, on the device."""
    targets: torch.Tensor
    """(B, T) its targets: random token ids, one per position."""

    def handlers(self) -> dict[str, Handler]:
        return {"setup": self.setup, "check": self.check, "round": self.run_round, "profile": self.profile}

    def setup(self, request: dict[str, Any]) -> dict[str, Any]:
        self.device = torch.device(request["device"])
        torch.set_num_threads(request["threads"])
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            # Our build_model sets it from the config; the original never sets it, so it is set here for both.
            torch.set_float32_matmul_precision(request["float32_matmul_precision"])
        # Both trainers turn automatic collection off while training; a collection in the middle of a timed
        # round would land on one side at random.
        gc.disable()
        self.autocast_dtype = AUTOCAST_DTYPES[request["dtype"]]
        return {"torch": torch.__version__, "threads": torch.get_num_threads(), **self.build(request)}

    def build(self, request: dict[str, Any]) -> dict[str, Any]:
        """Build the model, optimizer and batches on ``self.device``; return facts for the report."""
        raise NotImplementedError

    def train_step(self) -> Any:
        """Measurement (b): one training step of this implementation."""
        raise NotImplementedError

    def finish_train_steps(self) -> None:
        """Read back whatever the training steps left queued on the device (timed with them)."""

    def loss_value(self, result: Any) -> float:
        """The loss of a step from what :meth:`plain_step` or :meth:`train_step` returned."""
        return float(result)

    def plain_step(self) -> torch.Tensor:
        """Measurement (a): zero the gradients, forward to the logits, ``F.cross_entropy`` averaged over all
        B*T targets, backward. Returns the loss, detached."""
        return self._plain_loss()[0]

    def _plain_loss(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.model.zero_grad(set_to_none=True)
        dtype = self.autocast_dtype
        with torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None):
            logits = self.model(self.input_ids).logits  # (B, T, V)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), self.targets.view(-1))
        loss.backward()
        return loss.detach(), logits.detach()

    def check(self, request: dict[str, Any]) -> dict[str, Any]:
        """One step of (a); write its logits, loss and every parameter's gradient (by name) to ``path`` for the
        driver to compare, then zero the gradients again."""
        loss, logits = self._plain_loss()
        grads = {name: p.grad.cpu() for name, p in self.model.named_parameters() if p.grad is not None}
        torch.save({"logits": logits.cpu(), "loss": loss.cpu(), "grads": grads}, request["path"])
        self.model.zero_grad(set_to_none=True)
        return {"loss": loss.item()}

    def run_round(self, request: dict[str, Any]) -> dict[str, Any]:
        """``iters`` steps of measurement ``mode``: their mean seconds and the last step's loss."""
        if request["mode"] == "a":
            step, finish = self.plain_step, lambda: None
        else:
            step, finish = self.train_step, self.finish_train_steps
        results: list[Any] = []
        seconds = time_round(lambda: results.append(step()), request["iters"], self.device, finish)
        return {"seconds": seconds, "loss": self.loss_value(results[-1])}

    def profile(self, request: dict[str, Any]) -> dict[str, Any]:
        step = self.plain_step if request["mode"] == "a" else self.train_step
        return {"table": profile_table(step, request["iters"], self.device)}
