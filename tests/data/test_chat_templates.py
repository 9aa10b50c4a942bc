"""Chat templates for SFT data (issue 40, point 1): the built-in templates and a tokenizer's own give the token ids
and assistant masks transformers' ``apply_chat_template`` gives for the same template and tokenizer; the ``tulu``
built-in is the layout and the labels of ``prepare_sft_data.py``'s own format; templates run sandboxed; bad templates
and files are refused naming them."""

import json

import pytest

from olmo.data.chat_templates import BUILT_IN, ChatTemplate, load_chat_template
from olmo.data.sft import Formatter
from olmo.exceptions import OLMoDataError
from olmo.tokenizer import DEFAULT_TOKENIZER, Tokenizer

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
]

# A tokenizer's own template without generation blocks (ChatML, as many tokenizer_config.json files hold).
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizers():
    ours = Tokenizer.from_file(DEFAULT_TOKENIZER)
    transformers = pytest.importorskip("transformers")
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_object=ours.base, eos_token="<|endoftext|>")
    return ours, theirs


@pytest.mark.parametrize("name", sorted(BUILT_IN))
@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["one_turn", "two_turns"])
def test_built_in_templates_tokenize_as_transformers_does(tokenizers, name, conversation):
    ours, theirs = tokenizers
    ids, mask = load_chat_template(name).tokenize(conversation, ours.base)
    expected = theirs.apply_chat_template(
        conversation,
        chat_template=BUILT_IN[name],
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    assert ids == list(expected["input_ids"])
    assert mask == [bool(m) for m in expected["assistant_masks"]]
    labels = ours.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
    answers = [m["content"] for m in conversation if m["role"] == "assistant"]
    assert all(answer in labels for answer in answers) and "user" not in labels


def test_tulu_is_the_layout_and_labels_of_the_default_format(tokenizers):
    ours, _ = tokenizers
    template = load_chat_template("tulu")
    formatter = Formatter(ours, 512, ours.eos_token_id, 1)
    for conversation, (ids, mask, length) in zip(CONVERSATIONS, formatter.batch(CONVERSATIONS)):
        their_ids, their_mask = template.tokenize(conversation, ours.base)
        assert template.render(conversation) == ours.decode(ids[:length], skip_special_tokens=False)
        assert ours.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False) == ours.decode(
            [i for i, m in zip(their_ids, their_mask) if m], skip_special_tokens=False
        )


def test_a_tokenizers_own_template_is_read_beside_it_as_transformers_reads_it(tokenizers, tmp_path):
    ours, theirs = tokenizers
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHATML, "eos_token": "<|endoftext|>"})
    )
    template = load_chat_template(str(tmp_path))
    conversation = CONVERSATIONS[1]
    ids, mask = template.tokenize(conversation, ours.base)
    assert ids == theirs.apply_chat_template(conversation, chat_template=CHATML, tokenize=True, return_dict=False)
    # No generation blocks: an assistant turn is what it adds to the conversation after the generation prompt.
    labels = ours.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
    assert (
        labels
        == "Hello!\nHow can I help?<|im_end|>\nA parser walks into a bar; the bar was not in its grammar.<|im_end|>\n"
    )
    # chat_template.jinja beside it wins, as in transformers.
    (tmp_path / "chat_template.jinja").write_text(BUILT_IN["olmo3"])
    assert load_chat_template(str(tmp_path)).source == BUILT_IN["olmo3"]


@pytest.mark.parametrize(
    "source, expected",
    [
        ("{{ messages.__class__.__mro__ }}", "SecurityError"),
        ("{% set _ = messages.append(1) %}", "SecurityError"),
        ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
        ("{{ 'a' * 10000000000 }}", "more than a chat template needs"),
        ("{{ 2 ** 100000000 }}", "larger than a chat template needs"),
        ("{% for i in range(10 ** 9) %}{% endfor %}", "OverflowError|range too big"),
    ],
)
def test_templates_run_sandboxed_and_their_failures_name_them(tokenizers, source, expected):
    ours, _ = tokenizers
    with pytest.raises(ValueError, match=expected) as info:
        ChatTemplate(source, "'evil.jinja'").tokenize(CONVERSATIONS[0], ours.base)
    assert "'evil.jinja'" in str(info.value)


