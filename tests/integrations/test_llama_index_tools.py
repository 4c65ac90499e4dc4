"""KVBoost as a LlamaIndex FunctionCallingLLM on Qwen2.5-Coder-0.5B (a tool-calling chat template):
tool calls, forced tool_choice, streamed calls, structured output. FunctionAgent and ReActAgent over a
query-engine tool run in examples/llamaindex_agent.py (tests/test_examples.py)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

pytest.importorskip("llama_index.core")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from llama_index.core import PromptTemplate  # noqa: E402
from llama_index.core.base.llms.types import ChatMessage, TextBlock, ToolCallBlock  # noqa: E402
from llama_index.core.tools import FunctionTool  # noqa: E402
from llama_index.llms.kvboost import KVBoost  # noqa: E402
from llama_index.llms.kvboost.messages import to_chat_messages  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

pytestmark = pytest.mark.real_model
QWEN = {"model": "qwen2.5-coder-0.5b-instruct", "dtype": "float32", "max_new_tokens": 64}


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


TOOLS = [FunctionTool.from_defaults(multiply), FunctionTool.from_defaults(add)]


def test_a_tool_call_message_renders_as_the_template_expects():
    call = ToolCallBlock(tool_call_id="call_1", tool_name="add", tool_kwargs={"a": 1, "b": 2})
    messages = [
        ChatMessage(role="user", content="Add 1 and 2."),
        ChatMessage(role="assistant", blocks=[TextBlock(text="Adding."), call]),
        ChatMessage(role="tool", content="3", additional_kwargs={"tool_call_id": "call_1"}),
    ]
    rendered = to_chat_messages(messages)
    assert rendered[1]["tool_calls"] == [
        {"type": "function", "id": "call_1", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    ]
    assert rendered[1]["content"] == [{"type": "text", "text": "Adding."}]
    assert rendered[2] == {
        "role": "tool",
        "content": [{"type": "text", "text": "3"}],
        "tool_call_id": "call_1",
    }


def test_forced_tool_choice_gives_the_right_call_and_predict_and_call_runs_it():
    llm = KVBoost(**QWEN)
    assert llm.metadata.is_function_calling_model
    response = llm.chat_with_tools(TOOLS, user_msg="What is 6 times 7?", tool_choice="multiply")
    calls = llm.get_tool_calls_from_response(response)
    assert [(c.tool_name, c.tool_kwargs) for c in calls] == [("multiply", {"a": 6, "b": 7})]
    assert response.raw["finish_reason"] == "tool_calls"
    assert llm.predict_and_call(TOOLS, user_msg="What is 6 times 7?", tool_choice="multiply").response == "42"
    with pytest.raises(ValueError, match="not among the bound tools"):
        llm.chat_with_tools(TOOLS, user_msg="Hi", tool_choice="subtract")
    plain = llm.chat_with_tools(TOOLS, user_msg="Say hello.", tool_choice="none", max_new_tokens=8)
    assert llm.get_tool_calls_from_response(plain, error_on_no_tool_call=False) == []
    with pytest.raises(ValueError, match="no tool call"):
        llm.get_tool_calls_from_response(plain)


def test_streamed_tool_calls_match_the_whole_response_and_never_show_the_call_text():
    llm = KVBoost(**QWEN)
    whole = llm.chat_with_tools(TOOLS, user_msg="What is 12 plus 30?", tool_required=True)

    async def stream():
        gen = await llm.astream_chat_with_tools(TOOLS, user_msg="What is 12 plus 30?", tool_required=True)
        return [r async for r in gen]

    responses = asyncio.run(stream())
    assert all("<tool_call>" not in (r.delta or "") for r in responses)
    assert all(not llm.get_tool_calls_from_response(r, error_on_no_tool_call=False) for r in responses[:-1])
    streamed = llm.get_tool_calls_from_response(responses[-1])
    expected = llm.get_tool_calls_from_response(whole)
    assert [(c.tool_name, c.tool_kwargs) for c in streamed] == [
        (c.tool_name, c.tool_kwargs) for c in expected
    ]
    assert expected[0].tool_name == "add" and expected[0].tool_kwargs == {"a": 12, "b": 30}
    sync = list(llm.stream_chat_with_tools(TOOLS, user_msg="What is 12 plus 30?", tool_required=True))
    assert [c.tool_kwargs for c in llm.get_tool_calls_from_response(sync[-1])] == [{"a": 12, "b": 30}]


def test_structured_predict_fills_a_pydantic_model():
    class Person(BaseModel):
        """A person mentioned in the text."""

        name: str = Field(description="the person's first name")
        age: int = Field(description="age in years")

    llm = KVBoost(**QWEN)
    person = llm.structured_predict(Person, PromptTemplate("Extract the person: {text}"), text="Anna is 31.")
    assert isinstance(person, Person) and person.name == "Anna" and person.age == 31
