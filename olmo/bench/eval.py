"""Measure evaluation throughput on tiny models (not a test):

    HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 python scripts/benchmark_eval.py [THREADS]

Prints examples/s for the LM evaluator (byte-level tiny model, T=32 and T=256), for the piqa
downstream evaluator (1-layer d_model=32 model with the OLMo vocabulary and T=2048; task build
time is reported separately), and the cost of a ``type: generate`` evaluation on the quickstart's model
(configs/tiny/OLMo-tiny.yaml: 4 prompts, 32 new tokens, greedy), with the KV cache and, for comparison, by a
full forward over the whole sequence for every new token.
"""

import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from olmo.config import TrainConfig
from olmo.eval import DownstreamEvaluator, evaluators_of_run
from olmo.eval.downstream import build_task
from olmo.model import OLMo
from olmo.testing import tiny_config_dict, write_byte_memmap
from olmo.tokenizer import Tokenizer

CPU = torch.device("cpu")


def _timed(evaluator, model) -> float:
    evaluator.evaluate(model, CPU)  # warm-up
    start = time.perf_counter()
    evaluator.evaluate(model, CPU)
    return time.perf_counter() - start


def measure_lm(root: Path, seq_len: int, n_instances: int, batch_size: int = 16) -> None:
    path = root / f"val{seq_len}.npy"
    write_byte_memmap(path, n_instances * seq_len)
    evaluator = {"label": "val", "data": {"paths": [str(path)]}}
    cfg = TrainConfig.from_dict(
        tiny_config_dict(
            root,
            [str(path)],
            evaluators=[evaluator],
            device_eval_batch_size=batch_size,
            **{"model.max_sequence_length": seq_len},
        )
    )
    torch.manual_seed(0)
    evaluators = evaluators_of_run(cfg)
    seconds = _timed(evaluators[0], OLMo(cfg.model))
    print(
        f"lm   T={seq_len:<4} bs={batch_size}: {n_instances / seconds:8.1f} instances/s, "
        f"{n_instances * seq_len / seconds:9.0f} tokens/s ({n_instances} instances in {seconds:.2f} s)"
    )


def measure_downstream(label: str = "piqa", batch_size: int = 16, num_batches: int = 20) -> None:
    overrides = {
        "model.vocab_size": 50280,
        "model.embedding_size": 50304,
        "model.n_layers": 1,
        "model.eos_token_id": 50279,
        "model.pad_token_id": 1,
        "model.max_sequence_length": 2048,
    }
    cfg = TrainConfig.from_dict(tiny_config_dict("unused", ["unused.npy"], **overrides))
    tokenizer = Tokenizer.from_train_config(cfg)
    start = time.perf_counter()
    task = build_task(label, tokenizer, cfg.model.max_sequence_length)
    built = time.perf_counter() - start
    evaluator = DownstreamEvaluator(label, task, batch_size=batch_size, subset_num_batches=num_batches)
    torch.manual_seed(0)
    seconds = _timed(evaluator, OLMo(cfg.model))
    samples = evaluator.samples()
    n_docs = len({s["doc_id"] for s in samples})
    print(
        f"{label} bs={batch_size}: {n_docs / seconds:8.1f} questions/s, {len(samples) / seconds:8.1f} "
        f"choices/s ({n_docs} questions in {seconds:.2f} s; task build {built:.2f} s)"
    )


def measure_generation(prompts: int = 4, new_tokens: int = 32, long_prompts: bool = False) -> None:
    from olmo.eval.samples import GenerationEvaluator
    from olmo.model.generation import build_sampler

    cfg = TrainConfig.load("configs/tiny/OLMo-tiny.yaml", ["wandb=null"])  # run from the checkout
    tokenizer = Tokenizer.from_train_config(cfg)
    texts = ["def main(", "import os", "class Config:", "# Licensed under"][:prompts]
    if long_prompts:  # ~200 tokens each: where the cache saves the most
        texts = [(text + " x = compute(value, other) + 1\n") * 20 for text in texts]
    evaluator = GenerationEvaluator(
        "samples",
        texts,
        tokenizer,
        max_new_tokens=new_tokens,
        sampler=build_sampler(),
        end_index=cfg.model.vocab_size + 1,  # never produced: every prompt gets all its tokens
        max_sequence_length=cfg.model.max_sequence_length,
    )
    torch.manual_seed(0)
    model = OLMo(cfg.model).eval()
    seconds = _timed(evaluator, model)
    generated = prompts * new_tokens
    ids = torch.tensor([evaluator.prompt_ids[0]])
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(new_tokens):  # no cache: the whole sequence again for every token (one prompt)
            ids = torch.cat((ids, model(ids).logits[:, -1:].argmax(-1)), dim=1)
    uncached = time.perf_counter() - start
    length = max(len(p) for p in evaluator.prompt_ids)
    print(
        f"generate {prompts} prompts of <= {length} tokens x {new_tokens} new (OLMo-tiny): {seconds:.2f} s per evaluation, "
        f"{generated / seconds:.0f} tokens/s; without the cache, one prompt: {new_tokens / uncached:.0f} tokens/s"
    )


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    if argv:
        torch.set_num_threads(int(argv[0]))
    print(f"torch threads: {torch.get_num_threads()}")
    with tempfile.TemporaryDirectory() as tmp:
        measure_lm(Path(tmp), seq_len=32, n_instances=2048)
        measure_lm(Path(tmp), seq_len=256, n_instances=512)
    measure_downstream()
    measure_generation()
    measure_generation(long_prompts=True)
    return 0