def test_a_template_whose_turns_are_not_continuations_is_refused(tokenizers):
    ours, _ = tokenizers
    # The last message gets another ending than the same message followed by more: without generation blocks,
    # the assistant's tokens cannot be found.
    source = "{% for m in messages %}{{ m['content'] }}{{ '!' if loop.last else '.' }}{% endfor %}"
    with pytest.raises(ValueError, match=r"messages\[1\] \(an assistant turn\)"):
        ChatTemplate(source, "'x'").tokenize(CONVERSATIONS[1], ours.base)


def test_bad_template_files_are_refused_naming_them(tmp_path):
    with pytest.raises(OLMoDataError, match="neither a built-in template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    with pytest.raises(OLMoDataError, match="has no chat_template string"):
        load_chat_template(str(tmp_path / "tokenizer_config.json"))
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}")
    with pytest.raises(OLMoDataError, match="broken.jinja' is not valid Jinja"):
        load_chat_template(str(tmp_path / "broken.jinja"))


def test_a_turn_starting_with_whitespace_is_labelled_whole(tokenizers):
    """The token of " Four" starts inside the turn although its text offset leaves the space out: every token that
    starts inside a span is a label (transformers' mask, which looks up the token at the span's first character,
    finds none there and leaves the whole turn out)."""
    ours, _ = tokenizers
    conversation = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": " Four. "}]
    ids, mask = load_chat_template("olmo3").tokenize(conversation, ours.base)
    assert (
        ours.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False).strip()
        == "Four. <|endoftext|>"
    )


def _write_conversations(path, conversations):
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    return path


def test_prepare_sft_data_with_a_chat_template(tokenizers, tmp_path):
    import numpy as np

    from olmo.testing import run_main

    ours, _ = tokenizers
    source = _write_conversations(tmp_path / "chat.jsonl", CONVERSATIONS)
    assert (
        run_main(
            "prepare_sft_data.py", source, "-o", tmp_path / "out", "--seq-len", "64", "--chat-template", "olmo3"
        )
        == 0
    )
    ids = np.fromfile(tmp_path / "out/input_ids.npy", dtype=np.uint16).reshape(-1, 64)
    mask = np.fromfile(tmp_path / "out/label_mask.npy", dtype=np.bool_).reshape(-1, 64)
    template = load_chat_template("olmo3")
    for row, conversation in enumerate(CONVERSATIONS):
        expected_ids, expected_mask = template.tokenize(conversation, ours.base)
        n = min(64, len(expected_ids))
        assert ids[row, :n].tolist() == expected_ids[:n] and mask[row, :n].tolist() == expected_mask[:n]
        assert (ids[row, n:] == 1).all() and not mask[row, n:].any()  # padding, never a label


def test_prepare_sft_data_names_the_line_a_template_fails_on(tmp_path):
    from olmo.testing import run_main

    source = _write_conversations(tmp_path / "chat.jsonl", CONVERSATIONS)
    strict = tmp_path / "strict.jinja"
    strict.write_text(
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system messages') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}"
    )
    with pytest.raises(
        OLMoDataError, match=r"chat.jsonl' line 1: the chat template .*strict.jinja' failed: .*no system"
    ):
        run_main("prepare_sft_data.py", source, "-o", tmp_path / "out", "--chat-template", str(strict))
    assert not (tmp_path / "out").exists()
    # A tokenizer's template written for another tokenizer: its eos_token is not this one's EOS.
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "</s>"}))
    with pytest.raises(Exception, match="ends turns with eos_token '</s>', which is not token --eos 50279"):
        run_main("prepare_sft_data.py", source, "-o", tmp_path / "out", "--chat-template", str(tmp_path))
