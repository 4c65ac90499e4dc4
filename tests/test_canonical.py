"""Canonicalizer: normalisation, segments, chat rendering, canonical ids (contract 1)."""

from __future__ import annotations

import copy
from itertools import pairwise

import pytest
from helpers import CHATML, tiny_tokenizer

from kvboost_rag.canonical import MESSAGE_END_WINDOW, Canonicalizer, Segment, normalize_text
from kvboost_rag.errors import InvalidRequestError, UnsupportedModelError

ROUND_TRIP_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé text, emoji 🙂 and 🤖💡 numbers 12345",
    "tabs\tand\t\tnew lines\n\ntoo\n",
    "  leading and trailing spaces  ",
    "café naïve façade — “quotes” 日本語",
]

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Which animal jumps over the dog?"},
    {"role": "assistant", "content": "The fox."},
    {"role": "user", "content": "And what colour is it?"},
]


@pytest.fixture
def canon():
    return Canonicalizer(tiny_tokenizer())


def tokenizer_with_template(template):
    """A copy of the tiny tokenizer with another chat template (the cached one stays untouched)."""
    tok = copy.deepcopy(tiny_tokenizer())
    tok.chat_template = template
    return tok


# -- normalize_text ----------------------------------------------------------


def test_normalize_text_line_endings():
    assert normalize_text("a\r\nb\rc\nd") == "a\nb\nc\nd"
    assert normalize_text("\r\r\n") == "\n\n"


def test_normalize_text_nfc():
    assert normalize_text("e\u0301") == "\u00e9"
    assert normalize_text("cafe\u0301\r\n") == "caf\u00e9\n"
    assert normalize_text("already é") == "already é"


# -- plain inputs ------------------------------------------------------------


def test_string_prompt_is_one_normalized_text_segment(canon):
    p = canon.canonicalize("cafe\u0301\r\nbar")
    assert p.segments == (Segment("caf\u00e9\nbar", "text"),)
    assert p.text == "caf\u00e9\nbar"
    assert list(p.token_ids) == list(canon.tokenize("caf\u00e9\nbar"))
    assert len(p) == len(p.token_ids)


def test_segment_list_keeps_kinds_and_normalizes(canon):
    p = canon.canonicalize(["sys\r\n", Segment("doc e\u0301", "document"), "question?"])
    assert p.segments == (
        Segment("sys\n", "text"),
        Segment("doc \u00e9", "document"),
        Segment("question?", "text"),
    )
    assert p.segment_token_ids == tuple(canon.tokenize(s.text) for s in p.segments)


def test_segment_spans_cover_the_token_ids(canon):
    p = canon.canonicalize(["alpha beta", "gamma", "delta epsilon"])
    spans = p.segment_spans
    assert spans[0][0] == 0 and spans[-1][1] == len(p)
    for (_, e0), (s1, _) in pairwise(spans):
        assert e0 == s1
    for (start, end), ids in zip(spans, p.segment_token_ids, strict=True):
        assert tuple(p.token_ids[start:end]) == ids


def test_empty_segments_are_dropped(canon):
    p = canon.canonicalize(["", "hello", ""])
    assert p.segments == (Segment("hello", "text"),)


@pytest.mark.parametrize(
    "prompt", ["", [], ["", ""], ()], ids=["empty-str", "empty-list", "empty-strs", "empty-tuple"]
)
def test_empty_prompt_raises(canon, prompt):
    with pytest.raises(InvalidRequestError, match="empty"):
        canon.canonicalize(prompt)


def test_unknown_prompt_items_raise(canon):
    with pytest.raises(InvalidRequestError, match="item 1"):
        canon.canonicalize(["text", 42])
    with pytest.raises(InvalidRequestError):
        canon.canonicalize(12)


# -- round trip and stable boundaries --------------------------------------------------


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_decode_of_canonical_ids_is_canonical_text(canon, text):
    p = canon.canonicalize(text)
    assert canon.decode(p.token_ids) == p.text == normalize_text(text)


def test_decode_round_trip_over_many_segments(canon):
    p = canon.canonicalize([*ROUND_TRIP_TEXTS, "e\u0301\r\n"])
    assert canon.decode(p.token_ids) == p.text


