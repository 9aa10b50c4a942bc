"""Chat templates under hostile input (issue 50): no text of a conversation, a tool or a special token can move the
label spans, whatever field it is in and whichever template renders it; every evaluation runs within a budget of
memory and time that stops it with one paragraph naming the template, the limit and the fix; template files are read
only when regular and small; normal data gives the same token ids and masks as before."""

import hashlib
import json
import os

import numpy as np
import pytest

from olmo.data.chat_templates import BUILT_IN, ChatTemplate, load_chat_template
from olmo.data.sft import Formatter
from olmo.data.template_budget import TemplateBudget, TemplateBudgetError
from olmo.exceptions import OLMoDataError
from olmo.testing import run_main
from olmo.tokenizer import DEFAULT_TOKENIZER, Tokenizer

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# A template that puts every field of a message, the tools and both special tokens into the text.
EVERY_FIELD = (
    "{{ bos_token }}{% if tools %}{{ tools | tojson }}{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}{% if m.name %} {{ m.name }}{% endif %}>"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% for c in m.tool_calls or [] %}"
    "{{ c | tojson }}{% endfor %}{{ eos_token }}{% endgeneration %}"
    "{% else %}{{ m['content'] }}{% for c in m.tool_calls or [] %}{{ c | tojson }}{% endfor %}{% endif %}\n"
    "{% endfor %}"
)

CONVERSATIONS = [
    [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "Four."},
    ],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!\nHow can I help?"},
        {"role": "user", "content": "Tell me a joke about\n\nparsers."},
        {"role": "assistant", "content": "A parser walks into a bar; the bar was not in its grammar."},
    ],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": " Four. "}],
    [
        {"role": "system", "content": "  Be brief.\n"},
        {"role": "user", "content": "Héllo 👋 <|im_start|>x"},
        {"role": "assistant", "content": "Hi\n\n"},
        {"role": "user", "content": "again"},
    ],
]
# sha256 of every conversation's token ids (int64) and mask (bool), recorded with the code before issue 50.
BEFORE = {
    "tulu": "097fdb2cf31b81cb65cc502b7357700c53a1764a41100b97255d451d08bcb272",
    "olmo3": "8706cf7cee6614c8d74263f2c429629cfef03bc5ffc95ee19a5cac74ab8ed3b8",
    "chatml": "35184270f3625f1c28238777e3fd2636fdb841b40e88e3ed814805b0a93fd6c0",
}

OLD_START, OLD_END = "\x00<generation>\x00", "\x00</generation>\x00"
HOSTILE = [
    OLD_END,  # closes the assistant's span early: what follows would be context
    OLD_START,  # a dangling start: everything after it would be labels
    OLD_START + "user text" + OLD_END,
    OLD_END + "<|user|>\n" + OLD_START,
    "\x00<generation 0123456789abcdef0123456789abcdef>\x00",  # today's marker format, a guessed nonce
    "\x00</generation 0123456789abcdef0123456789abcdef>\x00",
    "\x00\x00<generation\x00",  # a partial marker and NUL bytes
    "{% generation %}x{% endgeneration %}",
]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_file(DEFAULT_TOKENIZER)


def _template(name):
    return ChatTemplate(CHATML, "'chatml'") if name == "chatml" else load_chat_template(name)


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_normal_data_gives_the_ids_and_masks_it_gave_before(tokenizer, name):
    digest = hashlib.sha256()
    for conversation in CONVERSATIONS:
        ids, mask = _template(name).tokenize(conversation, tokenizer.base)
        digest.update(np.asarray(ids, dtype=np.int64).tobytes() + np.asarray(mask, dtype=np.bool_).tobytes())
    assert digest.hexdigest() == BEFORE[name]


def _expected_labels(name, messages, eos="<|endoftext|>"):
    """The label text of each assistant turn, as the template's own definition gives it."""
    labels = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if name == "tulu":
            labels.append(m["content"].strip() + eos)
        elif name == "olmo3":
            labels.append(m["content"] + (eos if i == len(messages) - 1 else "<|im_end|>"))
        elif name == "chatml":
            labels.append(m["content"] + "<|im_end|>\n")
        else:  # EVERY_FIELD
            calls = "".join(json.dumps(c, ensure_ascii=False) for c in m.get("tool_calls") or [])
            labels.append(m["content"] + calls + eos)
    return labels


