"""Chat templates for SFT data (issue 40, first part): a conversation rendered as text by a Jinja template, the
tokenizer's own or a named built-in, then tokenized, with only the assistant turns marked as labels.

- **The template is data, never code.** It runs in Jinja's immutable sandbox (no attribute access to Python
  internals, no mutation of the messages; ``range`` bounded, and here no ``*`` or ``**`` that would build a string,
  list or number beyond any chat's size), with the context transformers gives a template: ``messages``,
  ``add_generation_prompt``, ``tools``, the special tokens (``eos_token``, ``bos_token``), ``raise_exception``, and
  the ``tojson`` filter; blocks trim their newlines (``trim_blocks``, ``lstrip_blocks``) and loops may ``break``.
  So the text, and the token ids of the whole text, are what ``apply_chat_template`` gives for the same template.
- **Where a template comes from** (:func:`load_chat_template`): a built-in name (:data:`BUILT_IN`), or a file: a
  ``.jinja`` template, or a ``tokenizer_config.json`` whose ``chat_template`` holds it. Beside a ``tokenizer.json``,
  ``chat_template.jinja`` wins over ``tokenizer_config.json``, as in transformers.
- **Labels** (:meth:`ChatTemplate.tokenize`): what the template's ``{% generation %}`` blocks render (transformers'
  ``return_assistant_tokens_mask``; the built-ins have them), or, in a template without them, each assistant turn as
  the text the template adds between rendering the conversation up to the turn with the generation prompt and
  rendering it through the turn (a template whose renderings are not prefixes of each other is refused, naming the
  turn). Tokens whose text starts inside such a span are labels; headers and everything else are context.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ..exceptions import OLMoDataError

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


_MAX_REPEAT = 1_000_000
"""The longest string or list a template may build with ``*``."""
_MAX_EXPONENT = 1_000
"""The largest exponent a template may raise to with ``**``."""


def _raise(message: str) -> None:
    raise ValueError(message)


_START, _END = "\x00<generation>\x00", "\x00</generation>\x00"
"""What a ``{% generation %}`` block's output is wrapped in while rendering, then removed (:func:`_unmark`)."""


def _generation_extension() -> Any:
    """The ``{% generation %} ... {% endgeneration %}`` block of transformers' templates: what it renders is the
    assistant's, the tokens to train on."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller: Any) -> str:
            return _START + caller() + _END

    return Generation


def _unmark(marked: str) -> tuple[str, list[tuple[int, int]]]:
    """The text without the generation markers, and the (start, end) spans they enclosed."""
    text: list[str] = []
    spans: list[tuple[int, int]] = []
    pos = 0
    length = 0
    while True:
        start = marked.find(_START, pos)
        if start < 0:
            text.append(marked[pos:])
            return "".join(text), spans
        end = marked.find(_END, start)
        text.append(marked[pos:start])
        length += start - pos
        inner = marked[start + len(_START) : end]
        text.append(inner)
        spans.append((length, length + len(inner)))
        length += len(inner)
        pos = end + len(_END)


@dataclass
class ChatTemplate:
    """A Jinja chat template and the special tokens it may use."""

    source: str
    """The template's text."""
    name: str
    """Where it came from, for messages: a built-in name or a file."""
    eos_token: str = "<|endoftext|>"
    bos_token: str = ""

    def __post_init__(self) -> None:
        from jinja2 import TemplateSyntaxError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class Bounded(ImmutableSandboxedEnvironment):  # type: ignore[misc]
            """No arithmetic that builds something huge: a template may not exhaust the memory either."""

            intercepted_binops = frozenset({"*", "**"})

            def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
                if operator == "**" and isinstance(right, (int, float)) and abs(right) > _MAX_EXPONENT:
                    raise ValueError(f"the exponent {right} is larger than a chat template needs")
                if operator == "*" and any(isinstance(v, (str, list, tuple)) for v in (left, right)):
                    length = len(left) * right if isinstance(left, (str, list, tuple)) else len(right) * left
                    if length > _MAX_REPEAT:
                        raise ValueError(f"repeating to {length:,} items is more than a chat template needs")
                return super().call_binop(context, operator, left, right)

        env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _generation_extension()])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        try:
            self._template = env.from_string(self.source)
        except TemplateSyntaxError as e:
            raise OLMoDataError(
                f"The chat template {self.name} is not valid Jinja (line {e.lineno}: {e.message}). Fix the template "
                f"or pass a built-in one ({', '.join(BUILT_IN)})."
            ) from None

    def render(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = False, tools: Optional[list] = None
    ) -> str:
        """The text of ``messages``; the template's own errors (``raise_exception``, a missing key) become
        ``ValueError``s naming the template."""
        return _unmark(self._render(messages, add_generation_prompt, tools))[0]

    def _render(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = False, tools: Optional[list] = None
    ) -> str:
        try:
            return self._template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                eos_token=self.eos_token,
                bos_token=self.bos_token,
            )
        except Exception as e:  # the template's own failure, whatever it raised
            raise ValueError(f"the chat template {self.name} failed: {type(e).__name__}: {e}") from None

    def label_spans(self, messages: Sequence[dict[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
        """The whole text and the (start, end) character spans to train on: the template's ``{% generation %}``
        blocks when it has them, else each assistant turn as the text it adds to the conversation before it."""
        text, spans = _unmark(self._render(messages))
        if spans or re.search(r"{%-?\s*generation\s*-?%}", self.source):
            return text, spans
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            through = self.render(messages[: i + 1])
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


def load_chat_template(spec: str, eos_token: str = "<|endoftext|>", bos_token: str = "") -> ChatTemplate:
    """The template ``spec`` names: a built-in (:data:`BUILT_IN`), a ``.jinja`` file, a ``tokenizer_config.json``
    (its ``chat_template``), or a folder holding either (``chat_template.jinja`` first, as transformers reads it).

    :raises OLMoDataError: naming ``spec`` and what to pass instead.
    """
    if spec in BUILT_IN:
        return ChatTemplate(BUILT_IN[spec], f"'{spec}' (built in)", eos_token, bos_token)
    path = Path(spec)
    if path.is_dir():
        for name in ("chat_template.jinja", "tokenizer_config.json"):
            if (path / name).is_file():
                path = path / name
                break
    if not path.is_file():
        raise OLMoDataError(
            f"--chat-template '{spec}' is neither a built-in template ({', '.join(BUILT_IN)}) nor a file (a .jinja "
            f"template or a tokenizer_config.json with a chat_template) nor a folder holding one."
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise OLMoDataError(
            f"The chat template '{path}' cannot be read ({e}); pass a readable UTF-8 file."
        ) from None
    if path.suffix != ".json":
        return ChatTemplate(text, f"'{path}'", eos_token, bos_token)
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise OLMoDataError(
            f"'{path}' is not valid JSON ({e}); pass a tokenizer_config.json or a .jinja file."
        ) from None
    template = config.get("chat_template") if isinstance(config, dict) else None
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
    return ChatTemplate(template, f"'{path}'", str(eos), str(bos))
