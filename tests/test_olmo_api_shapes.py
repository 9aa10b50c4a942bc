"""The original OLMo's user-facing API through its own call shapes (issue 28): the tokenizer's truncation and
constructors, ``build_optimizer(train_config, model)``, ``MemMapDataset(path)``, ``IterableDataset``'s OLMo
arguments, the collator with tensors and ``attention_bias``, ``TrainConfig.new``, the custom-dataset helpers,
``olmo.util`` helpers, the model's building blocks against the model's own computation, the loss functions,
``OLMoBlock.reset_parameters`` and ``OLMo.from_checkpoint``."""

import collections
import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from olmo import OLMo, RotaryEmbedding, SwiGLU, Tokenizer, TrainConfig
from olmo.config import (
    BaseConfig,
    CustomDatasetCollatorConfig,
    CustomDatasetConfig,
    DataConfig,
    ModelConfig,
    TruncationDirection,
)
from olmo.data import IterableDataset, MemMapDataset, build_collator, build_custom_dataset
from olmo.data.collator import CustomDatasetDataCollator, DataCollator
from olmo.data.custom_datasets import extract_module_and_class
from olmo.data.util import get_document_lengths
from olmo.exceptions import OLMoConfigurationError
from olmo.model import BufferCache, OLMoBlock, OLMoLlamaBlock
from olmo.model.layers import apply_rotary, rotary_cos_sin
from olmo.optim import Optimizer, build_optimizer
from olmo.testing import (
    BYTE_EOS,
    run_train,
    tiny_config_dict,
    tiny_model_config,
    write_byte_memmap,
    write_byte_tokenizer,
    write_config,
)
from olmo.train import cross_entropy_loss, fused_loss_fn
from olmo.util import clean_opt, dir_is_empty, flatten_dict

TEXT = "The quick brown fox jumps over the lazy dog, " * 4


@pytest.fixture
def tokenizer(tmp_path) -> Tokenizer:
    return Tokenizer.from_pretrained(str(write_byte_tokenizer(tmp_path / "tokenizer.json")))


@pytest.mark.parametrize("special", [True, False])
@pytest.mark.parametrize("direction", ["right", "left"])
def test_tokenizer_truncates_as_olmos_does(tokenizer, special, direction):
    assert tokenizer.eos_token_id == BYTE_EOS  # from_pretrained: the last id, as in OLMo
    full = tokenizer.encode(TEXT, add_special_tokens=special)
    tokenizer.truncate_to, tokenizer.truncate_direction = 16, TruncationDirection(direction)
    for ids in (tokenizer.encode(TEXT, add_special_tokens=special), *tokenizer.encode_batch([TEXT], special)):
        assert len(ids) == 16
        body = full[:-1] if special else full
        kept = body[:15] if direction == "right" else body[-15:]
        assert ids == (kept + [BYTE_EOS] if special else (body[:16] if direction == "right" else body[-16:]))
    assert tokenizer.num_special_tokens_to_add() == 1 and tokenizer.add_special_tokens([5]) == [5, BYTE_EOS]


def test_build_optimizer_takes_the_train_config_too():
    cfg = TrainConfig.new(optimizer={"name": "adamw", "learning_rate": 0.1})
    model = OLMo(tiny_model_config())
    optimizer = build_optimizer(cfg, model)
    assert isinstance(optimizer, Optimizer) and optimizer.param_groups[0]["lr"] == 0.1
    assert type(build_optimizer(cfg.optimizer, model)) is type(optimizer)


def test_memmap_dataset_of_a_path_reads_1024_token_instances(tmp_path):
    np.arange(3000, dtype=np.uint16).tofile(tmp_path / "a.npy")
    dataset = MemMapDataset(tmp_path / "a.npy")
    assert len(dataset) == 2 and dataset[1]["input_ids"].tolist() == list(range(1024, 2048))


def test_iterable_dataset_takes_olmos_arguments():
    items = [[x] for x in range(20)]
    padded = IterableDataset(items, 3, world_size=3, rank=2, shuffle=False, drop_last=False)
    assert padded.total_size == 21 and [x["input_ids"][0] for x in padded] == [*range(2, 18, 3), 0]
    cut = IterableDataset(items, 2, world_size=2, rank=0, shuffle=False, max_examples=12)
    assert [x["input_ids"][0] for x in cut] == [0, 2, 4, 6, 8, 10]
    default = IterableDataset(items, 3, world_size=3, rank=0, shuffle=False)  # the trainer's rule: whole batches
    assert default.total_size == 18 and [x["index"] for x in default] == list(range(0, 18, 3))