def _hostile_conversations(text, fields):
    """A conversation with ``text`` in each message field of ``fields`` (role: the system message's)."""
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "question"},
        {"role": "assistant", "content": "answer one"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "answer two"},
    ]
    for field in fields:
        for m in messages:
            if field == "role" and m["role"] == "system":
                m["role"] = "system" + text
            elif field == "content":
                m["content"] = f"{m['content']} {text} end"
            elif field == "name":
                m["name"] = text
            elif field == "tool_calls":
                m["tool_calls"] = [{"name": text, "arguments": {text: text}}]
    return messages


@pytest.mark.parametrize("text", HOSTILE, ids=range(len(HOSTILE)))
@pytest.mark.parametrize("name", ["tulu", "olmo3", "chatml"])
def test_marker_text_in_any_message_field_does_not_move_the_labels(tokenizer, name, text):
    template = _template(name)
    for fields in (["content"], ["role"], ["role", "content"]):
        messages = _hostile_conversations(text, fields)
        full, spans = template.label_spans(messages)
        assert full == template.render(messages)  # the markers leave no trace
        assert [full[a:b] for a, b in spans] == _expected_labels(name, messages)
        ids, mask = template.tokenize(messages, tokenizer.base)
        assert ids == tokenizer.base.encode(full, add_special_tokens=False).ids
        labelled = [s for s, m in zip(tokenizer.base.encode(full, add_special_tokens=False).offsets, mask) if m]
        assert all(any(a <= start < b for a, b in spans) for start, _ in labelled)


@pytest.mark.parametrize("text", HOSTILE, ids=range(len(HOSTILE)))
def test_marker_text_in_names_tool_calls_tools_and_special_tokens_does_not_move_the_labels(text):
    messages = _hostile_conversations(text, ["content", "name", "tool_calls", "role"])
    for eos, bos in (("<|endoftext|>", text), (text + "</s>", "")):
        template = ChatTemplate(EVERY_FIELD, "'every_field.jinja'", eos_token=eos, bos_token=bos)
        full, spans = template.label_spans(messages)
        assert full == template.render(messages)
        assert [full[a:b] for a, b in spans] == _expected_labels("every", messages, eos)
    # tools reach the template as a keyword of the rendering: the text, never the labels
    template = ChatTemplate(EVERY_FIELD, "'every_field.jinja'")
    rendered = template.render(messages, tools=[{"name": text, "description": OLD_START}])
    assert json.dumps([{"name": text, "description": OLD_START}], ensure_ascii=False) in rendered


def test_the_default_tulu_format_labels_only_the_assistants_text(tokenizer):
    """Without a template each message is tokenized alone, so marker text is text there too."""
    messages = _hostile_conversations(OLD_START + OLD_END, ["content"])
    ids, mask, length = Formatter(tokenizer, 512, tokenizer.eos_token_id, 1).batch([messages])[0]
    labels = tokenizer.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
    assert labels == "".join(_expected_labels("tulu", messages))


def test_prepare_sft_data_keeps_labels_on_the_assistant_with_hostile_text(tokenizer, tmp_path):
    conversations = [_hostile_conversations(text, ["content"]) for text in HOSTILE[:4]]
    source = tmp_path / "chat.jsonl"
    source.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    args = ("-o", tmp_path / "out", "--seq-len", "400", "--chat-template", "olmo3")
    assert run_main("prepare_sft_data.py", source, *args) == 0
    ids = np.fromfile(tmp_path / "out/input_ids.npy", dtype=np.uint16).reshape(-1, 400)
    mask = np.fromfile(tmp_path / "out/label_mask.npy", dtype=np.bool_).reshape(-1, 400)
    for row, conversation in enumerate(conversations):
        labels = tokenizer.decode(ids[row][mask[row]].tolist(), skip_special_tokens=False)
        assert labels == "".join(_expected_labels("olmo3", conversation))


@pytest.mark.parametrize(
    "source",
    [
        "{% filter upper %}{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}"
        "{% endfor %}{% endfilter %}",
        "{% for m in messages %}{% set x %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endset %}"
        "{{ x[3:] }}{% endfor %}",
        "{% for m in messages %}{% set x %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endset %}"
        "{{ x|length }}{% endfor %}",
    ],
    ids=["upper", "cut", "replaced"],
)
def test_a_template_that_alters_its_generation_blocks_output_is_refused(source):
    with pytest.raises(ValueError, match=r"changes or cuts the output of its \{% generation %\} blocks"):
        ChatTemplate(source, "'t.jinja'").label_spans(CONVERSATIONS[0])


