"""Downstream metric definitions against the original OLMo 0.6 trainer's numbers on the same weights: with
``definitions: olmo-0.6`` our piqa accuracy, len_norm and every choice's log-likelihood are the original's
(tests/fixtures/olmo_downstream/scores.json, written by ai2-olmo 0.6.0 itself: make_fixture.sh); the default
(``olmo_eval``) divides by the continuation's length with its leading space and cuts queries to the model's
length, and differs exactly by those two things."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from olmo.eval.downstream import OLMO_06_CONTEXT, DownstreamEvaluator, build_task
from olmo.exceptions import OLMoConfigurationError
from olmo.testing import run_train, tiny_config_dict, write_byte_memmap, write_config
from olmo.tokenizer import Tokenizer

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "olmo_downstream"
CPU = torch.device("cpu")


def _setup():
    spec = importlib.util.spec_from_file_location("make_weights", FIXTURE / "make_weights.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def scored():
    """(original's scores, our olmo-0.6 evaluator, our default evaluator, the model)."""
    setup = _setup()
    original = json.loads((FIXTURE / "scores.json").read_text())
    tokenizer = Tokenizer.from_file("allenai_gpt-neox-olmo-dolma-v1_5.json", 50279, 1)
    common = dict(batch_size=10, subset_num_batches=setup.DOCS // 5, seed=setup.SEED)
    legacy = DownstreamEvaluator(
        "piqa", build_task("piqa", tokenizer, OLMO_06_CONTEXT), definitions="olmo-0.6", **common
    )
    default = DownstreamEvaluator(
        "piqa", build_task("piqa", tokenizer, setup.MODEL["max_sequence_length"]), **common
    )
    return original, legacy, default, setup.build()


def _choices(metric) -> dict[tuple[int, int], float]:
    return {(int(d), int(c)): float(v) for d, c, v in metric.loglikelihoods}


def test_olmo_06_definitions_give_the_original_trainers_numbers(scored):
    original, legacy, _, model = scored
    assert sorted({s["doc_id"] for s in legacy.samples()}) == sorted(original["docs"])  # the same 50 questions
    metrics = legacy.evaluate(model, CPU)
    assert metrics["eval/downstream/piqa_acc"] == pytest.approx(original["acc"], abs=1e-6)
    assert metrics["eval/downstream/piqa_len_norm"] == pytest.approx(original["len_norm"], abs=1e-6)
    ours = legacy.score(model, CPU)
    for kind, key in (("acc", "loglikelihoods"), ("len_norm", "len_norm_scores")):
        theirs = {(d, c): v for d, c, v in original[key]}
        mine = _choices(ours[kind])
        assert mine.keys() == theirs.keys()
        assert all(mine[k] == pytest.approx(theirs[k], rel=1e-5, abs=1e-5) for k in theirs), kind


def test_the_default_definitions_differ_from_the_original_by_the_space_and_the_cut(scored):
    original, legacy, default, model = scored
    theirs = {(d, c): v for d, c, v in original["loglikelihoods"]}
    samples = {(s["doc_id"], s["cont_id"]): s for s in default.samples()}
    full = {(s["doc_id"], s["cont_id"]): s for s in legacy.samples()}  # queries of up to 100 tokens, whole
    ours = default.score(model, CPU)
    loglik, len_norm = _choices(ours["acc"]), _choices(ours["len_norm"])
    cut = [k for k, s in samples.items() if len(s["query"]) < len(full[k]["query"])]
    assert cut, "some of these piqa queries are longer than the model's 88 positions"
    for key, sample in samples.items():
        assert len_norm[key] == pytest.approx(loglik[key] / sample["cont_str_len"], rel=1e-6)  # space counted
        assert sample["cont_str_len"] == sample["cont_str_len_no_leading_space"] + 1
        if key not in cut:  # the same context: the original's log-likelihood, to float rounding
            assert loglik[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-5)
    assert sum(abs(loglik[k] - theirs[k]) > 1e-3 for k in cut) > 0  # cut queries score differently


def test_unknown_definitions_are_refused_naming_the_key(tmp_path):
    write_byte_memmap(tmp_path / "a.npy", 5_000)
    evaluators = [{"label": "piqa", "type": "downstream", "definitions": "olmo-0.5"}]
    cfg = tiny_config_dict(tmp_path / "run", [str(tmp_path / "a.npy")], evaluators=evaluators)
    with pytest.raises(
        OLMoConfigurationError, match=r"evaluators\[0\]\.definitions='olmo-0.5' .* olmo_eval or olmo-0.6"
    ):
        run_train(write_config(tmp_path / "c.yaml", cfg))
