"""Streaming deltas: stop strings, UTF-8 safety, deltas that add up to the text."""

from __future__ import annotations

import pytest
from helpers import tiny_tokenizer

from kvboost_rag.textstream import TextStream

SENTENCE = "The quick brown fox jumps over the lazy dog. A key-value cache stores keys."
EMOJI_TEXT = "Ünïcödé emoji 🙂 and 🤖💡🦊 done. 日本語"


class CharTok:
    """One token per character: ``decode`` is ``chr``."""

    def decode(self, ids, **kw):
        return "".join(chr(i) for i in ids)


def encode(text):
    return tiny_tokenizer().encode(text, add_special_tokens=False)


def run(stream, ids):
    """Push every id (until stopped); return the deltas, finish() last."""
    deltas = []
    for i in ids:
        deltas.append(stream.push(i))
        if stream.stopped:
            break
    deltas.append(stream.finish())
    return deltas


def test_no_stop_strings_text_equals_decode():
    tok = tiny_tokenizer()
    ids = encode(SENTENCE)
    ts = TextStream(tok)
    deltas = run(ts, ids)
    assert ts.text == tok.decode(ids) == SENTENCE
    assert "".join(deltas) == SENTENCE
    assert not ts.stopped
    assert ts.ids == ids


def test_each_push_emits_new_text_without_stops():
    ts = TextStream(CharTok())
    assert [ts.push(ord(c)) for c in "abc"] == ["a", "b", "c"]
    assert ts.finish() == ""


def test_stop_string_split_across_tokens_is_trimmed_and_never_partly_emitted():
    tok = tiny_tokenizer()
    ids = encode(SENTENCE)
    stop = "lazy dog"
    # Precondition: the stop string spans several tokens.
    pieces = [tok.decode([i]) for i in ids]
    assert not any(stop in p for p in pieces)
    expected = SENTENCE[: SENTENCE.index(stop)]

    ts = TextStream(tok, stop=(stop,))
    emitted = ""
    for i in ids:
        emitted += ts.push(i)
        # whatever has been shown is a prefix of the final text: no piece of the stop string leaks
        assert expected.startswith(emitted)
        if ts.stopped:
            break
    assert ts.stopped
    assert ts.text == expected
    emitted += ts.finish()
    assert emitted == expected


def test_earliest_of_several_stop_strings_wins():
    ts = TextStream(CharTok(), stop=("fox", "brown", "zzz"))
    deltas = run(ts, [ord(c) for c in "the brown fox"])
    assert ts.stopped
    assert ts.text == "the "
    assert "".join(deltas) == "the "


def test_held_stop_prefix_is_released_when_it_does_not_complete():
    ts = TextStream(CharTok(), stop=("END",))
    out = [ts.push(ord(c)) for c in "aEN"]
    assert out == ["a", "", ""]
    assert ts.push(ord("d")) == "ENd"
    assert not ts.stopped
    assert ts.finish() == ""
    assert ts.text == "aENd"


def test_held_stop_prefix_is_flushed_by_finish():
    ts = TextStream(CharTok(), stop=("END",))
    deltas = run(ts, [ord(c) for c in "xyEN"])
    assert not ts.stopped
    assert deltas[-1] == "EN"
    assert "".join(deltas) == ts.text == "xyEN"


def test_stop_at_the_very_start():
    ts = TextStream(CharTok(), stop=("ab",))
    deltas = run(ts, [ord(c) for c in "abcd"])
    assert ts.stopped and ts.text == ""
    assert "".join(deltas) == ""


def test_overlapping_stop_prefixes():
    # "aab": the first "a" could start the stop string, but only the second one does
    ts = TextStream(CharTok(), stop=("ab",))
    emitted = ""
    for c in "xaab":
        emitted += ts.push(ord(c))
        assert "xa".startswith(emitted)
    assert ts.stopped and ts.text == "xa"
    assert emitted + ts.finish() == "xa"


@pytest.mark.parametrize("stop", [(), ("lazy dog",), ("🤖",), ("do", "🦊 d"), ("never there",)])
@pytest.mark.parametrize("text", [SENTENCE, EMOJI_TEXT, SENTENCE + " " + EMOJI_TEXT])
def test_deltas_and_finish_add_up_to_text(text, stop):
    tok = tiny_tokenizer()
    ts = TextStream(tok, stop=stop)
    deltas = run(ts, encode(text))
    assert "".join(deltas) == ts.text
    hits = [text.find(s) for s in stop if s in text]
    assert ts.text == (text[: min(hits)] if hits else text)
    assert ts.stopped == bool(hits)


def test_split_emoji_never_emits_replacement_character():
    tok = tiny_tokenizer()
    ids = encode(EMOJI_TEXT)
    # Precondition: some emoji are split over byte-level tokens (a prefix decodes to U+FFFD).
    assert any("\ufffd" in tok.decode(ids[:n]) for n in range(1, len(ids)))

    ts = TextStream(tok)
    deltas = [ts.push(i) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # some pushes had to hold back a partial character
    assert "".join(deltas) + ts.finish() == EMOJI_TEXT


def test_split_emoji_with_stop_strings_never_emits_replacement_character():
    tok = tiny_tokenizer()
    ts = TextStream(tok, stop=("done",))
    deltas = run(ts, encode(EMOJI_TEXT))
    assert all("\ufffd" not in d for d in deltas)
    assert ts.text == EMOJI_TEXT[: EMOJI_TEXT.index("done")]
    assert "".join(deltas) == ts.text


def test_multibyte_stop_string_split_across_byte_tokens():
    tok = tiny_tokenizer()
    ids = encode(EMOJI_TEXT)
    stop = "💡"
    ts = TextStream(tok, stop=(stop,))
    emitted = ""
    expected = EMOJI_TEXT[: EMOJI_TEXT.index(stop)]
    for i in ids:
        emitted += ts.push(i)
        assert expected.startswith(emitted)
        if ts.stopped:
            break
    assert ts.stopped and ts.text == expected