SMALL = TemplateBudget(
    max_template_chars=4000,
    max_template_file_bytes=8000,
    max_string_chars=20_000,
    max_items=1000,
    max_int_bits=256,
    max_depth=20,
    max_render_chars=100_000,
    max_steps=20_000,
)

# (template, the limit it goes over): the examples and more of each kind, against SMALL's limits.
OVER_BUDGET = [
    ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "STRING"),
    ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "STRING"),
    ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s * 2 %}{% endfor %}", "STRING"),
    (
        "{% set ns = namespace(s='xy') %}{% for i in range(40) %}{% set ns.s = ns.s|replace('x', ns.s) %}"
        "{% endfor %}",
        "STRING",
    ),
    ("{{ 'x'|center(10**9) }}", "ITEMS"),
    ("{{ 'x'.center(1000000000) }}", "ITEMS"),
    ("{{ 'x'|center(1000) * 100 }}", "STRING"),
    ("{{ '%*s'|format(10**9, '') }}", "ITEMS"),
    ("{{ '%999999999s'|format('') }}", "STRING"),
    ("{{ '%999999999s' % '' }}", "STRING"),
    ("{{ '%.999999999f' % 1.5 }}", "STRING"),
    ("{{ '{:>999999999}'.format('x') }}", "STRING"),
    ("{{ ('{0:900}' * 100).format('x') }}", "STRING"),
    ("{{ messages|tojson(indent=10**9) }}", "ITEMS"),
    ("{{ (messages * 100)|tojson(indent=999) }}", "STRING"),
    ("{{ messages|pprint * 1000 }}", "STRING"),
    ("{% set s = 'x' * 10000 %}{{ ([s] * 1000)|join }}", "STRING"),
    ("{% set s = 'x' * 10000 %}{{ [s] * 1000 }}", "STRING"),
    ("{{ [1] * 2000 }}", "ITEMS"),
    ("{{ 'ab'.join(['x'] * 999) * 100 }}", "STRING"),
    ("{{ ('x' * 1000).replace('', 'yyyyyyyyyyyyyyyyyyyyyyyyy') }}", "STRING"),
    ("{{ ('\\n' * 1000)|indent(100) }}", "STRING"),
    ("{{ ('x' * 1000)|wordwrap(1, wrapstring='yyyyyyyyyyyyyyyyyyyyyyy') }}", "STRING"),
    ("{{ ('\\t' * 1000).expandtabs(1000) }}", "STRING"),
    ("{{ ('x' * 1000).translate({120: 'y' * 1000}) }}", "STRING"),
    ("{% for i in range(10**4) %}{% for j in range(10**4) %}{% endfor %}{% endfor %}", "STEPS"),
    (
        "{% for m in range(100) %}{% for n in range(100) %}{% for o in range(100) %}{% endfor %}{% endfor %}"
        "{% endfor %}",
        "STEPS",
    ),
    (
        "{% for i in range(1000) recursive %}{% if loop.depth < 3 %}{{ loop(range(1000)) }}{% endif %}{% endfor %}",
        "STEPS",
    ),
    (
        "{% macro m(n) %}{% for i in range(1000) %}{% endfor %}{% if n < 50 %}{{ m(n + 1) }}{% endif %}{% endmacro %}"
        "{{ m(0) }}",
        "STEPS",
    ),
    ("{{ 2**2**2**2**2**2**2**2**2**2 }}", "INT_BITS"),
    ("{{ (2**200)**200 }}", "INT_BITS"),
    ("{% set ns = namespace(n=3) %}{% for i in range(100) %}{% set ns.n = ns.n * ns.n %}{% endfor %}", "INT_BITS"),
    ("{{ lipsum(10**6) }}", "ITEMS"),
    ("{{ lipsum(1000) }}", "STEPS"),
    ("{{ lipsum(5, max=10**9) }}", "ITEMS"),
    (
        "{% set ns = namespace(a=[]) %}{% for i in range(1000) %}{% set ns.a = [ns.a] %}{% endfor %}{{ ns.a }}",
        "DEPTH",
    ),
    ("{% for i in range(300) %}{{ 'y' * 1000 }}{% endfor %}", "RENDER_CHARS"),
    (
        "{% macro m() %}{% for i in range(100) %}" + "A" * 100 + "{% endfor %}{% endmacro %}"
        "{% for i in range(20) %}{% set y = m() %}{% endfor %}",
        "RENDER_CHARS",
    ),
    ("{% set x %}{% for i in range(3000) %}{{ 'y' * 10 }}{% endfor %}{% endset %}{{ x|length }}", "STRING"),
    ("{% filter center(900) %}{% for i in range(300) %}" + "x" * 100 + "{% endfor %}{% endfilter %}", "STRING"),
    ("{{ dict(a=1).get('a', 10**9) }}", "ITEMS"),
    ("{{ range(5)|batch(10**9, 'x')|list }}", "ITEMS"),
]