def test_the_collator_takes_tensors_and_pads_attention_bias():
    collator = DataCollator(pad_direction="left", pad_token_id=9)
    batch = collator([torch.tensor([1, 2, 3]), torch.tensor([4, 5])])
    assert batch["input_ids"].tolist() == [[1, 2, 3], [9, 4, 5]]
    causal = [~torch.triu(torch.ones(n, n, dtype=torch.bool)) for n in (3, 2)]
    batch = collator(
        [{"input_ids": [1, 2, 3], "attention_bias": causal[0]}, {"input_ids": [4, 5], "attention_bias": causal[1]}]
    )
    assert batch["attention_bias"].shape == (2, 1, 3, 3)
    assert batch["attention_bias"][1, 0].tolist() == [[False] * 3, [False] * 3, [False, True, False]]


@dataclass
class _Labelled(BaseConfig):
    label: str
    paths: list[str]


def test_train_config_new_and_base_config_load(tmp_path, monkeypatch):
    assert TrainConfig.new(seed=2).seed == 2 and DataConfig.new().effective_memmap_dtype is np.uint16
    with pytest.raises(TypeError, match="memmap_dtype='int8'"):
        DataConfig.new(memmap_dtype="int8").effective_memmap_dtype  # noqa: B018
    assert isinstance(ModelConfig.new(d_model=64), BaseConfig)
    monkeypatch.setenv("OLMO_TEST_VALUE", "from-env")
    (tmp_path / "c.yaml").write_text(
        "label: ${oc.env:OLMO_TEST_VALUE}\npaths: ${path.glob:" + str(tmp_path) + "/*.yaml}\n"
    )
    loaded = _Labelled.load(tmp_path / "c.yaml")  # OLMo's BaseConfig.load, resolvers included
    assert loaded.label == "from-env" and loaded.paths == [str(tmp_path / "c.yaml")]
    cfg = tiny_config_dict(tmp_path / "run", ["x.npy"])
    write_config(tmp_path / "t.yaml", cfg)
    assert TrainConfig.load(tmp_path / "t.yaml", ["model.n_layers=3"]).model.n_layers == 3


def test_custom_dataset_helpers_work_in_python_and_training_refuses_them(tmp_path):
    cfg = TrainConfig.new()
    assert extract_module_and_class("foo.bar.Baz") == ("foo.bar", "Baz") and extract_module_and_class("x") == (
        None,
        "x",
    )
    cfg.data.custom_dataset = CustomDatasetConfig(name="collections.Counter", args={"x": 9})
    assert build_custom_dataset(cfg) == collections.Counter(x=9)
    cfg.data.custom_dataset = CustomDatasetConfig(name="uniform", module="random", collate_fn="random.uniform")
    assert build_collator(cfg) is random.uniform
    cfg.data.custom_dataset = CustomDatasetConfig(
        name="foo", collate_config=CustomDatasetCollatorConfig(input_id_field="tokens", doc_lens_field="lens")
    )
    collator = build_collator(cfg)
    assert isinstance(collator, CustomDatasetDataCollator)
    ids = torch.tensor([3, 4, 0, 5])
    batch = collator([{"tokens": ids, "lens": get_document_lengths(ids, 0)}])
    assert batch["input_ids"].tolist() == [[3, 4, 0, 5]] and batch["doc_lens"].tolist() == [[3, 1]]
    with pytest.raises(OLMoConfigurationError, match=r"cannot import 'Nope' from 'collections'"):
        cfg.data.custom_dataset = CustomDatasetConfig(name="collections.Nope")
        build_custom_dataset(cfg)
    write_byte_memmap(tmp_path / "a.npy", 5_000)
    train = tiny_config_dict(tmp_path / "run", [str(tmp_path / "a.npy")])
    train["data"]["custom_dataset"] = {"name": "collections.Counter"}
    with pytest.raises(OLMoConfigurationError, match=r"data.custom_dataset .* cannot train with scripts/train.py"):
        run_train(write_config(tmp_path / "c.yaml", train))
    assert not (tmp_path / "run").exists()


