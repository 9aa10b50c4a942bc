"""An OLMo Hybrid model (Gated DeltaNet layers beside attention, ``model.layer_types``) trained like every other model
through scripts/train.py: it resumes bitwise, compiled blocks train like eager ones, 2 FSDP ranks equal 1 process, a
mixture of experts trains beside Gated DeltaNet, DPO (with or without a right-padding attention mask) and packed SFT
work, the ladder sizes it, and tensor and context parallelism are refused before launch naming the key."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from olmo.exceptions import OLMoConfigurationError
from olmo.testing import (
    BYTE_EOS,
    metric_by_step,
    run_main,
    run_torchrun,
    run_train,
    tiny_config_dict,
    write_byte_corpus,
    write_byte_tokenizer,
    write_config,
)

PATTERN = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
HYBRID = {
    "model.n_layers": 4,
    "model.n_heads": 4,
    "model.layer_types": PATTERN,
    # Grouped value heads (4 share 2 query/key heads), and the value heads wider than the keys.
    "model.linear_attention": {"num_key_heads": 2, "num_value_heads": 4, "key_head_dim": 8, "value_head_dim": 12},
    "model.norm_after": True,
    "model.layer_norm_type": "rms",
    "model.attention_layer_norm": True,
    "data.generate_doc_lengths": True,
}
"""OLMo Hybrid's kind, tiny: three Gated DeltaNet layers then one attention layer (OLMo 3's: norm after, QK-norm),
resetting at document starts."""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_byte_corpus(tmp_path_factory.mktemp("corpus"))


def _config(folder: Path, data: list[str], **overrides) -> Path:
    return write_config(folder / "config.yaml", tiny_config_dict(folder / "run", data, **{**HYBRID, **overrides}))


def _losses(record: list[dict]) -> list[float]:
    return [r["train/CrossEntropyLoss"] for r in record if "train/CrossEntropyLoss" in r]


def test_a_hybrid_resumes_bitwise(tmp_path, corpus):
    """Stopped after 4 of 8 steps and resumed from its checkpoint: the same losses and the same final weights, to the
    bit (dropout included: its RNG state is restored too)."""
    dropout = {"model.residual_dropout": 0.1, "max_duration": 8, "save_interval_unsharded": 4}
    full, resumed = [], []
    assert run_train(_config(tmp_path / "full", corpus, **dropout), record=full) == 0
    part = _config(tmp_path / "part", corpus, stop_at=4, **dropout)
    assert run_train(part, record=resumed) == 0
    assert run_train(part, "--try_load_latest_save", "--stop_at=null", record=resumed) == 0
    assert [r["step"] for r in resumed] == list(range(1, 9))
    assert _losses(resumed) == _losses(full)
    assert _losses(full)[-1] < _losses(full)[0] - 0.5
    a = torch.load(tmp_path / "full/run/step8-unsharded/model.pt", weights_only=True)
    b = torch.load(tmp_path / "part/run/step8-unsharded/model.pt", weights_only=True)
    assert a.keys() == b.keys() and "transformer.blocks.0.q_proj.weight" in a
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_compiled_hybrid_blocks_train_like_eager_ones(tmp_path, corpus):
    """torch.compile(fullgraph=True) of every block, the chunked delta rule included: the same losses as eager to
    float rounding, over 130-token instances (three of the delta rule's 64-token chunks, whose pass the compiled
    graph takes with one scan step instead of one copy per chunk) and the documents in them."""
    losses = {}
    for name, compile_cfg in (("eager", None), ("compiled", {"fullgraph": True})):
        record: list[dict] = []
        short = {
            "max_duration": 2,
            "save_interval_unsharded": None,
            "scheduler.t_warmup": 1,
            "model.max_sequence_length": 130,
            "global_train_batch_size": 4,
            "device_train_microbatch_size": 2,
        }
        assert run_train(_config(tmp_path / name, corpus, compile=compile_cfg, **short), record=record) == 0
        losses[name] = _losses(record)
    assert len(losses["eager"]) == 2
    np.testing.assert_allclose(losses["compiled"], losses["eager"], rtol=1e-5)


@pytest.mark.slow
def test_two_fsdp_ranks_train_a_hybrid_like_one_process(tmp_path, corpus):
    """Gloo, 2 ranks each with half of every micro-batch, FSDP sharding the Gated DeltaNet parameters (A_log,
    dt_bias and the convolutions too): the losses and the final weights of one process."""
    weights = {}
    for name, nproc in (("one", 1), ("two", 2)):
        config = _config(tmp_path / name, corpus, max_duration=4, save_interval_unsharded=4)
        if nproc == 1:
            assert run_train(config) == 0
        else:
            result = run_torchrun(2, config, timeout=300)
            assert result.returncode == 0, result.stderr[-4000:]
        weights[name] = (
            list(metric_by_step(tmp_path / name / "run").values()),
            torch.load(tmp_path / name / "run/step4-unsharded/model.pt", weights_only=True),
        )
    assert len(weights["one"][0]) == 4
    np.testing.assert_allclose(weights["two"][0], weights["one"][0], rtol=1e-5)
    for key, value in weights["one"][1].items():
        torch.testing.assert_close(weights["two"][1][key], value, rtol=1e-4, atol=1e-5)


def test_a_mixture_of_experts_trains_beside_gated_deltanet(tmp_path, corpus):
    """Every block's feed-forward a mixture of experts, the linear-attention layers' and the attention layer's alike;
    the router metrics logged, and the loss falls."""
    moe = {"num_experts": 4, "top_k": 2, "hidden_size": 16, "lb_loss_weight": 0.01, "z_loss_weight": 0.001}
    record: list[dict] = []
    config = _config(tmp_path, corpus, **{"model.moe": moe, "max_duration": 8, "save_interval_unsharded": 8})
    assert run_train(config, record=record) == 0
    losses = _losses(record)
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.5
    assert all(r["train/load_balancing_loss"] > 0 for r in record if "train/CrossEntropyLoss" in r)
    state = torch.load(tmp_path / "run/step8-unsharded/model.pt", weights_only=True)
    for layer in range(4):  # experts in every layer, the Gated DeltaNet ones (0-2) included
        assert state[f"transformer.blocks.{layer}.moe.router.weight"].shape == (4, 32), layer
    assert state["transformer.blocks.0.A_log"].shape == (4,) and "transformer.blocks.3.att_proj.weight" in state


def _pairs(n: int) -> list[dict]:
    out = []
    for i in range(n):
        question = [{"role": "user", "content": f"{i}+{i + 1}?"}]
        out.append(
            {
                "chosen": question + [{"role": "assistant", "content": f"{2 * i + 1}."}],
                "rejected": question + [{"role": "assistant", "content": f"{2 * i + 3}, I think so!"}],
            }
        )
    return out


def test_dpo_trains_a_hybrid_with_or_without_a_right_padding_mask(tmp_path, corpus):
    """DPO from a hybrid model: its pairs are padded on the right, which a causal recurrence never carries back into
    the answer's tokens, so a run with ``data.generate_attention_mask`` (the mask passed to every layer) logs the
    losses of a run without it; both learn the preference."""
    seq = 48
    tokenizer = write_byte_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in _pairs(16)))
    args = ["-o", tmp_path / "pref", "--seq-len", seq, "-t", tokenizer, "--eos", BYTE_EOS, "--pad", 1]
    assert run_main("prepare_preference_data.py", tmp_path / "pairs.jsonl", *args) == 0
    padded = np.fromfile(tmp_path / "pref/input_ids.npy", dtype=np.uint16).reshape(-1, seq)
    real = padded != 1
    assert not (real[:, 1:] & ~real[:, :-1]).any() and (~real).any()  # padding, on the right only
    pad = {"model.pad_token_id": 1, "model.max_sequence_length": seq}
    base = _config(tmp_path / "sft", corpus, max_duration=2, save_interval_unsharded=2, **pad)
    assert run_train(base) == 0
    dpo = {
        **pad,
        "data.label_mask_paths": [str(tmp_path / "pref/label_mask.npy")],
        "data.generate_doc_lengths": False,
        "dpo.enabled": True,
        "dpo.beta": 0.5,
        "load_path": str(tmp_path / "sft/run/step2-unsharded"),
        "reset_trainer_state": True,
        "optimizer.learning_rate": 1e-3,
        "scheduler.t_warmup": 1,
        "max_duration": 4,
        "save_interval_unsharded": None,
    }
    losses = {}
    for name, mask in (("unmasked", False), ("masked", True)):
        pref = [str(tmp_path / "pref/input_ids.npy")]
        config = _config(tmp_path / name, pref, **dpo, **{"data.generate_attention_mask": mask})
        assert run_train(config) == 0
        losses[name] = list(metric_by_step(tmp_path / name / "run", "train/dpo/loss").values())
    assert losses["unmasked"][0] == pytest.approx(math.log(2), abs=1e-6)  # policy = reference at the first step
    assert losses["unmasked"][-1] < losses["unmasked"][0]
    np.testing.assert_allclose(losses["masked"], losses["unmasked"], rtol=1e-5)


def test_a_hybrid_honours_right_padding_and_refuses_padding_between_real_tokens(tmp_path):
    """The real tokens of a right-padded row give the logits of the unpadded row (left padding: generation's tests);
    a mask with padding between real tokens is refused."""
    from olmo.config import TrainConfig
    from olmo.model import OLMo

    torch.manual_seed(0)
    model = OLMo(TrainConfig.from_dict(tiny_config_dict(tmp_path, [], **HYBRID)).model).eval()
    ids = torch.randint(1, 200, (2, 12))
    right = torch.ones_like(ids)
    right[1, 9:] = 0
    with torch.no_grad():
        masked = model(ids, attention_mask=right).logits
        plain = model(ids).logits
    torch.testing.assert_close(masked[0], plain[0])
    torch.testing.assert_close(masked[1, :9], plain[1, :9])
    hole = torch.ones_like(ids)
    hole[1, 4] = 0
    with pytest.raises(ValueError, match="attention_mask has padding between real tokens"):
        model(ids, attention_mask=hole)


def _conversations(n: int) -> list[dict]:
    out = []
    for i in range(n):
        turns = [{"role": "user", "content": f"{i}+{2 * i}?"}, {"role": "assistant", "content": f"{3 * i}."}]
        if i % 3 == 0:
            turns += [{"role": "user", "content": "Sure?"}, {"role": "assistant", "content": "Yes."}]
        out.append({"messages": turns})
    return out


def test_packed_conversations_train_a_hybrid_like_one_per_instance(tmp_path):
    """``prepare_sft_data.py --pack`` with ``data.generate_doc_lengths``: each conversation's Gated DeltaNet state and
    convolution window start afresh at its first token, so packed and one per instance give the same loss and
    gradient norm (conversations cross the delta rule's 64-token chunks)."""
    seq = 128
    tokenizer = write_byte_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in _conversations(12)))
    args = ["--seq-len", seq, "-t", tokenizer, "--eos", BYTE_EOS, "--pad", 1, "--chat-template", "olmo3"]
    for name, flags in (("one", []), ("packed", ["--pack"])):
        assert run_main("prepare_sft_data.py", tmp_path / "chat.jsonl", "-o", tmp_path / name, *args, *flags) == 0
    rows = {n: np.fromfile(tmp_path / n / "input_ids.npy", dtype=np.uint16).size // seq for n in ("one", "packed")}
    assert rows["one"] == 12 and rows["packed"] < 10
    results = {}
    for name in ("one", "packed"):
        config = _config(
            tmp_path / f"run-{name}",
            [str(tmp_path / name / "input_ids.npy")],
            **{
                "data.label_mask_paths": [str(tmp_path / name / "label_mask.npy")],
                "model.max_sequence_length": seq,
                "global_train_batch_size": rows[name],
                "device_train_microbatch_size": rows[name],
                "max_duration": 1,
                "save_interval_unsharded": None,
            },
        )
        assert run_train(config) == 0
        run = tmp_path / f"run-{name}" / "run"
        results[name] = (metric_by_step(run)[1], metric_by_step(run, "optim/total_grad_norm")[1])
    assert results["packed"][0] == pytest.approx(results["one"][0], rel=1e-5)
    assert results["packed"][1] == pytest.approx(results["one"][1], rel=1e-4)


def test_the_ladder_sizes_a_hybrid(tmp_path, capsys):
    """A ladder on a hybrid base config keeps its layer pattern at every size and counts each size's parameters as
    the model does; recurrence sizes fixed by the base (which would not scale) and sizes that cut the pattern are
    refused naming the key."""
    from olmo.config import TrainConfig
    from olmo.model import OLMo

    data = write_byte_corpus(tmp_path / "corpus")
    null_sizes = {"num_key_heads": None, "num_value_heads": None, "key_head_dim": None, "value_head_dim": None}
    base = _config(tmp_path / "base", data, **{"model.linear_attention": null_sizes})
    sizes = (
        "[{name: h32, d_model: 32, n_layers: 4, n_heads: 2}, {name: h64, d_model: 64, n_layers: 8, n_heads: 4}]"
    )
    args = [
        Path(__file__).resolve().parents[2] / "configs/ladder/tiny.yaml",
        f"--base_config={base}",
        f"--dir={tmp_path / 'ladder'}",
        "--train_overrides=[]",
        f"--sizes={sizes}",
        "--next_sizes=[]",
        "--sequence_length=32",
    ]
    assert run_main("ladder.py", "dry-run", *args, "--json") == 0
    plans = {p["size"]: p for p in json.loads(capsys.readouterr().out)}
    for name, (d_model, n_layers, n_heads) in {"h32": (32, 4, 2), "h64": (64, 8, 4)}.items():
        cfg = TrainConfig.load(base).model
        cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.max_sequence_length = d_model, n_layers, n_heads, 32
        with torch.device("meta"):
            model = OLMo(cfg)
        assert cfg.layer_kinds() == PATTERN * (n_layers // 4)
        assert plans[name]["num_non_embedding_params"] == model.num_params(include_embedding=False)
    assert plans["h64"]["num_non_embedding_params"] > 3 * plans["h32"]["num_non_embedding_params"]

    fixed = _config(tmp_path / "fixed", data)  # HYBRID's num_key_heads=2, key_head_dim=8, ...
    with pytest.raises(OLMoConfigurationError, match=r"model\.linear_attention\.num_key_heads=2.*null"):
        run_main("ladder.py", "dry-run", *args[:1], f"--base_config={fixed}", *args[2:])
    cut = "--sizes=[{name: h6, d_model: 32, n_layers: 6, n_heads: 2}]"
    with pytest.raises(OLMoConfigurationError, match=r"n_layers=6 is not a multiple of the 4 entries"):
        run_main("ladder.py", "dry-run", *args[:4], cut, *args[5:])


@pytest.mark.parametrize("key", ["tensor_parallel.degree", "context_parallel.degree"])
def test_tensor_and_context_parallelism_are_refused_before_launch(tmp_path, corpus, key):
    """scripts/train.py's own launch checks, before any process group, data or write: the sentence names the key and
    says why."""
    config = _config(tmp_path, corpus, **{"distributed_strategy": "fsdp"})
    with pytest.raises(
        OLMoConfigurationError, match=rf"{key}=2 with linear_attention layers \(model\.layer_types\)"
    ):
        run_train(config, f"--{key}=2")
    assert not (tmp_path / "run").exists()