def test_decode_round_trip_chat(canon):
    msgs = [{"role": "user", "content": t} for t in ROUND_TRIP_TEXTS]
    p = canon.canonicalize(msgs)
    assert canon.decode(p.token_ids) == p.text


def test_segment_ids_do_not_depend_on_neighbours(canon):
    tok = tiny_tokenizer()
    before, doc = "The quick bro", "wn fox jumps."
    # Precondition: tokenizing the joined text would merge across the boundary.
    joint = tok.encode(before + doc, add_special_tokens=False)
    assert joint != list(canon.tokenize(before)) + list(canon.tokenize(doc))

    contexts = [
        [before, Segment(doc, "document"), "Question?"],
        ["Something else entirely. ", Segment(doc, "document")],
        [Segment(doc, "document"), "wn", "after"],
        [Segment(doc, "document")],
    ]
    seen = set()
    for parts in contexts:
        p = canon.canonicalize(parts)
        (index,) = [i for i, s in enumerate(p.segments) if s.kind == "document"]
        start, end = p.segment_spans[index]
        seen.add(tuple(p.token_ids[start:end]))
    assert seen == {canon.tokenize(doc)}


def test_message_ids_do_not_depend_on_neighbours(canon):
    content = "Chunks never cross a segment boundary."
    a = canon.canonicalize([{"role": "system", "content": "Short."}, {"role": "user", "content": content}])
    longer = "A much longer system prompt, quite different."
    b = canon.canonicalize([{"role": "system", "content": longer}, {"role": "user", "content": content}])
    ids_a = [ids for s, ids in zip(a.segments, a.segment_token_ids, strict=True) if s.text == content]
    ids_b = [ids for s, ids in zip(b.segments, b.segment_token_ids, strict=True) if s.text == content]
    assert ids_a == ids_b == [canon.tokenize(content)]


# -- chat messages -----------------------------------------------------------


TEMPLATE_KINDS = {"glue", "closing"}
"""Kinds of template text: ``glue`` opens the content after it, ``closing`` ends the one before it."""


def merged_structure(p):
    """Segment texts with adjacent template segments merged: ``[(is_template, text), ...]``."""
    out = []
    for s in p.segments:
        is_template = s.kind in TEMPLATE_KINDS
        if out and is_template and out[-1][0]:
            out[-1] = (True, out[-1][1] + s.text)
        else:
            out.append((is_template, s.text))
    return out


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_messages_render_like_the_template(canon, add_generation_prompt):
    tok = tiny_tokenizer()
    p = canon.canonicalize(MESSAGES, add_generation_prompt=add_generation_prompt)
    expected = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert p.text == expected
    assert [s.text for s in p.segments if s.kind == "message"] == [m["content"] for m in MESSAGES]
    assert {s.kind for s in p.segments} - {"message"} <= TEMPLATE_KINDS
    assert "glue" in {s.kind for s in p.segments}
    assert p.segments[0] == Segment("<|im_start|>system\n", "glue")
    tail = "<|im_end|>\n<|im_start|>assistant\n" if add_generation_prompt else "<|im_end|>\n"
    assert merged_structure(p)[-1] == (True, tail)
    if add_generation_prompt:
        assert p.segments[-1] == Segment("<|im_start|>assistant\n", "glue")
    assert canon.decode(p.token_ids) == expected


def test_chat_template_text_and_messages_alternate(canon):
    p = canon.canonicalize(MESSAGES)
    structure = merged_structure(p)
    assert [t for t, _ in structure] == [True, False] * len(MESSAGES) + [True]
    assert [text for t, text in structure if t][1:-1] == [
        "<|im_end|>\n<|im_start|>user\n",
        "<|im_end|>\n<|im_start|>assistant\n",
        "<|im_end|>\n<|im_start|>user\n",
    ]
    # template text is tokenized on its own too
    for s, ids in zip(p.segments, p.segment_token_ids, strict=True):
        assert ids == canon.tokenize(s.text)


def test_message_contents_are_normalized(canon):
    p = canon.canonicalize([{"role": "user", "content": "cafe\u0301\r\nline"}])
    assert Segment("caf\u00e9\nline", "message") in p.segments
    assert "\r" not in p.text


