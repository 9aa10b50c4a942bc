"""Time of an RL step's parts at a model's real shapes: sampling a group with the KV cache and without it, training
on the group (the recomputed log-probabilities, the loss, the backward), and, for ``rl.beta > 0``, the frozen
reference's forward and the memory it holds.

    python scripts/benchmark_rl.py SOURCE [--group-size 8] [--prompt-tokens 32] [--new-tokens 16] [--groups 4]
        [--precision fp32|bf16] [--out result.json]

SOURCE is a checkpoint (its model) or a config YAML (its ``model`` section, randomly initialised). The prompts are
random token ids (a fixed seed), and no token ends a completion, so every completion is ``--new-tokens`` long and
both ways of sampling generate the same number of tokens (with the same random streams they draw the same tokens
up to float noise in the logits: the share drawn alike is reported). Each part runs ``--groups`` times after one
warm-up, through the code the RL step runs (:class:`~olmo.rl.rollout.BuiltinRolloutEngine`,
:func:`~olmo.rl.step.group_batch`, :func:`~olmo.rl.step.completion_logps`, :mod:`olmo.rl.policy_loss`); the median
is reported. The reference's memory is its weights' bytes (on CUDA also the growth of allocated memory when it is
built; on a CPU the resident set reuses the memory training freed, so it is not a measure); its forward keeps no
activations (no gradient).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..exceptions import OLMoCliError
from ..util import result_file_problem, write_result_file

__all__ = ["main"]

RESULT_KEYS = ("rollout_seconds_per_group", "train_seconds_per_group")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="benchmark_rl.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="a checkpoint folder, or a config YAML whose model is built at random")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--groups", type=int, default=4, help="groups timed per part (after one warm-up)")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="bf16: autocast (CUDA)")
    parser.add_argument("--out", help="also write the result here as JSON")
    args = parser.parse_args(argv)
    for name in ("group_size", "prompt_tokens", "new_tokens", "groups"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1")
    problem = result_file_problem(Path(args.out), RESULT_KEYS) if args.out else None
    if problem is not None:
        parser.error(f"--out={args.out} cannot be written: {problem}")
    return args


def _model(source: str, device: torch.device) -> Any:
    from ..checkpoint import load_model
    from ..config import TrainConfig
    from ..model import OLMo

    path = Path(source)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise OLMoCliError(f"SOURCE {source} does not exist; give a config YAML or a checkpoint folder.")
        cfg = TrainConfig.load(str(path))
        torch.manual_seed(0)
        return OLMo(cfg.model).to(device)
    model, _, _ = load_model(source, device)
    return model


def _median_seconds(fn: Callable[[int], Any], runs: int, device: torch.device) -> tuple[float, list[Any]]:
    """One warm-up call, then the median time of ``runs`` calls (``fn(i)``, the device synchronised)."""
    fn(-1)
    times, results = [], []
    for i in range(runs):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        results.append(fn(i))
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), results


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from ..rl.policy_loss import group_advantages, loss_denominator, reduce_losses, token_losses
    from ..rl.rollout import BuiltinRolloutEngine
    from ..rl.step import completion_logps, group_batch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = _model(args.source, device)
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    vocab = cfg.vocab_size
    seq = args.prompt_tokens + args.new_tokens
    if seq > cfg.max_sequence_length:
        raise OLMoCliError(
            f"--prompt-tokens {args.prompt_tokens} + --new-tokens {args.new_tokens} = {seq} exceeds the model's "
            f"max_sequence_length {cfg.max_sequence_length}; lower them."
        )
    G, N = args.group_size, args.new_tokens
    prompts = torch.randint(
        0, vocab, (args.groups + 1, args.prompt_tokens), generator=torch.Generator().manual_seed(0)
    )
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16) if args.precision == "bf16" else contextlib.nullcontext()
    )

    def engine(use_cache: bool) -> BuiltinRolloutEngine:
        return BuiltinRolloutEngine(
            model, group_size=G, max_new_tokens=N, temperature=1.0, top_p=1.0, eos=-1, seed=0,
            vocab_size=vocab, use_cache=use_cache,
        )  # fmt: skip

    def sample(use_cache: bool) -> Callable[[int], Any]:
        def run(i: int):
            with autocast:
                return engine(use_cache).sample(prompts[i + 1], i + 1, 0)

        return run

    cached_s, groups = _median_seconds(sample(True), args.groups, device)
    uncached_s, uncached = _median_seconds(sample(False), args.groups, device)
    same = sum(a == b for g, h in zip(groups, uncached) for x, y in zip(g.tokens, h.tokens) for a, b in zip(x, y))
    batches = [group_batch(prompts[i + 1], g, pad=0) for i, g in enumerate(groups)]
    rewards = torch.rand(G, generator=torch.Generator().manual_seed(1))
    advantages, _ = group_advantages(rewards, G, "group", None)

    def train(i: int, reference: torch.nn.Module | None = None) -> None:
        b = batches[max(i, 0)]
        ids, targets = b.input_ids.to(device), b.completion_mask.to(device)
        b = copy.copy(b)
        b.input_ids, b.completion_ids = ids, b.completion_ids.to(device)
        with autocast:
            logps, _ = completion_logps(model, b, 1.0, vocab)
            ref = None
            if reference is not None:
                with torch.no_grad():
                    ref, _ = completion_logps(reference, b, 1.0, vocab)
        out = token_losses(
            logps, b.old_logps.to(device), advantages.to(device), loss="dapo", epsilon_low=0.2, epsilon_high=0.2,
            beta=0.0 if reference is None else 0.04, ref_logps=ref,
        )  # fmt: skip
        numerator, _ = reduce_losses(out.loss, targets, "dapo", N)
        (numerator / loss_denominator(targets, "dapo", N)).backward()
        model.zero_grad(set_to_none=True)

    model.train()
    train_s, _ = _median_seconds(train, args.groups, device)
    before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    grown = torch.cuda.memory_allocated() - before if device.type == "cuda" else None
    with_reference_s, _ = _median_seconds(lambda i: train(i, reference), args.groups, device)
    tokens = G * N
    weight_bytes = sum(p.numel() * p.element_size() for p in reference.parameters())
    return {
        "source": args.source,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "precision": args.precision,
        "params": params,
        "group_size": G,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": N,
        "groups": args.groups,
        "rollout_seconds_per_group": cached_s,
        "rollout_no_cache_seconds_per_group": uncached_s,
        "kv_cache_speedup": uncached_s / cached_s,
        "sampled_alike_fraction": same / (args.groups * tokens),
        "rollout_tokens_per_s": tokens / cached_s,
        "train_seconds_per_group": train_s,
        "train_with_reference_seconds_per_group": with_reference_s,
        "rollout_share_of_step": cached_s / (cached_s + train_s),
        "reference_weight_bytes": weight_bytes,
        "reference_cuda_memory_growth_bytes": grown,
    }


def _report(r: dict[str, Any]) -> str:
    mib = 2**20
    return "\n".join(
        [
            f"RL step parts: {r['params']:,} parameters, {r['device']} ({r['threads']} threads, {r['precision']}); "
            f"groups of {r['group_size']} completions x {r['new_tokens']} new tokens after {r['prompt_tokens']}-token "
            f"prompts; medians of {r['groups']} groups",
            f"  sampling, KV cache     {r['rollout_seconds_per_group']:.4f} s a group "
            f"({r['rollout_tokens_per_s']:,.0f} tokens/s)",
            f"  sampling, no cache     {r['rollout_no_cache_seconds_per_group']:.4f} s a group "
            f"(the cache: {r['kv_cache_speedup']:.2f}x; tokens drawn alike {r['sampled_alike_fraction']:.1%})",
            f"  training               {r['train_seconds_per_group']:.4f} s a group "
            f"(sampling is {r['rollout_share_of_step']:.0%} of sampling + training)",
            f"  training + reference   {r['train_with_reference_seconds_per_group']:.4f} s a group "
            f"(rl.beta > 0: the frozen reference's forward)",
            f"  reference memory       {r['reference_weight_bytes'] / mib:.1f} MiB of weights"
            + (
                ""
                if r["reference_cuda_memory_growth_bytes"] is None
                else f"; CUDA memory grew {r['reference_cuda_memory_growth_bytes'] / mib:.1f} MiB when it was built"
            ),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = measure(args)
    print(_report(result))
    if args.out:
        write_result_file(Path(args.out), json.dumps(result, indent=2) + "\n")
    return 0
