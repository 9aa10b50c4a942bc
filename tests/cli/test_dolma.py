"""scripts/prepare_dolma.sh (`dolma tokens`) against scripts/prepare_memmap_dataset.py, and training on its output.

Needs dolma's own virtualenv, built by `make dolma-env` (~45 s, PyPI); skipped without it.
"""

from __future__ import annotations

import csv
import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from olmo.testing import run_train, stdlib_documents, tiny_config_dict, write_config
from olmo.tokenizer import DEFAULT_TOKENIZER, Tokenizer

REPO = Path(__file__).resolve().parents[2]
EOS = 50279
REAL_VOCAB = {
    "model.vocab_size": 50280,
    "model.embedding_size": 50304,
    "model.eos_token_id": EOS,
    "model.pad_token_id": 1,
    "model.max_sequence_length": 64,
}

pytestmark = pytest.mark.skipif(
    not (REPO / ".venv-dolma/bin/dolma").exists(),
    reason="dolma is not installed: run `make dolma-env` (builds .venv-dolma from PyPI in ~45 s)",
)


def write_corpus(folder: Path, texts: list[str]) -> None:
    """Dolma-format documents, split over two ``*.json.gz`` files so dolma runs two processes."""
    folder.mkdir(parents=True)
    half = len(texts) // 2
    for name, start, stop in (("a", 0, half), ("b", half, len(texts))):
        with gzip.open(folder / f"{name}.json.gz", "wt", encoding="utf-8") as f:
            for i in range(start, stop):
                f.write(json.dumps({"id": f"doc-{i}", "text": texts[i]}) + "\n")


