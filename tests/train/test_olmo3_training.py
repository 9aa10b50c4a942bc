"""Training an OLMo-3-shaped model (sliding windows shorter than the sequence, YaRN on the full-attention layer,
QK-norm, norm after, GQA, document masking) through scripts/train.py: it resumes bitwise, FSDP over 2 ranks
matches 1 process, compiled blocks match eager ones, and the throughput metrics count the window's FLOPs."""

import json

import numpy as np
import pytest
import torch

from olmo.testing import run_torchrun, run_train, tiny_config_dict, write_byte_corpus, write_config

OLMO3 = {
    "model.n_layers": 4,
    "model.n_heads": 4,
    "model.n_kv_heads": 2,
    "model.norm_after": True,
    "model.layer_norm_type": "rms",
    "model.attention_layer_norm": True,
    "model.rope_theta": 500000,
    "model.sliding_window": {"pattern": [8, 8, 8, -1], "force_full_attention_on_last_layer": True},
    "model.rope_scaling": {"name": "yarn", "factor": 4, "beta_fast": 32, "beta_slow": 1, "old_context_len": 8},
    "data.generate_doc_lengths": True,
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_byte_corpus(tmp_path_factory.mktemp("corpus"))


def _config(tmp_path, corpus, **overrides):
    return write_config(
        tmp_path / "config.yaml", tiny_config_dict(tmp_path / "run", corpus, **{**OLMO3, **overrides})
    )


def _losses(record):
    return [r["train/CrossEntropyLoss"] for r in record]


def test_a_windowed_model_resumes_bitwise_and_its_flops_count_the_window(tmp_path, corpus):
    dropout = {"model.residual_dropout": 0.1, "max_duration": 8}
    full, resumed, unwindowed = [], [], []
    assert run_train(_config(tmp_path / "full", corpus, **dropout), record=full) == 0
    part = _config(tmp_path / "part", corpus, stop_at=4, **dropout)
    assert run_train(part, record=resumed) == 0
    assert run_train(part, "--try_load_latest_save", "--stop_at=null", record=resumed) == 0
    assert [r["step"] for r in resumed] == list(range(1, 9))
    assert _losses(resumed) == _losses(full)  # bitwise on CPU
    a = torch.load(tmp_path / "full/run/step8-unsharded/model.pt", weights_only=True)
    b = torch.load(tmp_path / "part/run/step8-unsharded/model.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # The same run without windows: other losses (the window is in effect), and more FLOPs per token.
    windowless = _config(tmp_path / "nowin", corpus, **dropout, **{"model.sliding_window": None})
    assert run_train(windowless, "--stop_at=2", record=unwindowed) == 0
    assert _losses(unwindowed)[:2] != _losses(full)[:2]
    head, heads, seq, window = 32 // 4, 4, 32, 8
    saved = 3 * 12 * heads * head * (seq - window)  # three windowed layers see 8 keys, not 32
    flops = [json.loads(line) for line in (tmp_path / "full/run/metrics.jsonl").read_text().splitlines()]
    nowin = [json.loads(line) for line in (tmp_path / "nowin/run/metrics.jsonl").read_text().splitlines()]
    ratio = flops[1]["throughput/mfu"] / flops[1]["throughput/device/tokens_per_second"]
    ratio_nowin = nowin[1]["throughput/mfu"] / nowin[1]["throughput/device/tokens_per_second"]
    from olmo.config import TrainConfig
    from olmo.model import OLMo

    with torch.device("meta"):
        model = OLMo(TrainConfig.load(windowless).model)
    per_token = model.num_flops_per_token()
    assert ratio / ratio_nowin == pytest.approx((per_token - saved) / per_token, rel=1e-6)


def test_compiled_windowed_blocks_train_like_eager_ones(tmp_path, corpus):
    losses = {}
    for name, compile_cfg in (("eager", None), ("compiled", {"fullgraph": True})):
        record = []
        config = _config(
            tmp_path / name, corpus, max_duration=3, save_interval_unsharded=None, compile=compile_cfg
        )
        assert run_train(config, record=record) == 0
        losses[name] = _losses(record)
    np.testing.assert_allclose(losses["compiled"], losses["eager"], rtol=1e-4)


@pytest.mark.slow
def test_fsdp_two_ranks_train_a_windowed_model_like_one_process(tmp_path, corpus):
    weights = {}
    for name, nproc in (("one", 1), ("two", 2)):
        config = _config(tmp_path / name, corpus, max_duration=5, save_interval_unsharded=5)
        if nproc == 1:
            assert run_train(config) == 0
        else:
            result = run_torchrun(2, config)
            assert result.returncode == 0, result.stderr[-4000:]
        lines = (tmp_path / name / "run/metrics.jsonl").read_text().splitlines()
        weights[name] = (
            [json.loads(line)["train/CrossEntropyLoss"] for line in lines],
            torch.load(tmp_path / name / "run/step5-unsharded/model.pt", weights_only=True),
        )
    np.testing.assert_allclose(weights["two"][0], weights["one"][0], rtol=1e-5)
    for key, value in weights["one"][1].items():
        torch.testing.assert_close(weights["two"][1][key], value, rtol=1e-4, atol=1e-5)