def test_list_content_blocks_become_separate_segments(canon):
    tok = tiny_tokenizer()
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": ["Doc one. ", {"type": "text", "text": "Doc two. "}, "Question?"]},
    ]
    p = canon.canonicalize(msgs)
    message_texts = [s.text for s in p.segments if s.kind == "message"]
    assert message_texts == ["Be brief.", "Doc one. ", "Doc two. ", "Question?"]
    joined = [msgs[0], {"role": "user", "content": "Doc one. Doc two. Question?"}]
    assert p.text == tok.apply_chat_template(joined, tokenize=False, add_generation_prompt=True)
    # adjacent blocks of one message have no template text between them
    i = [s.text for s in p.segments].index("Doc one. ")
    assert p.segments[i + 1] == Segment("Doc two. ", "message")


def conversation(n: int) -> list[dict]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} text"} for i in range(n)]


def test_a_long_conversation_renders_each_message_a_bounded_number_of_times(monkeypatch):
    tok = tokenizer_with_template(CHATML)
    rendered = []
    real = tok.apply_chat_template

    def counting(messages, **kwargs):
        rendered.append(len(messages))
        return real(messages, **kwargs)

    monkeypatch.setattr(tok, "apply_chat_template", counting)
    n = 300
    Canonicalizer(tok).canonicalize(conversation(n))
    # one render of every prefix would be n * (n + 1) / 2 = 45,150 messages
    assert sum(rendered) <= (MESSAGE_END_WINDOW + 2) * n


def prefix_ends_reference(canon: Canonicalizer, messages: list[dict]) -> list[tuple[str, str]]:
    """Segments as found by rendering every prefix of the conversation (the definition of a message end)."""
    tok = canon.tokenizer
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ends = {len(tok.apply_chat_template(messages[:k], tokenize=False)) for k in range(1, len(messages) + 1)}
    out, position = [], 0
    for m in messages:
        start = rendered.index(m["content"], position)
        glue = rendered[position:start]
        cut = max([e - position for e in ends if position < e <= start] or [0])
        out += [(glue[:cut], "closing")] if cut else []
        out += [(glue[cut:], "glue"), (m["content"], "message")]
        position = start + len(m["content"])
    tail = rendered[position:]
    cut = max([e - position for e in ends if position < e <= len(rendered)] or [0])
    return out + [(tail[:cut], "closing"), (tail[cut:], "glue")]


def test_message_ends_of_a_long_conversation_are_those_of_its_prefix_renders(canon):
    messages = conversation(3 * MESSAGE_END_WINDOW)
    segments = [(s.text, s.kind) for s in canon.canonicalize(messages).segments]
    assert segments == [s for s in prefix_ends_reference(canon, messages) if s[0]]


def test_a_message_keeps_its_segments_in_every_later_turn_of_a_long_conversation(canon):
    messages = conversation(3 * MESSAGE_END_WINDOW + 1)
    turn = canon.canonicalize(messages[:-1], add_generation_prompt=False).segments
    assert canon.canonicalize(messages).segments[: len(turn)] == turn


ALTERNATING = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
    "<turn>{{ m['role'] }}\n{{ m['content'] }}</turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<turn>assistant\n{% endif %}"
)


def test_a_template_that_refuses_a_window_still_closes_every_message():
    canon = Canonicalizer(tokenizer_with_template(ALTERNATING))
    messages = conversation(2 * MESSAGE_END_WINDOW + 3)
    p = canon.canonicalize(messages)
    assert [s.text for s in p.segments if s.kind == "closing"] == ["</turn>\n"] * len(messages)
    assert p.text == canon.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_the_memos_hold_a_bounded_number_of_characters():
    canon = Canonicalizer(tiny_tokenizer(), memo_chars=10_000)
    for i in range(200):
        canon.canonicalize([{"role": "user", "content": f"{i} " + "fox " * 100}])
    tokens, renders = canon._tokens._memo, canon._chat._memo
    assert tokens.chars <= 10_000 and renders.chars <= 10_000
    assert len(tokens) > 1  # still memoising


def test_non_text_block_raises(canon):
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(InvalidRequestError, match="not text"):
        canon.canonicalize(msgs)


def test_content_of_wrong_type_raises(canon):
    with pytest.raises(InvalidRequestError, match="content"):
        canon.canonicalize([{"role": "user", "content": 3}])


def test_message_without_role_raises(canon):
    with pytest.raises(InvalidRequestError, match="role"):
        canon.canonicalize([{"role": "user", "content": "hi"}, {"content": "no role"}])


