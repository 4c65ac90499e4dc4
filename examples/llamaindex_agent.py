"""LlamaIndex agents on KVBoost with Qwen2.5-Coder-0.5B: a FunctionAgent (or, with ``--react``, a
ReActAgent) answers by calling a query-engine tool over real essays, and every step reads the
system prompt, the tools and the earlier turns from the KV store.

    python examples/llamaindex_agent.py [--react] ["What should founders focus on?"]

A model this small follows the function-calling format well and the ReAct text format less so:
under ReAct it may copy the tool's JSON schema into its Action Input. Larger models do both.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from llama_index.core import Document, VectorStoreIndex
from llama_index.core.agent.workflow import FunctionAgent, ReActAgent, ToolCallResult
from llama_index.core.callbacks import CallbackManager
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.tools import QueryEngineTool
from llama_index.llms.kvboost import KVBoost, KVBoostUsageHandler
from llamaindex_embeddings import MiniLMEmbedding
from offline_embeddings import essay_paragraphs

MODEL = "qwen2.5-coder-0.5b-instruct"
MAX_STEPS = 3


def essays_tool() -> QueryEngineTool:
    """A query engine over essay paragraphs (offline embeddings), as an agent tool."""
    docs = [Document(text=p) for p in essay_paragraphs(6)]
    splitter = SentenceSplitter(chunk_size=200, chunk_overlap=0)
    index = VectorStoreIndex.from_documents(docs, embed_model=MiniLMEmbedding(), transformations=[splitter])
    reader = KVBoost(model=MODEL, max_new_tokens=32)  # the LLM inside the tool, counted apart
    return QueryEngineTool.from_defaults(
        index.as_query_engine(llm=reader, similarity_top_k=1),
        name="essays",
        description="Answers questions about essays on startups and founders.",
    )


async def run(question: str, react: bool) -> int:
    usage = KVBoostUsageHandler()
    llm = KVBoost(model=MODEL, max_new_tokens=64, callback_manager=CallbackManager([usage]))
    tools = [essays_tool()]
    if react:
        agent: FunctionAgent | ReActAgent = ReActAgent(tools=tools, llm=llm)
    else:
        agent = FunctionAgent(
            tools=tools,
            llm=llm,
            system_prompt=(
                "Call the essays tool once. When its answer comes back, do not call any tool again: "
                "reply to the user in one sentence based on it."
            ),
            initial_tool_choice="essays",  # the first step must call the tool
        )
    # A 0.5B model tends to call the tool on every turn: after MAX_STEPS steps, one last call
    # (the agent's early-stopping prompt, without the tools) writes the answer.
    handler = agent.run(question, max_iterations=MAX_STEPS, early_stopping_method="generate")
    async for event in handler.stream_events():
        if isinstance(event, ToolCallResult):
            print(f"tool {event.tool_name}({event.tool_kwargs}) -> {str(event.tool_output)[:80]!r}")
    answer = await handler
    calls = usage.calls
    early_stop = len(calls) > MAX_STEPS  # one model call per agent step, then the early-stopping one
    for step, call in enumerate(calls, 1):
        label = "final (early stop, no tools)" if early_stop and step == len(calls) else f"step {step}"
        print(
            f"{label}: TTFT {call.ttft_s * 1000:.0f} ms, "
            f"cached_tokens {call.cached_tokens} of {call.prompt_tokens} prompt tokens"
        )
    print(f"answer: {str(answer).strip()}")
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("question", nargs="?", default="What should founders of a startup focus on?")
    parser.add_argument("--react", action="store_true", help="a ReActAgent instead of a FunctionAgent")
    args = parser.parse_args(argv)
    return asyncio.run(run(args.question, args.react))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