def test_util_helpers(tmp_path):
    assert clean_opt("--save-overwrite") == "save_overwrite=true" and clean_opt("--a.b=3") == "a.b=3"
    assert dir_is_empty(tmp_path / "missing") and dir_is_empty(tmp_path)
    (tmp_path / ".hidden").touch()
    assert not dir_is_empty(tmp_path)
    nested = {"a": 0, "b": {"e": [{"x": 1}, 2], "f": 1}}
    assert flatten_dict(nested) == {"a": 0, "b.e": [{"x": 1}, 2], "b.f": 1}
    assert flatten_dict(nested, include_lists=True) == {"a": 0, "b.e.0.x": 1, "b.e.1": 2, "b.f": 1}


def test_building_blocks_compute_what_the_model_computes():
    cfg = tiny_model_config(max_sequence_length=32)
    q, k = torch.randn(2, 4, 3, 8), torch.randn(2, 4, 7, 8)  # 3 queries after 4 cached keys
    rq, rk = RotaryEmbedding(cfg, BufferCache())(q, k)
    cos, sin = rotary_cos_sin(7, 8, cfg.rope_theta, q.device)
    assert torch.equal(rk, apply_rotary(k, cos, sin)) and torch.equal(rq, apply_rotary(q, cos[4:], sin[4:]))
    block = OLMo(cfg).transformer.blocks[0]
    x = torch.randn(2, 5, cfg.d_model)
    h = block.ff_proj(x)
    assert torch.equal(block.ff_out(SwiGLU(cfg)(h)), block.feed_forward(x))
    assert SwiGLU(cfg).output_multiplier == 0.5
    with pytest.raises(OLMoConfigurationError, match="OLMoLlamaBlock .* is not implemented"):
        OLMoLlamaBlock(0, cfg)


def test_olmos_loss_functions():
    logits, labels = torch.randn(12, 50), torch.randint(0, 50, (12,))
    labels[3] = -100
    loss, z = cross_entropy_loss(logits, labels, compute_z_loss=True, z_loss_multiplier=1e-4)
    assert torch.allclose(loss, F.cross_entropy(logits, labels, ignore_index=-100))
    expected_z = 1e-4 * (logits.logsumexp(-1).pow(2) * (labels != -100)).mean()
    assert torch.allclose(z, expected_z) and cross_entropy_loss(logits, labels)[1] is None
    assert torch.equal(fused_loss_fn(logits, labels)[0], loss)


def test_block_reset_parameters_draws_what_the_model_draws():
    cfg = tiny_model_config()
    torch.manual_seed(3)
    model = OLMo(cfg)
    torch.manual_seed(3)
    fresh = OLMo(cfg, init_params=False)
    t = fresh.transformer
    for module in (t.wte, *([t.ff_out] if t.ff_out is not None else [])):
        torch.nn.init.zeros_(module.weight)
    torch.manual_seed(3)
    fresh.reset_parameters()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    block = OLMoBlock(1, cfg, cache=BufferCache())
    block.reset_parameters()
    assert block.attn_out.weight.std() > 0


def test_olmo_from_checkpoint_loads_a_trained_run(tmp_path):
    write_byte_memmap(tmp_path / "a.npy", 5_000)
    config = write_config(
        tmp_path / "c.yaml",
        tiny_config_dict(tmp_path / "run", [str(tmp_path / "a.npy")], max_duration=2, save_interval_unsharded=2),
    )
    assert run_train(config) == 0
    model = OLMo.from_checkpoint(str(tmp_path / "run" / "step2-unsharded"))
    assert not model.training and model.config.d_model == 32
    ids = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        assert model(ids).logits.shape == (1, 8, 320)


