"""A LangChain agent (``create_agent``) on ChatKVBoost with Qwen2.5-Coder-0.5B: a tool loop in which
every step reads the system prompt, the tools and the earlier turns from the KV store.

    python examples/langchain_agent.py ["What is 12 plus 30?"]
"""

from __future__ import annotations

import sys

from langchain.agents import create_agent
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool

from langchain_kvboost import ChatKVBoost


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


def main(argv: list[str]) -> int:
    question = argv[0] if argv else "What is 12 plus 30? Use the add tool."
    llm = ChatKVBoost(model="qwen2.5-coder-0.5b-instruct", max_tokens=96)
    agent = create_agent(llm, tools=[add, multiply], system_prompt="Use the tools for arithmetic. Be brief.")
    state = agent.invoke({"messages": [HumanMessage(question)]}, config={"recursion_limit": 8})
    step = 0
    for message in state["messages"]:
        if isinstance(message, AIMessage):
            step += 1
            usage, details = message.usage_metadata, message.response_metadata["kvboost"]
            calls = ", ".join(f"{c['name']}({c['args']})" for c in message.tool_calls) or repr(
                message.content[:80]
            )
            print(f"step {step}: {calls}")
            print(
                f"   TTFT {details['ttft_s'] * 1000:.0f} ms, "
                f"cache_read {usage['input_token_details']['cache_read']} "
                f"of {usage['input_tokens']} prompt tokens"
            )
        elif isinstance(message, ToolMessage):
            print(f"   tool {message.name} -> {message.content}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
