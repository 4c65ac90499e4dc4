"""Hermes tool calls: one parser for whole replies and stream deltas, forced starts, the fallback prompt."""

from __future__ import annotations

import pytest

from kvboost_rag.tool_calls import (
    FALLBACK_PROMPT,
    ReplyParser,
    forced_prefix,
    parse,
    with_fallback_prompt,
)

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    },
}
NOW = {"type": "function", "function": {"name": "now", "description": "The time.", "parameters": {}}}

REPLIES = [
    "Plain prose, no tools.",
    'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
    '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    '<tool_call>{"name": "now", "arguments": {}}',
    '{"name": "add", "arguments": {"a": 4, "b": 5}}',  # a bare call object (small models drop the tags)
    '```json\n{"name": "add", "arguments": {"a": 4, "b": 5}}\n```',
    '{"not": "a call"}',
    'Broken: <tool_call>{"name": "add", "arguments": {"a": ',
    "I use < and <tool in prose <tool_ca",
]


def test_parse_splits_content_from_calls():
    reply = parse(REPLIES[1], {"add"})
    assert reply.content == "Let me add." and not reply.invalid
    assert [(c.name, c.arguments) for c in reply.calls] == [("add", {"a": 1, "b": 2})]
    assert reply.calls[0].id.startswith("call_")
    reply = parse(REPLIES[2], {"add", "now"})
    assert [c.name for c in reply.calls] == ["add", "now"]  # an unclosed last call is accepted
    assert parse(REPLIES[3], {"add"}).calls[0].arguments == {"a": 4, "b": 5}
    assert parse(REPLIES[3], {"subtract"}).calls == []  # a bare object naming no offered tool is prose
    broken = parse(REPLIES[6], {"add"})
    assert broken.content == "Broken:" and not broken.calls and broken.invalid[0].raw.startswith('{"name"')
    assert parse("no tools here").content == "no tools here"


@pytest.mark.parametrize("text", REPLIES)
@pytest.mark.parametrize("piece_chars", [1, 3, 1000])
def test_streamed_deltas_give_the_whole_reply_and_never_show_a_call(text, piece_chars):
    names = {"add", "now"}
    parser = ReplyParser([ADD, NOW])
    shown = ""
    for at in range(0, len(text), piece_chars):
        shown += parser.push(text[at : at + piece_chars])
        assert "<tool_call>".startswith(shown[-1:]) or "<tool_call" not in shown
    rest, reply = parser.finish()
    whole = parse(text, names)
    assert shown + rest == whole.content == reply.content
    assert [(c.name, c.arguments) for c in reply.calls] == [(c.name, c.arguments) for c in whole.calls]


def test_without_tools_every_delta_is_content():
    parser = ReplyParser()
    assert parser.push("<tool_call>{") == "<tool_call>{"
    assert parser.finish()[1].calls == []


def test_forced_prefix_starts_the_call_for_the_model():
    assert forced_prefix(None, [ADD]) == forced_prefix("auto", [ADD]) == forced_prefix("none", [ADD]) == ""
    assert forced_prefix("add", [ADD, NOW]).endswith('{"name": "add", "arguments": {"')
    assert forced_prefix({"function": {"name": "now"}}, [ADD, NOW]).endswith('"arguments": {')  # no args
    assert forced_prefix("any", [ADD]) == forced_prefix("add", [ADD])  # one tool: that one
    assert forced_prefix("required", [ADD, NOW]).endswith('{"name": "')
    with pytest.raises(ValueError, match="not among the bound tools"):
        forced_prefix("subtract", [ADD])
    # the parser reads the forced start together with the reply
    parser = ReplyParser([ADD], forced_prefix("add", [ADD]))
    parser.push('a": 2, "b": 3}}\n</tool_call>')
    assert parser.finish()[1].calls[0].arguments == {"a": 2, "b": 3}


def test_the_fallback_prompt_joins_the_system_message():
    user = {"role": "user", "content": [{"type": "text", "text": "Add 2 and 3."}]}
    system = {"role": "system", "content": [{"type": "text", "text": "Be brief."}]}
    alone = with_fallback_prompt([user], [ADD])
    assert alone[0]["role"] == "system" and '"name": "add"' in alone[0]["content"][0]["text"]
    joined = with_fallback_prompt([system, user], [ADD])
    assert len(joined) == 2 and joined[0]["content"][0]["text"] == "Be brief."
    assert joined[0]["content"][1]["text"].strip().startswith(FALLBACK_PROMPT.split("\n")[0])


def test_unescaped_quotes_inside_a_string_are_repaired_and_valid_json_is_untouched():
    """Small models write ``"description": "of "Hello Corp". "``: the call is meant, and kept."""
    meant = '{"name": "add", "arguments": {"note": "of "Hello Corp". ", "a": "x, "y""}}'
    reply = parse(f"<tool_call>{meant}</tool_call>", {"add"})
    assert reply.calls[0].arguments == {"note": 'of "Hello Corp". ', "a": 'x, "y"'}
    exact = '{"name": "add", "arguments": {"note": "a \\"quoted\\" word", "path": "C:\\\\dir"}}'
    assert parse(f"<tool_call>{exact}</tool_call>").calls[0].arguments == {
        "note": 'a "quoted" word',
        "path": "C:\\dir",
    }
    broken = parse('<tool_call>{"name": "add", "arguments": {"x": "never closed', {"add"})
    assert not broken.calls and "Unterminated string" in broken.invalid[0].error


def test_arguments_take_the_types_their_schema_declares():
    flags = {
        "type": "function",
        "function": {
            "name": "flags",
            "parameters": {
                "properties": {
                    "n": {"type": "integer"},
                    "x": {"type": "number"},
                    "on": {"type": "boolean"},
                    "s": {"type": "string"},
                }
            },
        },
    }
    parser = ReplyParser([ADD, flags])
    parser.push(
        '<tool_call>{"name": "add", "arguments": {"a": "6", "b": " -7 "}}</tool_call>'
        '<tool_call>{"name": "flags", "arguments": {"n": "1.5", "x": "2e3", "on": "True", "s": "8"}}'
    )
    first, second = parser.finish()[1].calls
    assert first.arguments == {"a": 6, "b": -7}
    assert second.arguments == {"n": "1.5", "x": 2000.0, "on": True, "s": "8"}  # "1.5" is no integer
