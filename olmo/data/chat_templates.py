"""Chat templates for SFT data (issue 40, first part): a conversation rendered as text by a Jinja template, the
tokenizer's own or a named built-in, then tokenized, with only the assistant turns marked as labels.

- **The template is data, never code.** It runs in Jinja's immutable sandbox (no attribute access to Python
  internals, no mutation of the messages), every step metered against a budget of memory and time it cannot get round
  (:mod:`.template_budget`: sizes of the template and of every value, steps, wall clock), with the context
  transformers gives a template: ``messages``, ``add_generation_prompt``, ``tools``, the special tokens (``eos_token``,
  ``bos_token``), ``raise_exception``, and the ``tojson`` filter; blocks trim their newlines (``trim_blocks``,
  ``lstrip_blocks``) and loops may ``break``. So the text, and the token ids of the whole text, are what
  ``apply_chat_template`` gives for the same template.
- **Where a template comes from** (:func:`load_chat_template`): a built-in name (:data:`BUILT_IN`), or a file: a
  ``.jinja`` template, or a ``tokenizer_config.json`` whose ``chat_template`` holds it. Beside a ``tokenizer.json``,
  ``chat_template.jinja`` wins over ``tokenizer_config.json``, as in transformers.
- **Labels** (:meth:`ChatTemplate.tokenize`): what the template's ``{% generation %}`` blocks render (transformers'
  ``return_assistant_tokens_mask``; the built-ins have them), or, in a template without them, each assistant turn as
  the text the template adds between rendering the conversation up to the turn with the generation prompt and
  rendering it through the turn (a template whose renderings are not prefixes of each other is refused, naming the
  turn). Tokens whose text starts inside such a span are labels; headers and everything else are context. The
  blocks' output is marked with a nonce drawn for each rendering that no input holds, and the text without the marks
  must equal the rendering without them, so no text of a message, a tool or a special token can move a label span.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import stat
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ..exceptions import OLMoDataError
from .template_budget import Meter, TemplateBudget, TemplateBudgetError

__all__ = ["BUILT_IN", "ChatTemplate", "load_chat_template"]

BUILT_IN = {
    # OLMo's Tulu layout (``prepare_sft_data.py`` without a template): an EOS first, then ``<|role|>`` headers; an
    # assistant turn's content and its EOS are trained on, the newline after them is not.
    "tulu": (
        "{{ eos_token }}"
        "{% for message in messages %}"
        "{{ '<|' + message['role'] + '|>\\n' }}"
        "{% if message['role'] == 'assistant' %}"
        "{% generation %}{{ message['content'] | trim + eos_token }}{% endgeneration %}{{ '\\n' }}"
        "{% else %}{{ message['content'] | trim + '\\n' }}{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
    ),
    # OLMo 3's ChatML layout: ``<|im_start|>role`` headers and ``<|im_end|>`` after each turn; the conversation's last
    # assistant turn ends with EOS instead. An assistant turn's content and its end marker are trained on.
    "olmo3": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' }}"
        "{% if message['role'] == 'assistant' %}"
        "{% generation %}{{ message['content'] }}{{ eos_token if loop.last else '<|im_end|>' }}{% endgeneration %}"
        "{{ '' if loop.last else '\\n' }}"
        "{% else %}{{ message['content'] + '<|im_end|>\\n' }}{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
}
"""Templates known by name (``--chat-template tulu``)."""


def _raise(message: str) -> None:
    raise ValueError(message)


def _generation_extension() -> Any:
    """The ``{% generation %} ... {% endgeneration %}`` block of transformers' templates: what it renders is the
    assistant's, the tokens to train on. While :meth:`ChatTemplate.label_spans` renders, the environment's
    ``label_markers`` wrap that output (:class:`_Markers`); otherwise it is output as it is."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller: Any) -> str:
            markers = getattr(self.environment, "label_markers", None)
            return caller() if markers is None else markers.start + caller() + markers.end

    return Generation


class _Markers:
    """The text a ``{% generation %}`` block's output is wrapped in for one rendering, found and removed after it
    (:meth:`unmark`). Each holds a fresh random nonce that no input of the rendering contains (checked), so nothing a
    conversation, a tool or a special token holds can open, close or move a label span."""

    def __init__(self, inputs: Sequence[Any]):
        while True:
            nonce = secrets.token_hex(16)
            if not any(nonce in text for text in _strings(inputs)):
                break
        self.start, self.end = f"\x00<generation {nonce}>\x00", f"\x00</generation {nonce}>\x00"

    def unmark(self, marked: str) -> Optional[tuple[str, list[tuple[int, int]]]]:
        """The text without the markers and the (start, end) spans they enclose (nested blocks count once), or None
        when they do not pair up (the template cut or reordered a block's output)."""
        text: list[str] = []
        spans: list[tuple[int, int]] = []
        pos = length = depth = opened = 0
        while True:
            starts, ends = marked.find(self.start, pos), marked.find(self.end, pos)
            if starts < 0 and ends < 0:
                break
            is_start = ends < 0 or 0 <= starts < ends
            at, marker = (starts, self.start) if is_start else (ends, self.end)
            text.append(marked[pos:at])
            length += at - pos
            pos = at + len(marker)
            depth += 1 if is_start else -1
            if depth < 0:
                return None
            if is_start and depth == 1:
                opened = length
            elif depth == 0:
                spans.append((opened, length))
        text.append(marked[pos:])
        return ("".join(text), spans) if depth == 0 else None


