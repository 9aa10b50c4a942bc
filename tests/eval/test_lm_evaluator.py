"""LM evaluation: per-label cross entropy and perplexity, reduced by token counts, on a tiny model."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from olmo.config import TrainConfig
from olmo.eval import LMEvaluator
from olmo.model import OLMo
from olmo.testing import tiny_config_dict, write_byte_memmap

T = 32  # tiny_config_dict's model.max_sequence_length
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def lm_setup(tmp_path_factory):
    """Two labelled validation sets of 7 and 4 instances (the first with a tail that is dropped)."""
    root = tmp_path_factory.mktemp("lm")
    files = {
        "alpha": str(root / "alpha.npy"),
        "beta": str(root / "beta.npy"),
    }
    write_byte_memmap(files["alpha"], 7 * T + 5)
    write_byte_memmap(files["beta"], 4 * T, skip_bytes=100_000)
    evaluator = {"label": "ppl", "data": {"datasets": {k: [v] for k, v in files.items()}}}
    cfg = TrainConfig.from_dict(
        tiny_config_dict(root / "run", [files["alpha"]], evaluators=[evaluator], device_eval_batch_size=3)
    )
    torch.manual_seed(0)
    return cfg, OLMo(cfg.model), files


def _instances(path: str) -> list[torch.Tensor]:
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    return [torch.from_numpy(tokens[i * T : (i + 1) * T].astype(np.int64)) for i in range(len(tokens) // T)]


@torch.no_grad()
def _token_losses(model: OLMo, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[None]).logits[0]  # (T, V)
    return F.cross_entropy(logits[:-1], ids[1:], reduction="none")  # (T-1,)


def test_perplexity_is_exp_of_the_token_weighted_cross_entropy_per_label(lm_setup, evaluators_of):
    cfg, model, files = lm_setup
    [evaluator] = evaluators_of(cfg)
    metrics = evaluator.evaluate(model, CPU)

    assert set(metrics) == {f"eval/{label}/{m}" for label in files for m in ("CrossEntropyLoss", "Perplexity")}
    for label, path in files.items():
        total, count = 0.0, 0
        for ids in _instances(path):
            losses = _token_losses(model, ids)
            total += losses.sum().item()
            count += len(losses)
        assert metrics[f"eval/{label}/CrossEntropyLoss"] == pytest.approx(total / count, rel=1e-6)
        assert metrics[f"eval/{label}/Perplexity"] == pytest.approx(math.exp(total / count), rel=1e-6)


def test_masked_targets_are_skipped_and_instances_weigh_by_their_scored_tokens(tmp_path, evaluators_of):
    path = str(tmp_path / "tokens.npy")
    write_byte_memmap(path, 6 * T)
    mask = np.zeros(6 * T, dtype=np.bool_)
    for i in range(6):
        mask[i * T : i * T + 4 * (i + 1)] = True  # instance i scores 4(i+1) - 1 targets
    mask.tofile(tmp_path / "mask.npy")
    evaluator = {"label": "masked", "data": {"paths": [path], "label_mask_paths": [str(tmp_path / "mask.npy")]}}
    cfg = TrainConfig.from_dict(tiny_config_dict(tmp_path / "run", [path], evaluators=[evaluator]))
    torch.manual_seed(0)
    model = OLMo(cfg.model)

    ce = evaluators_of(cfg)[0].evaluate(model, CPU)["eval/masked/CrossEntropyLoss"]

    per_instance = []
    for i, ids in enumerate(_instances(path)):
        scored = torch.from_numpy(mask[i * T + 1 : (i + 1) * T])
        per_instance.append(_token_losses(model, ids)[scored])
    token_weighted = torch.cat(per_instance).mean().item()
    mean_of_means = torch.stack([losses.mean() for losses in per_instance]).mean().item()
    assert ce == pytest.approx(token_weighted, rel=1e-6)
    assert ce != pytest.approx(mean_of_means, rel=1e-4)  # OLMo's MeanMetric would give this


def test_two_rank_shares_are_disjoint_and_combine_to_the_single_rank_result(lm_setup, evaluators_of):
    cfg, model, files = lm_setup
    n_alpha = len(_instances(files["alpha"]))  # instances are numbered over the files in label order
    full = evaluators_of(cfg)[0].evaluate(model, CPU)
    shares = [evaluators_of(cfg, world_size=2, rank=rank)[0] for rank in (0, 1)]
    indices = [share.instance_indices() for share in shares]
    assert sorted(indices[0] + indices[1]) == list(range(n_alpha + len(_instances(files["beta"]))))
    assert len(indices[0]) == len(indices[1]) + 1

    share_metrics = [share.evaluate(model, CPU) for share in shares]
    for label in files:
        loss_sum = tokens = 0.0
        for metrics, share_indices in zip(share_metrics, indices):
            n_tokens = sum((i < n_alpha) == (label == "alpha") for i in share_indices) * (T - 1)
            if n_tokens:
                loss_sum += metrics[f"eval/{label}/CrossEntropyLoss"] * n_tokens
                tokens += n_tokens
        assert loss_sum / tokens == pytest.approx(full[f"eval/{label}/CrossEntropyLoss"], rel=1e-6)


def test_subset_num_batches_limits_the_forward_passes_of_each_rank(lm_setup, evaluators_of):
    cfg, model, _ = lm_setup
    calls = []
    hook = model.register_forward_hook(lambda module, args, out: calls.append(args[0].shape))
    try:
        evaluator = LMEvaluator(
            "ppl",
            evaluators_of(cfg)[0].dataset,
            dataset_labels=["alpha", "beta"],
            batch_size=2,
            subset_num_batches=2,
            world_size=2,
            rank=1,
        )
        metrics = evaluator.evaluate(model, CPU)
    finally:
        hook.remove()
    assert calls == [torch.Size([2, T]), torch.Size([2, T])]
    assert len(evaluator.instance_indices()) == 4
    assert metrics  # the seeded order mixes labels, so a subset still scores something


def test_runs_in_eval_mode_without_grad_restores_the_mode_and_autocasts_when_asked(lm_setup, evaluators_of):
    cfg, model, _ = lm_setup
    [evaluator] = evaluators_of(cfg)
    seen = []

    def record(module, args, out):
        seen.append((module.training, torch.is_grad_enabled(), out.logits.dtype))

    hook = model.register_forward_hook(record)
    try:
        model.train()
        fp32 = evaluator.evaluate(model, CPU)
        assert model.training and torch.is_grad_enabled()
        assert set(seen) == {(False, False, torch.float32)}

        seen.clear()
        model.eval()
        bf16 = evaluator.evaluate(model, CPU, autocast_dtype=torch.bfloat16)
        assert not model.training
        assert set(seen) == {(False, False, torch.bfloat16)}
    finally:
        hook.remove()
        model.train()
    for key, value in fp32.items():
        assert bf16[key] == pytest.approx(value, rel=2e-2)
