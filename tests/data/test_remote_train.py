"""Training on token files served by a real HTTP server on 127.0.0.1, through scripts/train.py: the same batches as
the same files read locally (1 process, DataLoader workers, 2 ranks), an exact resume, a clean stop when the server
fails for good, and every byte fetched accounted for."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from olmo.checkpoint import list_checkpoints
from olmo.cli.inspect_batch import main as inspect_batch
from olmo.data import read_data_indices
from olmo.data.remote import RemoteUnreachable
from olmo.testing import run_torchrun, run_train, tiny_config_dict, write_byte_corpus, write_config
from olmo.testing.http import FileServer

STEPS, BATCH, SEQ = 8, 8, 32


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    for path in write_byte_corpus(root):
        n = Path(path).stat().st_size // 2
        (np.arange(n) % 4 > 0).tofile(Path(path).with_name(Path(path).stem + "_mask.npy"))
    return root


@pytest.fixture(scope="module")
def server(corpus):
    with FileServer(corpus) as server:
        yield server


def _config(tmp_path: Path, base: str, **overrides) -> Path:
    held_out = {"label": "held-out", "type": "lm", "data": {"paths": [f"{base}/b.npy"]}, "subset_num_batches": 2}
    cfg = tiny_config_dict(
        tmp_path / "run",
        [f"{base}/a.npy", f"{base}/b.npy"],
        **{
            "max_duration": STEPS,
            "save_interval_unsharded": 4,
            "evaluators": [held_out],
            "eval_interval": STEPS,
            "data.label_mask_paths": [f"{base}/a_mask.npy", f"{base}/b_mask.npy"],
            "data.instance_filter": {"repetition_max_count": 4},
            "data.remote": {"max_attempts": 2, "backoff_seconds": 0.01},
            **overrides,
        },
    )
    return write_config(tmp_path / "config.yaml", cfg)


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _fetched(run: Path) -> int:
    """Bytes the training data cost the last launch (as its last training step logged them)."""
    return [m for m in _metrics(run) if "throughput/data_bytes_fetched" in m][-1]["throughput/data_bytes_fetched"]


def _losses(run: Path) -> list[float]:
    return [m["train/CrossEntropyLoss"] for m in _metrics(run) if "train/CrossEntropyLoss" in m]


def _weights(checkpoint: Path) -> dict:
    return torch.load(checkpoint / "model.pt", weights_only=True)


def _same_weights(a: Path, b: Path) -> bool:
    wa, wb = _weights(a), _weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_remote_training_matches_local_resumes_exactly_and_stops_cleanly(tmp_path, corpus, server):
    """Training, in-loop evaluation, the resume and inspect_batch, all on remote files."""
    assert run_train(_config(tmp_path / "local", str(corpus))) == 0
    local = tmp_path / "local/run"
    url = server.url().rstrip("/")

    # Uninterrupted, with the instances fetched ahead in two DataLoader workers.
    server.clear_log()
    assert run_train(_config(tmp_path / "remote", url, **{"data.num_workers": 2})) == 0
    remote = tmp_path / "remote/run"
    assert _losses(remote) == _losses(local)  # bitwise: the same batches
    assert _same_weights(remote / "step8-unsharded", local / "step8-unsharded")
    assert read_data_indices(remote) == read_data_indices(local)
    assert read_data_indices(remote, filtered=True) == read_data_indices(local, filtered=True) != {}
    # Every byte fetched is a header probe (one per file) or a token or mask of an instance trained on, or of
    # one of the batches that the DataLoader's workers load ahead (prefetch_factor 2 each) when the run ends.
    probes = sum(min(1024, (corpus / n).stat().st_size) for n in ("a.npy", "b.npy", "a_mask.npy", "b_mask.npy"))
    instance = SEQ * (2 + 1)  # uint16 tokens and a bool mask
    fetched = _fetched(remote)  # counted in the workers too
    assert STEPS * BATCH * instance <= fetched - probes <= (STEPS + 2 * 2) * BATCH * instance
    assert all(r.range is not None for r in server.log if r.method == "GET")
    assert (remote / "train_data/remote_files.json").is_file()
    evals = [
        [m["eval/held-out/CrossEntropyLoss"] for m in _metrics(r) if "eval/seconds" in m] for r in (remote, local)
    ]
    assert evals[0] == evals[1] != []

    # inspect_batch fetches the batch it shows and nothing else (sizes come from the run's record).
    server.clear_log()
    rows = inspect_batch([str(remote), "--step", "3"])
    assert [r.index for r in rows] == read_data_indices(local)[3][0]
    assert [r.method for r in server.log].count("HEAD") == 4
    assert server.body_bytes() == BATCH * SEQ * (2 + 1)

    # Interrupted at step 4; the relaunch meets a server that fails every read.
    part = tmp_path / "part/run"
    config = _config(tmp_path / "part", url, stop_at=4)
    assert run_train(config) == 0
    server.inject("503", count=-1)
    try:
        with pytest.raises(
            RemoteUnreachable, match=r"bytes \d+-\d+ of 'http://127.*\.npy' after 2 attempts.*HTTP 503"
        ):
            run_train(config, "--try_load_latest_save", "--stop_at=null")
    finally:
        server.clear_faults()
    assert [(c.step, c.sharded) for c in list_checkpoints(part)] == [(4, False)]  # untouched, nothing newer
    assert run_train(config, "--try_load_latest_save", "--stop_at=null") == 0
    assert _losses(part)[-4:] == _losses(remote)[-4:]
    # Without workers, exactly the instances trained on; a relaunch checks sizes against its record (no probes).
    assert _fetched(part) == 4 * BATCH * instance
    assert _same_weights(part / "step8-unsharded", remote / "step8-unsharded")


def test_two_ranks_read_remote_data_as_one_process_reads_it_locally(tmp_path, corpus, server):
    assert run_train(_config(tmp_path / "local", str(corpus), max_duration=4)) == 0
    result = run_torchrun(2, _config(tmp_path / "remote", server.url().rstrip("/"), max_duration=4))
    assert result.returncode == 0, result.stderr[-4000:]
    local, remote = tmp_path / "local/run", tmp_path / "remote/run"
    # Rank r trains on every second entry of each global batch from r: together, the batch the process read.
    by_rank = read_data_indices(remote)
    merged = {step: [i for pair in zip(ranks[0], ranks[1]) for i in pair] for step, ranks in by_rank.items()}
    assert merged == {step: ranks[0] for step, ranks in read_data_indices(local).items()}
    np.testing.assert_allclose(_losses(remote), _losses(local), rtol=1e-5)  # FSDP reduces in another order
    assert (remote / "train_data/global_indices.npy").read_bytes() == (
        local / "train_data/global_indices.npy"
    ).read_bytes()
