"""scripts/convert_to_hf.py and scripts/convert_from_hf.py: our checkpoints and transformers' OLMo / OLMo-2 models
convert both ways exactly (same weights after a round trip, same logits, same greedy tokens), and bad input is
refused before anything is written."""

import json
from pathlib import Path

import pytest
import torch

from olmo.checkpoint import inspect_checkpoint, load_checkpoint
from olmo.checkpoint.save import write_unsharded_checkpoint
from olmo.config import TrainConfig
from olmo.exceptions import OLMoCheckpointError, OLMoConfigurationError
from olmo.model import OLMo
from olmo.testing import (
    BYTE_EOS,
    BYTE_VOCAB,
    run_main,
    run_train,
    tiny_config_dict,
    write_byte_memmap,
    write_byte_tokenizer,
    write_config,
)

transformers = pytest.importorskip("transformers")

EMBEDDING = 320


def _hf_model(model_type: str, **options):
    """A random transformers model with 2 layers, d_model 32, 4 heads; norm weights random too."""
    config_class = transformers.Olmo2Config if model_type == "olmo2" else transformers.OlmoConfig
    config = config_class(
        vocab_size=EMBEDDING,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        eos_token_id=BYTE_EOS,
        pad_token_id=BYTE_EOS,
        rope_theta=5000.0,
        **{"intermediate_size": 64, **options},
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model.eval()


def _ours(path: Path) -> OLMo:
    cfg = TrainConfig.load(path / "config.yaml")
    model = OLMo(cfg.model, init_params=False)
    load_checkpoint(inspect_checkpoint(str(path)), model, None, load_trainer_state=False)
    return model.eval()


def _greedy(model: OLMo, prompt: torch.Tensor, n: int) -> torch.Tensor:
    """``prompt`` (B, P) followed by ``n`` greedy tokens of ``model``. Every step runs on the same (B, P + n)
    buffer, right-padded: with causal attention the padding never changes the logits of earlier positions, and
    one input shape keeps CPU kernels from warming up anew for every length."""
    P = prompt.shape[1]
    ids = torch.zeros(prompt.shape[0], P + n, dtype=torch.long)  # (B, P + n)
    ids[:, :P] = prompt
    for i in range(n):
        ids[:, P + i] = model(ids).logits[:, P + i - 1].argmax(dim=-1)
    return ids


def _assert_same_outputs(ours: OLMo, hf) -> None:
    torch.manual_seed(1)
    ids = torch.randint(0, BYTE_VOCAB, (2, 28))
    with torch.no_grad():
        ours_logits, hf_logits = ours(ids).logits, hf(ids).logits
        assert ours_logits.shape == hf_logits.shape == (2, 28, EMBEDDING)
        torch.testing.assert_close(ours_logits, hf_logits, rtol=0, atol=1e-5)
        generated = hf.generate(ids[:, :8], do_sample=False, max_new_tokens=20, min_new_tokens=20)
        assert torch.equal(_greedy(ours, ids[:, :8], 20), generated)


VARIANTS = {
    "olmo1-tied": ("olmo", dict(tie_word_embeddings=True)),
    "olmo1-untied-gqa": ("olmo", dict(tie_word_embeddings=False, num_key_value_heads=2)),
    "olmo1-clip-qkv": ("olmo", dict(tie_word_embeddings=False, clip_qkv=0.1)),
    "olmo2-gqa": ("olmo2", dict(tie_word_embeddings=False, num_key_value_heads=1, rms_norm_eps=1e-6)),
    "olmo2-odd-intermediate": ("olmo2", dict(tie_word_embeddings=True, intermediate_size=72)),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_hf_to_ours_to_hf_is_exact(variant, tmp_path):
    model_type, options = VARIANTS[variant]
    hf = _hf_model(model_type, **options)
    hf.save_pretrained(tmp_path / "hf")
    write_byte_tokenizer(tmp_path / "hf" / "tokenizer.json")

    assert run_main("convert_from_hf.py", tmp_path / "hf", tmp_path / "ours") == 0
    model_cfg = TrainConfig.load(tmp_path / "ours" / "config.yaml").model
    assert (model_cfg.vocab_size, model_cfg.effective_embedding_size) == (BYTE_VOCAB, EMBEDDING)
    if variant == "olmo2-odd-intermediate":
        assert model_cfg.mlp_hidden_size == 144  # 2 * 72: SwiGLU's two halves, not a multiple of d_model
    ours = _ours(tmp_path / "ours")
    _assert_same_outputs(ours, hf)

    assert run_main("convert_to_hf.py", tmp_path / "ours", tmp_path / "back") == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", local_files_only=True)
    assert type(back) is type(hf)
    expected, actual = hf.state_dict(), back.state_dict()
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "back", local_files_only=True)
    assert tokenizer.eos_token_id == BYTE_EOS and tokenizer.decode(tokenizer("héllo")["input_ids"]) == "héllo"


def test_an_imported_model_fine_tunes(tmp_path):
    _hf_model("olmo2", tie_word_embeddings=False).save_pretrained(tmp_path / "hf")
    write_byte_tokenizer(tmp_path / "hf" / "tokenizer.json")
    assert run_main("convert_from_hf.py", tmp_path / "hf", tmp_path / "ours", "--safetensors") == 0
    assert (tmp_path / "ours" / "model.safetensors").is_file()
    imported = TrainConfig.load(tmp_path / "ours" / "config.yaml")
    write_byte_memmap(tmp_path / "a.npy", 5_000)
    cfg = tiny_config_dict(tmp_path / "run", [str(tmp_path / "a.npy")], max_duration=2, save_interval_unsharded=2)
    cfg["model"] = {**imported.asdict()["model"], "max_sequence_length": 32}
    cfg["tokenizer"] = {"identifier": imported.tokenizer.identifier}
    config = write_config(tmp_path / "finetune.yaml", cfg)
    load = f"--load_path={tmp_path / 'ours'}"
    assert run_train(config, load, "--reset_trainer_state") == 0  # no optim.pt: a fresh optimizer, by itself
    assert inspect_checkpoint(str(tmp_path / "run" / "step2-unsharded")).step == 2


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A tiny OLMo-2-architecture run: sharded and unsharded checkpoints at steps 3 and 6, each exported to
    ``stepN-hf`` by ``hf_export``."""
    root = tmp_path_factory.mktemp("run")
    write_byte_memmap(root / "a.npy", 20_000)
    settings = {
        "save_interval": 3,
        "save_interval_unsharded": 3,
        "max_duration": 6,
        "hf_export": {"enabled": True, "dtype": "float32", "every_unsharded": True},
        "tokenizer.identifier": str(write_byte_tokenizer(root / "tokenizer.json")),
        "model.norm_after": True,
        "model.layer_norm_type": "rms",
        "model.attention_layer_norm": True,
        "model.n_kv_heads": 1,
    }
    config = write_config(root / "config.yaml", tiny_config_dict(root / "run", [str(root / "a.npy")], **settings))
    assert run_train(config) == 0
    return root / "run"


def test_a_trained_checkpoint_exports_with_equal_logits_sharded_or_not(trained_run, tmp_path):
    for step, name in ((6, "step6-unsharded"), (3, "step3")):
        out = tmp_path / f"hf{step}"
        assert run_main("convert_to_hf.py", trained_run / name, out, "--max-shard-size=20kB") == 0
        assert (out / "model.safetensors.index.json").is_file()  # sharded at this tiny size
        hf = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
        assert type(hf).__name__ == "Olmo2ForCausalLM"
        ours = _ours(trained_run / name)
        ids = torch.randint(0, BYTE_VOCAB, (2, 32))
        with torch.no_grad():
            torch.testing.assert_close(ours(ids).logits, hf.eval()(ids).logits, rtol=0, atol=1e-5)
    assert (
        run_main("convert_to_hf.py", trained_run / "step6-unsharded", tmp_path / "bf16", "--dtype=bfloat16") == 0
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", local_files_only=True, dtype="auto")
    assert hf.dtype == torch.bfloat16 and (tmp_path / "bf16" / "model.safetensors").is_file()


def test_generate_py_is_greedy_decoding_token_for_token_as_transformers_generate(trained_run, tmp_path, capsys):
    """scripts/generate.py on a trained checkpoint against transformers' generate on its convert_to_hf.py export:
    the same tokens, for a batch of two prompts of different lengths (left-padded) and for one prompt streamed."""
    checkpoint = trained_run / "step6-unsharded"
    assert run_main("convert_to_hf.py", checkpoint, tmp_path / "hf") == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    prompts = ["def f(a", "x = 1"]
    args = [f"--prompt={p}" for p in prompts]
    assert run_main("generate.py", checkpoint, *args, "--max_new_tokens=20", "--json") == 0
    results = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in results] == prompts
    for result in results:
        ids = torch.tensor([result["prompt_token_ids"]])
        with torch.no_grad():
            expected = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20)
        expected = expected[0, ids.size(1) :].tolist()
        expected = expected[: expected.index(BYTE_EOS)] if BYTE_EOS in expected else expected
        assert result["token_ids"] == expected and len(expected) > 0
        assert result["text"] == tokenizer.decode(expected)
    assert run_main("generate.py", checkpoint, args[0], "--max_new_tokens=20") == 0
    assert capsys.readouterr().out == prompts[0] + results[0]["text"] + "\n"  # streamed, then a newline


def test_generate_py_continues_a_model_imported_from_transformers_as_transformers_does(tmp_path, capsys):
    hf = _hf_model("olmo2", tie_word_embeddings=False, num_key_value_heads=2)
    hf.save_pretrained(tmp_path / "hf")
    write_byte_tokenizer(tmp_path / "hf" / "tokenizer.json")
    assert run_main("convert_from_hf.py", tmp_path / "hf", tmp_path / "ours") == 0
    capsys.readouterr()
    assert run_main("generate.py", tmp_path / "ours", "--prompt=hello wor", "--max_new_tokens=12", "--json") == 0
    result = json.loads(capsys.readouterr().out)
    ids = torch.tensor([result["prompt_token_ids"]])
    with torch.no_grad():
        expected = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12)
    expected = expected[0, ids.size(1) :].tolist()
    assert result["token_ids"] == (expected[: expected.index(BYTE_EOS)] if BYTE_EOS in expected else expected)


def _assert_nothing_written(parent: Path, name: str) -> None:
    assert not (parent / name).exists()
    assert not list(parent.glob(f".{name}.tmp-*"))


def test_bad_input_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)  # read at import; the test must not wait
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # an empty cache: the id cannot resolve offline
    with pytest.raises(OLMoConfigurationError, match="HF_DIR 'allenai/no-such-model' is not a local directory"):
        run_main("convert_from_hf.py", "allenai/no-such-model", tmp_path / "out")
    _assert_nothing_written(tmp_path, "out")
    (tmp_path / "not-hf").mkdir()
    (tmp_path / "not-hf" / "notes.txt").write_text("hello")
    with pytest.raises(OLMoConfigurationError, match="config.json"):
        run_main("convert_from_hf.py", tmp_path / "not-hf", tmp_path / "out")
    (tmp_path / "not-hf" / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(OLMoConfigurationError, match="model_type='llama'"):
        run_main("convert_from_hf.py", tmp_path / "not-hf", tmp_path / "out")
    _assert_nothing_written(tmp_path, "out")

    (tmp_path / "no-config").mkdir()
    torch.save({}, tmp_path / "no-config" / "model.pt")
    with pytest.raises(OLMoCheckpointError, match="config.yaml"):
        run_main("convert_to_hf.py", tmp_path / "no-config", tmp_path / "out")
    _assert_nothing_written(tmp_path, "out")

    data = [str(tmp_path / "unused.npy")]
    alibi = tiny_config_dict(tmp_path, data, **{"model.rope": False, "model.alibi": True, "model.clip_qkv": 2.0})
    alibi["tokenizer"] = {"identifier": str(write_byte_tokenizer(tmp_path / "tokenizer.json"))}
    cfg = TrainConfig.from_dict(alibi)
    cfg.save(tmp_path / "alibi.yaml")
    write_unsharded_checkpoint(tmp_path / "alibi", OLMo(cfg.model), None, {}, tmp_path / "alibi.yaml", step=0)
    with pytest.raises(OLMoConfigurationError, match="model.alibi=True") as refusal:
        run_main("convert_to_hf.py", tmp_path / "alibi", tmp_path / "out")
    assert "model.layer_norm_with_affine" in str(refusal.value)  # every problem is listed at once
    _assert_nothing_written(tmp_path, "out")

    # A failure while writing removes the partial directory.
    rope = TrainConfig.from_dict({**alibi, "model": {**alibi["model"], "rope": True, "alibi": False}})
    rope.model.layer_norm_with_affine = False
    rope.save(tmp_path / "rope.yaml")
    write_unsharded_checkpoint(tmp_path / "rope", OLMo(rope.model), None, {}, tmp_path / "rope.yaml", step=0)
    monkeypatch.setattr("olmo.hf.files.write_tokenizer_files", _fail)
    with pytest.raises(OSError, match="disk full"):
        run_main("convert_to_hf.py", tmp_path / "rope", tmp_path / "out")
    _assert_nothing_written(tmp_path, "out")
    (tmp_path / "out").mkdir()
    with pytest.raises(OLMoCheckpointError, match="already exists"):
        run_main("convert_to_hf.py", tmp_path / "rope", tmp_path / "out")


def _fail(*args, **kwargs):
    raise OSError("disk full")


def test_hf_export_writes_each_unsharded_step_and_the_final_one(trained_run, tmp_path):
    assert sorted(p.name for p in trained_run.glob("step*-hf")) == ["step3-hf", "step6-hf"]
    # ours -> HF -> ours: the weights come back bitwise.
    assert run_main("convert_from_hf.py", trained_run / "step6-hf", tmp_path / "back") == 0
    trained, back = _ours(trained_run / "step6-unsharded").state_dict(), _ours(tmp_path / "back").state_dict()
    assert trained.keys() == back.keys() and all(torch.equal(v, back[k]) for k, v in trained.items())
    hf = transformers.AutoModelForCausalLM.from_pretrained(trained_run / "step6-hf", local_files_only=True)
    ids = torch.randint(0, BYTE_VOCAB, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(
            _ours(trained_run / "step6-unsharded")(ids).logits, hf.eval()(ids).logits, rtol=0, atol=1e-5
        )


def test_hf_export_of_an_architecture_transformers_cannot_hold_stops_the_launch(tmp_path):
    write_byte_memmap(tmp_path / "a.npy", 5_000)
    settings = {"model.rope": False, "model.alibi": True, "hf_export": {"enabled": True}}
    config = write_config(
        tmp_path / "c.yaml", tiny_config_dict(tmp_path / "run", [str(tmp_path / "a.npy")], **settings)
    )
    with pytest.raises(OLMoConfigurationError, match=r"(?s)hf_export.enabled=true: .*model.alibi=True"):
        run_train(config)
    assert not (tmp_path / "run").exists()