def test_messages_mixed_with_strings_raise(canon):
    with pytest.raises(InvalidRequestError):
        canon.canonicalize([{"role": "user", "content": "hi"}, "plain string"])


def test_tokenizer_without_chat_template_rejects_messages():
    canon = Canonicalizer(tokenizer_with_template(None))
    with pytest.raises(UnsupportedModelError, match="chat template"):
        canon.canonicalize(MESSAGES)
    # plain strings still work
    assert canon.canonicalize("hello").text == "hello"


@pytest.mark.parametrize("content_filter", ["upper", "trim"])
def test_template_that_transforms_contents_falls_back_to_one_segment(content_filter):
    template = CHATML.replace("{{ m['content'] }}", "{{ m['content'] | " + content_filter + " }}")
    tok = tokenizer_with_template(template)
    canon = Canonicalizer(tok)
    msgs = [{"role": "system", "content": "  be brief  "}, {"role": "user", "content": "  hello there\n"}]
    p = canon.canonicalize(msgs)
    expected = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert ("BE BRIEF" in expected) if content_filter == "upper" else ("\nbe brief<|im_end|>" in expected)
    assert p.segments == (Segment(expected, "text"),)
    assert canon.decode(p.token_ids) == expected


# -- BOS ---------------------------------------------------------------------


def test_no_bos_for_a_tokenizer_that_adds_none(canon):
    p = canon.canonicalize("hello")
    assert p.segments == (Segment("hello", "text"),)


def test_bos_is_prepended_once_as_glue():
    tok = tiny_tokenizer(add_bos=True)
    bos = tok.bos_token_id
    assert bos is not None
    canon = Canonicalizer(tok)
    p = canon.canonicalize(["hello", "world"])
    assert p.segments[0] == Segment(tok.bos_token, "glue")
    assert p.token_ids[0] == bos
    assert p.token_ids.count(bos) == 1
    assert p.segment_token_ids[1] == canon.tokenize("hello")
    assert canon.decode(p.token_ids) == p.text == "<s>helloworld"


def test_bos_is_never_doubled():
    tok = tiny_tokenizer(add_bos=True)
    bos = tok.bos_token_id
    canon = Canonicalizer(tok)
    # the prompt already starts with the BOS text
    p = canon.canonicalize("<s>hello")
    assert p.token_ids.count(bos) == 1 and p.token_ids[0] == bos
    # canonicalizing twice (memoised tokenization) does not add a second one
    assert canon.canonicalize("<s>hello").token_ids == p.token_ids


def test_bos_with_chat_messages_and_template_emitting_bos():
    tok = copy.deepcopy(tiny_tokenizer(add_bos=True))
    bos = tok.bos_token_id
    plain = Canonicalizer(tok).canonicalize(MESSAGES)
    assert plain.token_ids[0] == bos and plain.token_ids.count(bos) == 1

    tok.chat_template = "{{ bos_token }}" + CHATML
    p = Canonicalizer(tok).canonicalize(MESSAGES)
    assert p.text == tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert p.token_ids[0] == bos
    assert p.token_ids.count(bos) == 1


# -- paragraph cuts ------------------------------------------------------------


def test_text_is_cut_before_paragraph_breaks(canon):
    p = canon.canonicalize("Context:\n\nFirst passage.\n\n\nSecond passage.\nSame paragraph.")
    assert [s.text for s in p.segments] == [
        "Context:",
        "\n\nFirst passage.",
        "\n\n\nSecond passage.\nSame paragraph.",
    ]
    assert canon.decode(p.token_ids) == p.text


def test_a_paragraph_has_the_same_tokens_wherever_it_follows_a_break(canon):
    passage = "\n\nThe quick brown fox jumps over the lazy dog."
    a = canon.canonicalize("Context:" + passage + "\n\nQuestion?")
    b = canon.canonicalize("Other words first." + passage)
    ids = canon.tokenize(passage)
    assert any(ids == x for x in a.segment_token_ids) and any(ids == x for x in b.segment_token_ids)


def test_glue_is_never_cut(canon):
    p = canon.canonicalize([Segment("a\n\nb", "glue")])
    assert [s.text for s in p.segments] == ["a\n\nb"]
