"""The prompts of reinforcement learning with verifiable rewards (issue 53): written by
``scripts/prepare_rl_prompts.py`` (:func:`write_rl_prompts`), read by a run's ``rl.prompts`` (:class:`RLPrompts`).

A prompt folder holds:

* ``prompt_ids.npy``: every prompt's token ids one after another (a headerless memmap of ``dtype``);
* ``prompt_offsets.npy``: int64, prompt ``i`` is ``prompt_ids[offsets[i]:offsets[i + 1]]``;
* ``ground_truths.jsonl``: line ``i`` is ``{"id": "FILE:LINE", "ground_truth": "..."}`` for prompt ``i``;
* ``prompts.json``: the record (format, version, tokenizer, EOS, dtype, chat template, counts, the input file);
* ``input_ids.npy``: prompt ``i`` as instance ``i`` of ``seq_len`` tokens, padded on the left (a headerless memmap
  of ``dtype``): the token file the training data order, its dealing to ranks, resumption and ``inspect_batch.py``
  read, as for any other data (each step's batch is its prompts; the run takes their exact tokens from the files
  above).

A line ``{"prompt": "..."}`` is the prompt's text as it is (its tokens, nothing added, as TRL takes a standard
prompt); a line ``{"messages": [...]}`` is a conversation that the model answers next: OLMo's Tulu layout (as
``prepare_sft_data.py`` writes an example up to the assistant's answer: EOS, then ``<|role|>\\n`` and the content of
each message, then ``<|assistant|>\\n``) or a chat template's rendering with its generation prompt.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

import numpy as np

from ..exceptions import OLMoDataError
from ..util.json_lines import json_type, read_json_lines
from .sft import message_problem, write_staged

if TYPE_CHECKING:
    from ..tokenizer import Tokenizer
    from .chat_templates import ChatTemplate

__all__ = [
    "PROMPT_FILES",
    "PromptFormatter",
    "PromptLine",
    "PromptSummary",
    "RLPrompts",
    "read_prompt_lines",
    "write_rl_prompts",
]

log = logging.getLogger(__name__)

PROMPT_IDS, PROMPT_OFFSETS, GROUND_TRUTHS, RECORD, INSTANCES = (
    "prompt_ids.npy",
    "prompt_offsets.npy",
    "ground_truths.jsonl",
    "prompts.json",
    "input_ids.npy",
)
PROMPT_FILES = (PROMPT_IDS, PROMPT_OFFSETS, GROUND_TRUTHS, RECORD, INSTANCES)
FORMAT, VERSION = "olmo-rl-prompts", 1
EXAMPLE = (
    '{"prompt": "What is 2 + 3?", "ground_truth": "5"} or '
    '{"messages": [{"role": "user", "content": "What is 2 + 3?"}], "ground_truth": "5"}'
)


@dataclass(frozen=True)
class PromptLine:
    """One line of the input: its number, either ``prompt`` or ``messages``, and its ground truth."""

    line: int
    prompt: Optional[str]
    messages: Optional[list[dict[str, str]]]
    ground_truth: str


def _kept(line: dict[str, Any], keep: tuple[str, str]) -> bool:
    """Whether ``line[key]`` is ``value``, or a list holding it (compared as text)."""
    key, value = keep
    found = line.get(key)
    values = found if isinstance(found, list) else [found]
    return any(v is not None and not isinstance(v, (dict, list)) and str(v) == value for v in values)


def read_prompt_lines(
    path: Path,
    prompt_field: Optional[str] = None,
    keep: Optional[tuple[str, str]] = None,
    skipped: Optional[list[int]] = None,
) -> Iterator[PromptLine]:
    """Every non-blank line of ``path`` as a :class:`PromptLine`.

    :param prompt_field: read the prompt from this key alone (``prompt`` or ``messages``), the other ignored, as in
        a published dataset that holds both; None: a line holds exactly one of them.
    :param keep: ``(key, value)``: only lines whose ``key`` is ``value`` (or a list holding it); the others' numbers
        go to ``skipped``.
    :raises OLMoDataError: naming the file and line of the first line that is not a prompt with its ground truth.
    """
    for line_no, line in read_json_lines(path, what="prompt"):
        where = f"'{path}' line {line_no}"
        if keep is not None and not _kept(line, keep):
            if skipped is not None:
                skipped.append(line_no)
            continue
        if prompt_field is not None:
            if prompt_field not in line:
                raise OLMoDataError(
                    f"{where} has no '{prompt_field}' (--prompt-field {prompt_field}); its keys: "
                    f"{', '.join(repr(k) for k in line) or 'none'}."
                )
            line = {k: v for k, v in line.items() if k not in ("prompt", "messages") or k == prompt_field}
        kinds = [key for key in ("prompt", "messages") if key in line]
        if len(kinds) != 1:
            has = "both 'prompt' and 'messages'" if kinds else "neither 'prompt' nor 'messages'"
            fix = " (pass --prompt-field to choose one)" if kinds else ""
            raise OLMoDataError(f"{where} has {has}{fix}. Every line must look like {EXAMPLE}.")
        truth = given = line.get("ground_truth")
        if isinstance(truth, list) and len(truth) == 1:  # a dataset's list of one answer (Ai2's RL sets)
            truth = truth[0]
        if isinstance(truth, bool) or not isinstance(truth, (str, int, float)):
            what = (
                "no 'ground_truth'"
                if "ground_truth" not in line
                else f"a 'ground_truth' list of {len(given)} values (a reward scores against one)"
                if isinstance(given, list) and len(given) != 1
                else f"a 'ground_truth' that is {json_type(truth)}"
            )
            raise OLMoDataError(
                f"{where} has {what}; the rewards score completions against it, so it must be a string (or a "
                f"number). Every line must look like {EXAMPLE}."
            )
        if "prompt" in line:
            prompt = line["prompt"]
            if not isinstance(prompt, str) or not prompt.strip():
                problem = f"is {json_type(prompt)}, not a string" if not isinstance(prompt, str) else "is empty"
                raise OLMoDataError(f"{where}: 'prompt' {problem}. Every line must look like {EXAMPLE}.")
            yield PromptLine(line_no, prompt, None, str(truth))
            continue
        messages = line["messages"]
        if not isinstance(messages, list) or not messages:
            problem = "an empty list" if isinstance(messages, list) else f"{json_type(messages)}, not a list"
            raise OLMoDataError(f"{where}: 'messages' is {problem}. Every line must look like {EXAMPLE}.")
        for i, message in enumerate(messages):
            wrong = message_problem(message)
            if wrong is not None:
                raise OLMoDataError(f"{where}: messages[{i}] {wrong}. Every line must look like {EXAMPLE}.")
        if messages[-1]["role"] == "assistant":
            raise OLMoDataError(
                f"{where}: the conversation ends with an assistant message, but the model writes the answer to a "
                f"prompt; end 'messages' with the user's turn (the answer goes in 'ground_truth')."
            )
        yield PromptLine(line_no, None, messages, str(truth))


class PromptFormatter:
    """The token ids of a prompt (see the module's docstring); ``template``: a chat template for ``messages``
    (None: OLMo's Tulu layout, tokenized piece by piece as ``prepare_sft_data.py`` does)."""

    def __init__(self, tokenizer: Tokenizer, eos: int, template: Optional[ChatTemplate] = None):
        self.tokenizer, self.eos, self.template = tokenizer, eos, template

    def ids(self, line: PromptLine) -> list[int]:
        """The prompt's token ids; a ``ValueError`` (one sentence) when the chat template fails on it."""
        encode = self.tokenizer.encode
        if line.prompt is not None:
            return list(encode(line.prompt, add_special_tokens=False))
        assert line.messages is not None
        if self.template is not None:
            text = self.template.render(line.messages, add_generation_prompt=True)
            return list(self.tokenizer.base.encode(text, add_special_tokens=False).ids)
        ids = [self.eos]
        for message in line.messages:
            ids += encode(f"<|{message['role']}|>\n", add_special_tokens=False)
            if message["role"] == "assistant":  # an earlier answer, as an SFT example holds it
                ids += [*encode(message["content"].strip(), add_special_tokens=False), self.eos]
                ids += encode("\n", add_special_tokens=False)
            else:
                ids += encode(message["content"].strip() + "\n", add_special_tokens=False)
        return ids + list(encode("<|assistant|>\n", add_special_tokens=False))


@dataclass
class PromptSummary:
    """What a run wrote and dropped."""

    kept: int = 0
    too_long: int = 0
    tokens: int = 0
    longest: int = 0
    too_long_lines: list[int] = field(default_factory=list)
    """The first few input lines dropped for length (for the log)."""
    skipped: list[int] = field(default_factory=list)
    """The input lines ``keep`` left out."""


def write_rl_prompts(
    source: Path,
    out: Path,
    formatter: PromptFormatter,
    dtype: str,
    anchor: Path,
    seq_len: int,
    record: dict[str, Any],
    pad: int,
    max_prompt_tokens: Optional[int] = None,
    prompt_field: Optional[str] = None,
    keep: Optional[tuple[str, str]] = None,
) -> PromptSummary:
    """Write the prompts of ``source`` (each of at most ``max_prompt_tokens``, by default ``seq_len``, tokens: longer
    ones are dropped and counted) and
    their ground truths into ``out``, through a hidden folder in ``anchor``, with ``record`` (the settings) added to
    ``prompts.json`` and each prompt also as an instance padded on the left with ``pad``: a failed run leaves
    ``out`` as it was. ``prompt_field`` and ``keep``: as :func:`read_prompt_lines` takes them.

    :raises OLMoDataError: naming the file and line of a bad line or one the chat template fails on, and for an
        input without a prompt that fits.
    """
    summary = PromptSummary()
    limit = seq_len if max_prompt_tokens is None else min(max_prompt_tokens, seq_len)
    flag = "--seq-len" if limit == seq_len else "--max-prompt-tokens"

    def write(staging: Path) -> PromptSummary:
        offsets = [0]
        with (
            open(staging / PROMPT_IDS, "wb") as ids_file,
            open(staging / GROUND_TRUTHS, "w") as truths,
            open(staging / INSTANCES, "wb") as instances,
        ):
            for line in read_prompt_lines(source, prompt_field, keep, summary.skipped):
                try:
                    ids = formatter.ids(line)
                except ValueError as e:
                    raise OLMoDataError(
                        f"'{source}' line {line.line}: {str(e).rstrip('.')}. Fix that prompt, or pass another "
                        f"--chat-template."
                    ) from None
                if len(ids) > limit or not ids:
                    summary.too_long += 1
                    if len(summary.too_long_lines) < 5:
                        summary.too_long_lines.append(line.line)
                    continue
                np.asarray(ids, dtype=dtype).tofile(ids_file)
                np.asarray([pad] * (seq_len - len(ids)) + ids, dtype=dtype).tofile(instances)
                truths.write(json.dumps({"id": f"{source.name}:{line.line}", "ground_truth": line.ground_truth}))
                truths.write("\n")
                offsets.append(offsets[-1] + len(ids))
                summary.kept += 1
                summary.longest = max(summary.longest, len(ids))
        summary.tokens = offsets[-1]
        if summary.kept == 0:
            kept = "" if keep is None else f" with {keep[0]}={keep[1]} ({len(summary.skipped)} lines without)"
            raise OLMoDataError(
                f"'{source}' holds no prompt{kept} of at most {flag} {limit} tokens ({summary.too_long} longer ones "
                f"dropped), so nothing was written to '{out}'. Write one prompt per line ({EXAMPLE}), or raise "
                f"{flag}{'' if keep is None else ', or check --keep'}."
            )
        np.asarray(offsets, dtype=np.int64).tofile(staging / PROMPT_OFFSETS)
        written = {"format": FORMAT, "version": VERSION, **record, "dtype": dtype, "seq_len": seq_len, "pad": pad}
        written.update(prompts=summary.kept, tokens=summary.tokens, max_prompt_tokens=summary.longest)
        written.update(dropped_too_long=summary.too_long, source=str(source))
        if keep is not None:
            written.update(keep=f"{keep[0]}={keep[1]}", dropped_by_keep=len(summary.skipped))
        if prompt_field is not None:
            written.update(prompt_field=prompt_field)
        (staging / RECORD).write_text(json.dumps(written, indent=2) + "\n")
        return summary

    return write_staged(out, anchor, write, PROMPT_FILES)


class RLPrompts:
    """A prompt folder, checked when opened: its record, the sizes of its files, the offsets and every ground truth
    (the token ids are read on use, from a memmap).

    :raises OLMoDataError: naming the file and what is wrong, before a run uses any of it.
    """

    def __init__(self, folder: Union[str, Path]):
        self.folder = Path(folder)
        fix = f"Prepare the prompts again with scripts/prepare_rl_prompts.py INPUT.jsonl -o {self.folder}."
        missing = [name for name in PROMPT_FILES if not (self.folder / name).is_file()]
        if missing:
            raise OLMoDataError(
                f"rl.prompts '{self.folder}' has no {', '.join(missing)}: it is not a prompt folder. {fix}"
            )
        try:
            record = json.loads((self.folder / RECORD).read_text())
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise OLMoDataError(f"'{self.folder / RECORD}' cannot be read as JSON ({e}). {fix}") from None
        if not isinstance(record, dict) or record.get("format") != FORMAT or record.get("version") != VERSION:
            raise OLMoDataError(
                f"'{self.folder / RECORD}' is not the record of a prompt folder of this version ({FORMAT} version "
                f"{VERSION}). {fix}"
            )
        self.record = record
        try:
            self.dtype = np.dtype(record["dtype"])
            n, tokens = int(record["prompts"]), int(record["tokens"])
            assert self.dtype in (np.uint16, np.uint32) and n > 0 and tokens >= n
        except (KeyError, TypeError, ValueError, AssertionError):
            raise OLMoDataError(
                f"'{self.folder / RECORD}' has a bad dtype, prompts or tokens value. {fix}"
            ) from None
        for name, size in ((PROMPT_IDS, tokens * self.dtype.itemsize), (PROMPT_OFFSETS, (n + 1) * 8)):
            found = (self.folder / name).stat().st_size
            if found != size:
                raise OLMoDataError(
                    f"'{self.folder / name}' has {found:,} bytes, but its record says {size:,} ({n:,} prompts, "
                    f"{tokens:,} tokens): it is cut short or from another run. {fix}"
                )
        try:
            self.seq_len = int(record["seq_len"])
            assert self.seq_len >= 1
        except (KeyError, TypeError, ValueError, AssertionError):
            raise OLMoDataError(f"'{self.folder / RECORD}' has a bad seq_len. {fix}") from None
        found = (self.folder / INSTANCES).stat().st_size
        if found != n * self.seq_len * self.dtype.itemsize:
            raise OLMoDataError(
                f"'{self.folder / INSTANCES}' has {found:,} bytes, not {n:,} prompts of {self.seq_len} tokens: it is cut "
                f"short or from another run. {fix}"
            )
        self.offsets = np.fromfile(self.folder / PROMPT_OFFSETS, dtype=np.int64)
        lengths = np.diff(self.offsets)
        if self.offsets[0] != 0 or self.offsets[-1] != tokens or (lengths < 1).any():
            raise OLMoDataError(f"'{self.folder / PROMPT_OFFSETS}' does not describe {n:,} prompts. {fix}")
        self.max_prompt_tokens = int(lengths.max())
        if self.max_prompt_tokens > self.seq_len:
            raise OLMoDataError(f"'{self.folder / PROMPT_OFFSETS}' holds prompts longer than seq_len. {fix}")
        self.ids = np.memmap(self.folder / PROMPT_IDS, dtype=self.dtype, mode="r", shape=(tokens,))
        rows = np.memmap(self.folder / INSTANCES, dtype=self.dtype, mode="r", shape=(n, self.seq_len))
        for i in range(n):  # every instance ends with its prompt: the data order's rows are these prompts
            length = int(lengths[i])
            if not np.array_equal(
                rows[i, self.seq_len - length :], self.ids[self.offsets[i] : self.offsets[i + 1]]
            ):
                raise OLMoDataError(
                    f"'{self.folder / INSTANCES}' instance {i} is not prompt {i} of '{self.folder / PROMPT_IDS}'. {fix}"
                )
        self.sources, self.ground_truths = [], []
        for line_no, line in read_json_lines(self.folder / GROUND_TRUTHS, what="ground truth"):
            if not (isinstance(line.get("id"), str) and isinstance(line.get("ground_truth"), str)):
                raise OLMoDataError(
                    f'\'{self.folder / GROUND_TRUTHS}\' line {line_no} is not {{"id": ..., "ground_truth": ...}}. {fix}'
                )
            self.sources.append(line["id"])
            self.ground_truths.append(line["ground_truth"])
        if len(self.ground_truths) != n:
            raise OLMoDataError(
                f"'{self.folder / GROUND_TRUTHS}' has {len(self.ground_truths):,} ground truths for {n:,} prompts. {fix}"
            )

    def __len__(self) -> int:
        return len(self.ground_truths)

    def prompt(self, index: int) -> np.ndarray:
        """Prompt ``index``'s token ids (int64)."""
        return np.asarray(self.ids[self.offsets[index] : self.offsets[index + 1]], dtype=np.int64)

    def check_vocab(self, vocab_size: int, key: str = "rl.prompts") -> None:
        """Refuse prompts holding a token id the model does not have (``vocab_size``), naming the folder."""
        top = int(self.ids.max()) if len(self.ids) else 0
        if top >= vocab_size:
            raise OLMoDataError(
                f"{key} '{self.folder}' holds token id {top}, but the model has {vocab_size:,} embeddings "
                f"(model.vocab_size): the prompts were tokenized with another tokenizer "
                f"({self.record.get('tokenizer')}). Prepare them with the model's tokenizer (-t)."
            )
