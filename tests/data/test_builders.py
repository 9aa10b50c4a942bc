import numpy as np
import pytest

from olmo.config import DataConfig, TrainConfig
from olmo.data import build_memmap_dataset, build_train_dataloader
from olmo.exceptions import OLMoConfigurationError, OLMoDataError


def write_config(tmp_path, paths, **extra):
    lines = [
        "model:",
        "  max_sequence_length: 8",
        "  vocab_size: 512",
        "  embedding_size: 512",
        "  pad_token_id: 1",
        "  eos_token_id: 0",
        "data:",
        f"  paths: [{', '.join(paths)}]",
        "global_train_batch_size: 4",
        f"save_folder: {tmp_path / 'run'}",
    ] + [f"{k}: {v}" for k, v in extra.items()]
    path = tmp_path / "train.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def inspect_batch(train_config_path, data_order_file_path, s):
    """The inspection snippet of docs/mixtures.md, verbatim, collecting each instance's token ids."""
    cfg = TrainConfig.load(train_config_path)
    dataset = build_memmap_dataset(cfg, cfg.data)
    batch_size = cfg.global_train_batch_size
    global_indices = np.memmap(data_order_file_path, mode="r+", dtype=np.uint32)
    batch = []
    for index in global_indices[s * batch_size : (s + 1) * batch_size]:
        token_ids = dataset[index]["input_ids"].tolist()
        batch.append(token_ids)
    return batch


def test_design_snippet_returns_the_batches_the_dataloader_yields(write_memmap, tmp_path):
    rng = np.random.default_rng(0)
    paths = [write_memmap(f"part-{i}.npy", rng.integers(0, 512, size=8 * 9 + i)) for i in range(3)]
    train_config_path = write_config(tmp_path, paths, seed=1234)
    loader = build_train_dataloader(TrainConfig.load(train_config_path), world_size=1)
    trained = [batch["input_ids"].tolist() for batch in loader]
    assert len(trained) == 27 // 4
    order_file = tmp_path / "run" / "train_data" / "global_indices.npy"
    assert [inspect_batch(train_config_path, order_file, s) for s in range(len(trained))] == trained


def test_dataloader_rank_batches_follow_the_order_file(write_memmap, tmp_path):
    path = write_memmap("a.npy", np.arange(8 * 20) % 512)
    cfg = TrainConfig.load(write_config(tmp_path, [path]))
    rank1 = build_train_dataloader(cfg, world_size=2, rank=1, work_dir=tmp_path / "r1")
    rank0 = build_train_dataloader(cfg, world_size=2, rank=0)
    order = np.memmap(tmp_path / "run" / "train_data" / "global_indices.npy", dtype=np.uint32, mode="r")
    for s, (b0, b1) in enumerate(zip(rank0, rank1)):
        assert b0["index"].tolist() + b1["index"].tolist() == order[s * 4 : (s + 1) * 4][[0, 2, 1, 3]].tolist()
    assert not (tmp_path / "r1").exists()


def test_datasets_get_sorted_labels_and_globs_expand(write_memmap, tmp_path):
    a = write_memmap("web-0.npy", range(8))
    b = write_memmap("web-1.npy", range(8, 16))
    c = write_memmap("code.npy", range(16, 24))
    cfg = TrainConfig.from_dict({"model": {"max_sequence_length": 8}})
    ds = build_memmap_dataset(cfg, DataConfig(datasets={"web": [str(tmp_path / "web-*.npy")], "code": [c]}))
    assert [ds[i]["metadata"] for i in range(3)] == [
        {"path": c, "label": "code"},
        {"path": a, "label": "web"},
        {"path": b, "label": "web"},
    ]
    with pytest.raises(OLMoDataError, match=r"data\.paths entry .*nothing-\*\.npy.*matches no file"):
        build_memmap_dataset(cfg, DataConfig(paths=[str(tmp_path / "nothing-*.npy")]))


def test_no_data_is_a_config_error():
    cfg = TrainConfig()
    with pytest.raises(OLMoConfigurationError, match="data.paths"):
        build_memmap_dataset(cfg, cfg.data)
