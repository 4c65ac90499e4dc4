"""OpenAI bodies to engine requests: defaults, refusals, and the settings :class:`Request` checks."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from kvboost_rag.errors import InvalidRequestError
from kvboost_rag.request import Request
from kvboost_rag.server.protocol import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    chat_messages,
    completion_prompt,
    to_request,
)

USER = [{"role": "user", "content": "Hi"}]


def test_to_request_applies_openai_defaults():
    request = to_request(CompletionRequest(prompt="Hi"), "Hi", default_max_tokens=256)
    assert isinstance(request, Request)
    assert request == Request(
        "Hi", max_new_tokens=256, temperature=1.0, top_p=1.0, top_k=0, seed=None, stop=()
    )


def test_to_request_carries_every_setting():
    body = CompletionRequest(prompt="Hi", max_tokens=5, temperature=0, top_p=0.5, top_k=3, seed=7, stop="END")
    request = to_request(body, "Hi", default_max_tokens=256)
    assert (request.max_new_tokens, request.temperature, request.top_p, request.top_k) == (5, 0.0, 0.5, 3)
    assert (request.seed, request.stop) == (7, ("END",))


@pytest.mark.parametrize(
    ("limits", "expected"),
    [({}, 256), ({"max_tokens": 9}, 9), ({"max_completion_tokens": 4, "max_tokens": 9}, 4)],
)
def test_chat_prefers_max_completion_tokens(limits, expected):
    body = ChatCompletionRequest(messages=USER, **limits)
    assert to_request(body, chat_messages(body), default_max_tokens=256).max_new_tokens == expected


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 2}, "n"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": 1}, "frequency_penalty"),
        ({"logit_bias": {"1": 2.0}}, "logit_bias"),
        ({"stop": ["x", ""]}, "stop"),
    ],
)
def test_unsupported_settings_are_refused_by_name(fields, param):
    with pytest.raises(BadRequest) as e:
        to_request(CompletionRequest(prompt="Hi", **fields), "Hi", default_max_tokens=8)
    assert e.value.param == param


def test_settings_the_request_refuses_raise_its_error():
    body = CompletionRequest(prompt="Hi", seed=2**70)  # pydantic takes any int; Request knows torch's range
    with pytest.raises(InvalidRequestError, match="seed must be an integer"):
        to_request(body, "Hi", default_max_tokens=8)


def test_chat_messages_map_roles_and_keep_text_parts_apart():
    body = ChatCompletionRequest(
        messages=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None},
        ]
    )
    assert chat_messages(body) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": ""},
    ]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "tool", "content": "{}"}]}, "messages[0].role"),
        ({"messages": USER, "tools": [{"type": "function"}]}, "tools"),
        ({"messages": USER, "tool_choice": "required"}, "tool_choice"),
        ({"messages": USER, "logprobs": True}, "logprobs"),
        ({"messages": USER, "response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_chat_refusals_name_the_field(fields, param):
    with pytest.raises(BadRequest) as e:
        chat_messages(ChatCompletionRequest(**fields))
    assert e.value.param == param


def test_completion_prompt_takes_one_string():
    assert completion_prompt(CompletionRequest(prompt=["once"])) == "once"
    for prompt in (["a", "b"], [1, 2], ""):
        with pytest.raises(BadRequest) as e:
            completion_prompt(CompletionRequest(prompt=prompt))
        assert e.value.param == "prompt"