def _strings(value: Any) -> Iterator[str]:
    """Every string in ``value`` (dict keys too), however deeply nested."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


def _template_line(error: BaseException) -> str:
    """`` (template line N)``: where ``error`` was raised, as Jinja's traceback names it, or ""."""
    line, tb = None, error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return "" if line is None else f" (template line {line})"


@dataclass
class ChatTemplate:
    """A Jinja chat template and the special tokens it may use, evaluated within ``budget``."""

    source: str
    """The template's text."""
    name: str
    """Where it came from, for messages: a built-in name or a file."""
    eos_token: str = "<|endoftext|>"
    bos_token: str = ""
    budget: TemplateBudget = field(default_factory=TemplateBudget)
    """The limits of memory and time every evaluation of the template runs under (:mod:`.template_budget`)."""

    def __post_init__(self) -> None:
        from jinja2 import TemplateSyntaxError
        from jinja2.ext import loopcontrols

        from .template_sandbox import BudgetedSandbox

        if len(self.source) > self.budget.max_template_chars:
            raise OLMoDataError(
                f"The chat template {self.name} is {len(self.source):,} characters long, more than the "
                f"{self.budget.max_template_chars:,} a chat template may have "
                f"(olmo.data.template_budget.MAX_TEMPLATE_CHARS; real ones are a few KB). Pass the template itself, "
                f"or a built-in one ({', '.join(BUILT_IN)})."
            )
        env = BudgetedSandbox(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _generation_extension()]
        )
        env.filters["tojson"] = env.metered_filter("tojson", _tojson)
        env.globals["raise_exception"] = _raise
        self._env = env
        try:
            self._template = env.from_string(env.parse_metered(self.source))
        except TemplateSyntaxError as e:
            raise OLMoDataError(
                f"The chat template {self.name} is not valid Jinja (line {e.lineno}: {e.message}). Fix the template "
                f"or pass a built-in one ({', '.join(BUILT_IN)})."
            ) from None
        except (RecursionError, MemoryError, SyntaxError, ValueError, OverflowError) as e:
            raise OLMoDataError(
                f"The chat template {self.name} cannot be compiled ({type(e).__name__}: {e}; nested too deeply?). "
                f"Fix the template or pass a built-in one ({', '.join(BUILT_IN)})."
            ) from None
        self._has_blocks = re.search(r"{%-?\s*generation\s*-?%}", self.source) is not None

    def render(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = False, tools: Optional[list] = None
    ) -> str:
        """The text of ``messages``; the template's own errors (``raise_exception``, a missing key) and an evaluation
        over its budget become ``ValueError``\\s naming the template."""
        return self._render(messages, add_generation_prompt, tools, None)

    def _render(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool,
        tools: Optional[list],
        markers: Optional[_Markers],
    ) -> str:
        deadline = time.monotonic() + self.budget.max_seconds  # each rendering its own: steps bound the time first
        self._env.meter, self._env.label_markers = Meter(self.budget, deadline), markers
        try:
            text = self._template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                eos_token=self.eos_token,
                bos_token=self.bos_token,
            )
            return self._env.meter.result(text)
        except TemplateBudgetError as e:
            raise TemplateBudgetError(
                f"the chat template {self.name} went over its budget{_template_line(e)}: {e}"
            ) from None
        except Exception as e:  # the template's own failure, whatever it raised
            raise ValueError(
                f"the chat template {self.name} failed: {type(e).__name__}: {e}{_template_line(e)}"
            ) from None
        finally:
            self._env.meter, self._env.label_markers = Meter(self.budget, deadline), None

    def label_spans(self, messages: Sequence[dict[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
        """The whole text and the (start, end) character spans to train on: the template's ``{% generation %}``
        blocks when it has them, else each assistant turn as the text it adds to the conversation before it.

        The blocks are found by markers no input can hold (:class:`_Markers`), and the text without them must be the
        text the template renders without markers: otherwise the template is refused (a ``ValueError``)."""
        if self._has_blocks:
            markers = _Markers([messages, self.eos_token, self.bos_token])
            found = markers.unmark(self._render(messages, False, None, markers))
            if found is None or found[0] != self._render(messages, False, None, None):
                raise ValueError(
                    f"the chat template {self.name} changes or cuts the output of its {{% generation %}} blocks "
                    f"(a filter or variable applied to it), so the assistant's tokens cannot be found; put the "
                    f"blocks around the assistant's text as it is output"
                )
            return found
        text = self._render(messages, False, None, None)
        spans = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            before = self._render(messages[:i], True, None, None)
            through = self._render(messages[: i + 1], False, None, None)
            if not text.startswith(through) or not through.startswith(before):
                raise ValueError(
                    f"the chat template {self.name} does not render messages[{i}] (an assistant turn) as a "
                    f"continuation of the turns before it, so its tokens cannot be told apart from the rest; use a "
                    f"template whose renderings of a conversation's beginnings are prefixes of each other"
                )
            spans.append((len(before), len(through)))
        return text, spans

    def tokenize(self, messages: Sequence[dict[str, Any]], tokenizer: Any) -> tuple[list[int], list[bool]]:
        """Token ids of the whole rendered text (no special tokens added: the template writes them) and the label
        mask: True for a token whose text starts inside an assistant turn. ``tokenizer`` is a
        ``tokenizers.Tokenizer`` (``olmo.tokenizer.Tokenizer.base``)."""
        text, spans = self.label_spans(messages)
        encoding = tokenizer.encode(text, add_special_tokens=False)
        # A token's offsets leave out the spaces it starts with (its start is where its text after them begins), and
        # a token of spaces alone has an empty range at the spaces' end: either way its start lies in its turn.
        mask = [any(a <= start < b for a, b in spans) for start, _ in encoding.offsets]
        return list(encoding.ids), mask


def _tojson(value: Any, ensure_ascii: bool = False, indent: Optional[int] = None, sort_keys: bool = False) -> str:
    """Jinja's ``tojson`` as chat templates expect it: plain JSON, not HTML-escaped."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, sort_keys=sort_keys)


def load_chat_template(
    spec: str, eos_token: str = "<|endoftext|>", bos_token: str = "", budget: Optional[TemplateBudget] = None
) -> ChatTemplate:
    """The template ``spec`` names: a built-in (:data:`BUILT_IN`), a ``.jinja`` file, a ``tokenizer_config.json``
    (its ``chat_template``), or a folder holding either (``chat_template.jinja`` first, as transformers reads it).
    A file is read only if it is a regular file of at most ``budget.max_template_file_bytes``.

    :raises OLMoDataError: naming ``spec`` and what to pass instead.
    """
    budget = budget or TemplateBudget()
    if spec in BUILT_IN:
        return ChatTemplate(BUILT_IN[spec], f"'{spec}' (built in)", eos_token, bos_token, budget)
    path = Path(spec)
    if path.is_dir():
        for name in ("chat_template.jinja", "tokenizer_config.json"):
            if (path / name).exists() or (path / name).is_symlink():
                path = path / name
                break
    if not path.exists() and not path.is_symlink():
        raise OLMoDataError(
            f"--chat-template '{spec}' is neither a built-in template ({', '.join(BUILT_IN)}) nor a file (a .jinja "
            f"template or a tokenizer_config.json with a chat_template) nor a folder holding one."
        )
    config = _read_template_file(path, budget.max_template_file_bytes)
    if not isinstance(config, dict):
        return ChatTemplate(config, f"'{path}'", eos_token, bos_token, budget)
    template = config.get("chat_template")
    if isinstance(template, list):  # transformers' named templates: the default one
        template = next(
            (t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None
        )
    if not isinstance(template, str):
        raise OLMoDataError(
            f"'{path}' has no chat_template string; pass a tokenizer_config.json that has one, a .jinja file, or a "
            f"built-in template ({', '.join(BUILT_IN)})."
        )
    eos = config.get("eos_token", eos_token)
    eos = eos.get("content", eos_token) if isinstance(eos, dict) else eos
    bos = config.get("bos_token") or bos_token
    bos = bos.get("content", bos_token) if isinstance(bos, dict) else bos
    return ChatTemplate(template, f"'{path}'", str(eos), str(bos), budget)


def _read_template_file(path: Path, limit: int) -> Any:
    """The text of a template file, or the object of a ``.json`` one; only a regular file of at most ``limit``
    bytes is read (not a FIFO or a device, which could block or never end).

    :raises OLMoDataError: naming the file and what to pass instead.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise OLMoDataError(
            f"The chat template '{path}' cannot be read ({e.strerror}); pass a readable file."
        ) from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise OLMoDataError(
                f"The chat template '{path}' is not a regular file (a FIFO, a device or a socket, perhaps through a "
                f"symlink); pass a .jinja file or a tokenizer_config.json."
            )
        data = f.read(limit + 1)
    if len(data) > limit:
        raise OLMoDataError(
            f"The chat template file '{path}' is larger than {limit:,} bytes "
            f"(olmo.data.template_budget.MAX_TEMPLATE_FILE_BYTES); a chat template is a few KB. Pass the template "
            f"itself (a .jinja file) or the tokenizer's tokenizer_config.json."
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise OLMoDataError(
            f"The chat template '{path}' is not UTF-8 (byte {data[e.start]:#04x} at offset {e.start}); pass a UTF-8 "
            f"file."
        ) from None
    if path.suffix != ".json":
        return text
    try:
        config = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise OLMoDataError(
            f"'{path}' is not valid JSON ({e}); pass a tokenizer_config.json or a .jinja file."
        ) from None
    return config if isinstance(config, dict) else {}