def test_build_eval_dataloader_splits_the_instances_over_ranks(tmp_path, monkeypatch):
    from olmo.data import build_eval_dataloader

    np.arange(4 * 32, dtype=np.uint16).tofile(tmp_path / "a.npy")  # 4 instances of 32 tokens
    cfg = TrainConfig.from_dict(tiny_config_dict(tmp_path / "run", [str(tmp_path / "a.npy")]))
    seen = []
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", "29500")
        batches = list(build_eval_dataloader(cfg, cfg.data, batch_size=2, shuffle=False))
        assert len(batches) == 1 and batches[0]["input_ids"].shape == (2, 32)
        seen += [int(row[0]) // 32 for row in batches[0]["input_ids"]]
    assert sorted(seen) == [0, 1, 2, 3]


def test_olmos_checkpointer_objects_save_restore_and_unshard(tmp_path):
    from olmo.checkpoint import FullCheckpointer, LocalShardedCheckpointer, build_sharded_checkpointer
    from olmo.exceptions import OLMoCheckpointError

    cfg = TrainConfig.new(
        model=dict(tiny_model_config().__dict__), optimizer={"name": "adamw", "learning_rate": 0.01}
    )

    def trained(seed: int):
        torch.manual_seed(seed)
        model = OLMo(cfg.model)
        optim = build_optimizer(cfg, model)
        model(torch.randint(1, 100, (2, 8))).logits.sum().backward()
        optim.step()
        return model, optim

    model, optim = trained(0)
    state = {"global_step": 1, "note": "mine"}
    for checkpointer, name in (
        (FullCheckpointer(cfg), "step1-unsharded"),
        (build_sharded_checkpointer(cfg), "step1"),
    ):
        checkpointer.save_checkpoint(tmp_path / name, model, optim, state)
        other, other_optim = trained(1)
        assert checkpointer.restore_checkpoint(tmp_path / name, other, other_optim)["note"] == "mine"
        for a, b in zip(model.state_dict().values(), other.state_dict().values()):
            assert torch.equal(a, b)
        moments = [s["exp_avg"] for s in optim.state.values()]
        assert all(torch.equal(x, s["exp_avg"]) for x, s in zip(moments, other_optim.state.values()))
        weights, optim_state, trainer = checkpointer.unshard_checkpoint(tmp_path / name)
        assert trainer["note"] == "mine" and optim_state is not None
        assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    weights, _ = FullCheckpointer(cfg).load_checkpoint(tmp_path / "step1-unsharded", load_optimizer_state=False)
    assert torch.equal(weights["transformer.wte.weight"], model.transformer.wte.weight)
    assert isinstance(build_sharded_checkpointer(cfg), LocalShardedCheckpointer)
    with pytest.raises(
        OLMoCheckpointError, match="upload_to='s3://b/x' is not supported here: set remote_save_folder"
    ):
        FullCheckpointer(cfg).save_checkpoint(
            tmp_path / "step2-unsharded", model, optim, state, upload_to="s3://b/x"
        )
    with pytest.raises(OLMoCheckpointError, match="already exists"):
        FullCheckpointer(cfg).save_checkpoint(tmp_path / "step1-unsharded", model, optim, state)


def test_generate_py_continues_an_original_olmo_checkpoint(tmp_path, capsys):
    """An unsharded checkpoint written by ai2-olmo 0.6.0 (64-token vocabulary), with a word-level tokenizer of its
    64 ids: generate.py's greedy tokens are those of a loop of full forwards over the same weights."""
    import json as _json

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    from olmo.testing import REPO, run_main

    checkpoint = REPO / "tests/fixtures/olmo_checkpoints/ddp/step2-unsharded"
    vocab = {f"t{i}": i for i in range(64)}
    words = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="t1"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.save(str(tmp_path / "words.json"))
    args = ["--prompt=t5 t9 t3 t7", "--max_new_tokens=6", f"--tokenizer={tmp_path / 'words.json'}", "--json"]
    assert run_main("generate.py", checkpoint, *args) == 0
    result = _json.loads(capsys.readouterr().out)
    model = OLMo.from_checkpoint(str(checkpoint))
    ids = torch.tensor([[5, 9, 3, 7]])
    expected = []
    with torch.no_grad():
        for _ in range(6):
            nxt = int(model(ids).logits[0, -1].argmax())
            if nxt == model.config.eos_token_id:
                break
            expected.append(nxt)
            ids = torch.cat((ids, torch.tensor([[nxt]])), dim=1)
    assert result["prompt_token_ids"] == [5, 9, 3, 7] and result["token_ids"] == expected