def prepare_dolma(docs: Path, out: Path) -> np.ndarray:
    """Run scripts/prepare_dolma.sh; return all its tokens, file after file."""
    result = subprocess.run(
        ["bash", str(REPO / "scripts/prepare_dolma.sh"), str(docs / "*.json.gz"), str(out), "--processes", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert f"${{path.glob:{out.resolve()}/*.npy}}" in result.stdout
    return read_tokens(out)


def prepare_memmap_dataset(docs: Path, out: Path) -> np.ndarray:
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts/prepare_memmap_dataset.py"), str(docs / "*.json.gz"), "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return read_tokens(out)


def read_tokens(folder: Path) -> np.ndarray:
    # Headerless memmaps: np.load would fail, np.memmap reads them.
    return np.concatenate([np.memmap(p, dtype=np.uint16, mode="r") for p in sorted(folder.glob("part-*.npy"))])


def documents(tokens: np.ndarray) -> list[tuple[int, ...]]:
    """The documents (each ending with EOS) in sorted order: dolma shuffles them, our script does not."""
    assert tokens[-1] == EOS, "every document, so also the last one, ends with EOS"
    ends = np.flatnonzero(tokens == EOS) + 1
    return sorted(tuple(doc.tolist()) for doc in np.split(tokens, ends[:-1]))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """~50 real documents (Python stdlib modules cut to whole lines) plus an empty and a blank one.

    dolma strips whitespace around each document before tokenizing and our script does not (see
    test_prepare_memmap_dataset_strips_whitespace_like_dolma), so the texts are stored stripped here.
    """
    texts = [doc[:3000].decode("utf-8", "replace").rsplit("\n", 1)[0].strip() for doc in stdlib_documents(2**21)]
    texts = texts[:50] + ["", " \n\n "]
    docs = tmp_path_factory.mktemp("dolma") / "docs"
    write_corpus(docs, texts)
    return docs, texts


@pytest.fixture(scope="module")
def dolma_dir(corpus: tuple[Path, list[str]]) -> Path:
    docs, _ = corpus
    out = docs.parent / "dolma-tokens"
    prepare_dolma(docs, out)
    return out


def test_dolma_and_prepare_memmap_dataset_write_the_same_documents(corpus, dolma_dir):
    docs, texts = corpus
    ours = prepare_memmap_dataset(docs, docs.parent / "ours")
    theirs = read_tokens(dolma_dir)
    assert len(theirs) == len(ours)
    dolma_docs = documents(theirs)
    assert len(dolma_docs) == 50, "the empty and the blank document are skipped"
    assert dolma_docs == documents(ours)
    # dolma's index: a row (start, end, id, src_path, line_no) per document, locating exactly its tokens.
    tokenizer = Tokenizer.from_file(DEFAULT_TOKENIZER)
    located = 0
    for index in sorted(dolma_dir.glob("part-*.csv.gz")):
        part = np.memmap(index.with_name(index.name.replace(".csv.gz", ".npy")), dtype=np.uint16, mode="r")
        with gzip.open(index, "rt") as f:
            for start, end, doc_id, *_ in csv.reader(f):
                text = texts[int(doc_id.removeprefix("doc-"))]
                assert part[int(start) : int(end)].tolist() == tokenizer.encode(text), doc_id
                located += int(end) - int(start)
    assert located == len(theirs)


def test_training_reads_dolma_output(dolma_dir, tmp_path):
    # Exactly the data.paths line prepare_dolma.sh prints.
    cfg = tiny_config_dict(
        tmp_path / "run",
        [],
        max_duration=2,
        save_interval_unsharded=None,
        **{"data.paths": f"${{path.glob:{dolma_dir.resolve()}/*.npy}}"},
        **REAL_VOCAB,
    )
    record: list[dict] = []
    assert run_train(write_config(tmp_path / "config.yaml", cfg), record=record) == 0
    losses = [r["train/CrossEntropyLoss"] for r in record if "train/CrossEntropyLoss" in r]
    assert len(losses) == 2 and np.isfinite(losses).all()


def test_prepare_memmap_dataset_strips_whitespace_like_dolma(tmp_path):
    texts = ["def f():\n    return 1\n", "\n\n  indented first line\n\n", "x = 1\n"]
    write_corpus(tmp_path / "docs", texts)
    theirs = prepare_dolma(tmp_path / "docs", tmp_path / "dolma")
    ours = prepare_memmap_dataset(tmp_path / "docs", tmp_path / "ours")
    assert documents(ours) == documents(theirs)


def test_inspect_batch_names_the_documents_of_every_instance(corpus, dolma_dir, tmp_path, capsys):
    """inspect_batch.py --json reads dolma's metadata: each instance's documents tile it, and each span holds the
    tokens of the document with that id in the JSONL input."""
    from olmo.testing import run_main

    docs, texts = corpus
    cfg = tiny_config_dict(
        tmp_path / "run",
        [],
        max_duration=2,
        save_interval_unsharded=None,
        **{"data.paths": f"${{path.glob:{dolma_dir.resolve()}/*.npy}}"},
        **REAL_VOCAB,
    )
    assert run_train(write_config(tmp_path / "config.yaml", cfg)) == 0
    capsys.readouterr()
    run_main("inspect_batch.py", tmp_path / "run", "--step", "2", "--json")
    instances = json.loads(capsys.readouterr().out)
    tokenizer = Tokenizer.from_file(DEFAULT_TOKENIZER)
    T = REAL_VOCAB["model.max_sequence_length"]
    assert len(instances) == cfg["global_train_batch_size"]
    for inst in instances:
        assert inst["rank"] == 0 and inst["source"] is None and inst["filtered"] is False
        assert inst["document_metadata"] and inst["documents"]
        tokens = np.memmap(inst["file"], dtype=np.uint16, mode="r")[
            inst["token_offset"] : inst["token_offset"] + T
        ]
        spans = inst["documents"]
        assert spans[0]["start"] == 0 and spans[-1]["end"] == T
        assert all(a["end"] == b["start"] for a, b in zip(spans, spans[1:]))  # they tile the instance
        for i, span in enumerate(spans):
            full = tokenizer.encode(texts[int(span["id"].removeprefix("doc-"))])
            piece = tokens[span["start"] : span["end"]].tolist()
            if 0 < i < len(spans) - 1:
                assert piece == full
            elif len(spans) > 1:
                assert piece == (full[-len(piece) :] if i == 0 else full[: len(piece)])
            else:
                assert any(full[k : k + len(piece)] == piece for k in range(len(full) - len(piece) + 1))
