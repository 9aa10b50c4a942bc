"""The command-line tools, run as a user runs them."""

import gzip
import json
import os
from pathlib import Path

import numpy as np
import pytest

from olmo.testing import run_script, run_train, tiny_config_dict, write_byte_memmap, write_config
from olmo.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "tests/golden/tiny_losses.json"


def test_prepare_memmap_dataset_writes_the_tokenizers_ids_with_eos(tmp_path):
    docs = ["The quick brown fox.", "Jumps over\nthe lazy dog!", "  ", "Ünïcødé text"]
    src = tmp_path / "docs"
    src.mkdir()
    with gzip.open(src / "part.jsonl.gz", "wt") as f:
        for doc in docs[:3]:
            f.write(json.dumps({"text": doc, "id": 1}) + "\n")
    (src / "note.txt").write_text(docs[3])
    out = tmp_path / "tokens"
    result = run_script("prepare_memmap_dataset.py", src / "part.jsonl.gz", src / "note.txt", "-o", out)
    assert result.returncode == 0, result.stderr
    tok = Tokenizer.from_file("allenai_gpt-neox-olmo-dolma-v1_5.json")
    expected = [i for doc in (docs[0], docs[1], docs[3]) for i in tok.encode(doc)]  # the blank doc is skipped
    written = np.memmap(out / "part-00000.npy", dtype=np.uint16, mode="r")
    assert written.tolist() == expected
    assert expected.count(50279) == 3
    assert "1 empty documents skipped" in result.stderr


def test_quickstart_path_trains_on_olmo_tokens(tmp_path):
    """The README quickstart in miniature: stdlib source -> OLMo tokens -> tiny OLMo -> loss falls, with the
    config's in-loop perplexity and PIQA evaluators."""
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = sorted(stdlib.glob("*.py"))[:14]
    for split, files in (("train", sources[:12]), ("val", sources[12:])):
        result = run_script("prepare_memmap_dataset.py", *files, "-o", tmp_path / "data/quickstart" / split)
        assert result.returncode == 0, result.stderr
    result = run_script(
        "train.py",
        REPO / "configs/tiny/OLMo-tiny.yaml",
        "--max_duration=150",
        "--stop_at=6",
        "--model.n_layers=1",
        # Half the config's batch (still two micro-batches a step): the loss falls as far in 6 steps, in half the time.
        "--global_train_batch_size=4",
        "--device_train_microbatch_size=2",
        "--save_interval_unsharded=3",
        "--scheduler.t_warmup=2",
        "--console_log_interval=1",
        # The config's two evaluators, with PIQA cut to one batch of 4 questions to keep this test quick.
        "--evaluators=[{label: stdlib-validation, type: lm, data: {paths: [data/quickstart/val/part-00000.npy]}},"
        " {label: piqa, type: downstream, subset_num_batches: 1}]",
        "--device_eval_batch_size=4",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "runs/OLMo-tiny"
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [m["train/CrossEntropyLoss"] for m in lines if "train/CrossEntropyLoss" in m]
    assert len(losses) == 6 and losses[-1] < losses[0] - 1.5, losses  # starts near ln(50k) = 10.8
    evals = [m for m in lines if "eval/seconds" in m]
    assert [m["step"] for m in evals] == [6]  # eval_interval 50, and always at the last step
    assert 0 < evals[0]["eval/stdlib-validation/CrossEntropyLoss"] < losses[0]
    assert 0 <= evals[0]["eval/downstream/piqa_acc"] <= 1
    assert (run / "train_data/global_indices.npy").is_file()
    assert {p.name for p in run.glob("step*")} == {"step3-unsharded", "step6-unsharded"}


def test_golden_loss_curve(tmp_path):
    """A refactor that changes the numerics of the tiny config shows up here (tolerance for BLAS noise)."""
    write_byte_memmap(tmp_path / "a.npy", 20_000)
    record = []
    config = write_config(
        tmp_path / "c.yaml",
        tiny_config_dict(
            tmp_path / "run", [str(tmp_path / "a.npy")], max_duration=10, save_interval_unsharded=None
        ),
    )
    assert run_train(config, record=record) == 0
    losses = [r["train/CrossEntropyLoss"] for r in record]
    if os.environ.get("OLMO_UPDATE_GOLDEN"):
        GOLDEN.write_text(json.dumps({"losses": losses}, indent=1) + "\n")
    np.testing.assert_allclose(losses, json.loads(GOLDEN.read_text())["losses"], rtol=2e-3)


@pytest.mark.parametrize("argv", [[], ["--run_name=x"]])
def test_train_without_a_config_prints_usage(argv):
    result = run_script("train.py", *argv)
    assert result.returncode != 0
    assert "Usage:" in result.stderr and "Traceback" not in result.stderr


def test_eval_script_reproduces_the_in_loop_evaluation_and_plots_are_drawn(tmp_path):
    write_byte_memmap(tmp_path / "train.npy", 20_000)
    write_byte_memmap(tmp_path / "val.npy", 5_000, skip_bytes=500_000)
    evaluators = [{"label": "val", "type": "lm", "data": {"paths": [str(tmp_path / "val.npy")]}}]
    cfg = tiny_config_dict(
        tmp_path / "run",
        [str(tmp_path / "train.npy")],
        max_duration=4,
        eval_interval=4,
        save_interval_unsharded=4,
        evaluators=evaluators,
    )
    record = []
    assert run_train(write_config(tmp_path / "c.yaml", cfg), record=record) == 0
    in_loop = next(r for r in record if "eval/seconds" in r)
    result = run_script("eval.py", tmp_path / "run/step4-unsharded", f"--out={tmp_path / 'eval.json'}")
    assert result.returncode == 0, result.stderr[-3000:]
    standalone = json.loads((tmp_path / "eval.json").read_text())
    assert standalone["step"] == 4
    for key in ("eval/val/CrossEntropyLoss", "eval/val/Perplexity"):
        assert standalone[key] == pytest.approx(in_loop[key], rel=1e-6), key
    assert "eval/val/Perplexity" in result.stderr  # the table

    result = run_script("plot_metrics.py", tmp_path / "run", "--out", tmp_path / "plots")
    assert result.returncode == 0, result.stderr[-3000:]
    names = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert names == ["eval_val.png", "learning_rate.png", "loss.png", "throughput.png"]
    assert all((tmp_path / "plots" / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for n in names)