@pytest.mark.parametrize("source, limit", OVER_BUDGET, ids=range(len(OVER_BUDGET)))
def test_a_template_over_its_budget_stops_naming_the_limit(source, limit):
    with pytest.raises(TemplateBudgetError) as info:
        ChatTemplate(source, "'evil.jinja'", budget=SMALL).label_spans(CONVERSATIONS[0])
    message = str(info.value)
    assert message.startswith("the chat template 'evil.jinja' went over its budget")
    assert f"olmo.data.template_budget.MAX_{limit}" in message and "\n" not in message


def test_the_wall_clock_deadline_stops_a_rendering():
    late = TemplateBudget(max_seconds=-1.0)  # a deadline already past: the first step stops
    with pytest.raises(TemplateBudgetError, match="took more than -1 s .*MAX_SECONDS"):
        load_chat_template("olmo3", budget=late).label_spans(CONVERSATIONS[0])


def test_the_built_in_templates_fit_the_small_budget():
    for name in BUILT_IN:
        template = load_chat_template(name, budget=SMALL)
        for conversation in CONVERSATIONS:
            assert template.label_spans(conversation)[0] == load_chat_template(name).render(conversation)


def test_a_template_source_over_the_limit_is_refused_before_compiling():
    with pytest.raises(OLMoDataError, match="4,001 characters long.*MAX_TEMPLATE_CHARS"):
        ChatTemplate("x" * 4001, "'big.jinja'", budget=SMALL)
    nested = "{{ " + "(" * 3000 + "1" + ")" * 3000 + " }}"
    with pytest.raises(OLMoDataError, match="'nested.jinja'"):
        ChatTemplate(nested, "'nested.jinja'")


def test_prepare_sft_data_stops_at_the_budget_naming_line_and_template(tmp_path):
    source = tmp_path / "chat.jsonl"
    source.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    evil = tmp_path / "evil.jinja"
    evil.write_text(
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}"
    )
    with pytest.raises(
        OLMoDataError,
        match=r"chat.jsonl' line 1: the chat template '.*evil.jinja' went over its "
        r"budget .*MAX_STRING_CHARS.*pass another --chat-template",
    ):
        run_main("prepare_sft_data.py", source, "-o", tmp_path / "out", "--chat-template", str(evil))
    assert not (tmp_path / "out").exists()


def test_template_files_are_read_only_when_regular_and_small(tmp_path):
    fifo = tmp_path / "fifo.jinja"
    os.mkfifo(fifo)
    with pytest.raises(OLMoDataError, match="not a regular file"):
        load_chat_template(str(fifo))  # would block forever if opened for a plain read
    (tmp_path / "zero.jinja").symlink_to("/dev/zero")
    with pytest.raises(OLMoDataError, match="not a regular file"):
        load_chat_template(str(tmp_path / "zero.jinja"))
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "chat_template.jinja").symlink_to("/dev/zero")
    with pytest.raises(OLMoDataError, match="chat_template.jinja' is not a regular file"):
        load_chat_template(str(folder))
    big = tmp_path / "big.jinja"
    big.write_text("x" * 8001)
    with pytest.raises(OLMoDataError, match="larger than 8,000 bytes.*MAX_TEMPLATE_FILE_BYTES"):
        load_chat_template(str(big), budget=SMALL)
    (tmp_path / "latin1.jinja").write_bytes(b"caf\xe9")
    with pytest.raises(OLMoDataError, match="not UTF-8"):
        load_chat_template(str(tmp_path / "latin1.jinja"))
    deep = tmp_path / "tokenizer_config.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(OLMoDataError, match="not valid JSON|no chat_template string"):
        load_chat_template(str(deep))
    (tmp_path / "dangling.jinja").symlink_to(tmp_path / "nowhere")
    with pytest.raises(OLMoDataError, match="cannot be read"):
        load_chat_template(str(tmp_path / "dangling.jinja"))
