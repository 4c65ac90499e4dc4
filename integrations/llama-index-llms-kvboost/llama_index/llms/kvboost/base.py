"""KVBoost: a LlamaIndex LLM backed by a local kvboost-rag engine."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
    TextBlock,
    ToolCallBlock,
)
from llama_index.core.constants import DEFAULT_CONTEXT_WINDOW
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection
from llama_index.llms.kvboost.messages import to_chat_messages
from pydantic import Field, PlainSerializer

from kvboost_rag.tool_calls import Reply, ReplyParser, offer_tools

if TYPE_CHECKING:
    from llama_index.core.tools.types import BaseTool

    from kvboost_rag import GenerationResult, KVBoostEngine, Request, StreamChunk

logger = logging.getLogger(__name__)


def _redacted(url: str | None) -> str | None:
    """The URL as dumps show it: without its password (imported on use, so the adapter loads light)."""
    from kvboost_rag.config import redacted_url

    return redacted_url(url)


class KVBoost(FunctionCallingLLM):
    """LlamaIndex LLM over a local HF causal LM that reuses the KV of repeated context.

    Query engines resend the same system prompt and retrieved nodes; KVBoost reads
    their KV from the store instead of recomputing it. Nodes pre-warmed at indexing
    time with :class:`~llama_index.llms.kvboost.KVPrewarm` are found inside the
    prompts the response synthesizers build. In ``reuse="exact"`` mode answers are
    bitwise identical to the uncached path.

    Every response carries OpenAI-style usage in ``raw["usage"]`` (so
    ``TokenCountingHandler`` counts the model's own tokens) and the reuse details
    in ``raw["kvboost"]``; :class:`~llama_index.llms.kvboost.KVBoostUsageHandler`
    collects them per query.

    Construction is cheap: the engine loads on first use and is shared by every
    KVBoost (and LangChain ``ChatKVBoost``) with the same model, dtype, device,
    store and chunk size.

    Example:
        .. code-block:: python

            from llama_index.core.llms import ChatMessage
            from llama_index.llms.kvboost import KVBoost

            llm = KVBoost(model="smollm2-135m-instruct", store_dir="./kv", max_new_tokens=64)
            response = llm.chat([ChatMessage(role="user", content="What is a KV cache?")])
            response.raw["usage"]["prompt_tokens_details"]["cached_tokens"]
    """

    model: str = Field(
        default="smollm2-135m-instruct",
        description="Alias (smollm2-135m-instruct, qwen2.5-coder-0.5b-instruct), HF model id or local path.",
    )
    store_dir: str | None = Field(
        default=None,
        description="KV store directory shared across processes and restarts; None: memory only.",
    )
    redis_url: Annotated[str | None, PlainSerializer(_redacted)] = Field(
        default=None,
        repr=False,
        description="Shared Redis tier (redis://host:port/0) read by every worker; None: off.",
    )
    dtype: str = Field(
        default="auto",
        description="Weights and KV dtype: auto (bfloat16 where native, else float32), bfloat16, float32.",
    )
    device: str | None = Field(
        default=None, description="Torch device (cpu, cuda); None: the loader's default."
    )
    temperature: float = Field(default=0.0, ge=0.0, description="Sampling temperature; 0 is greedy.")
    max_new_tokens: int = Field(default=256, gt=0, description="Most tokens to generate per call.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(default=0, ge=0, description="Sample among the k most likely tokens; 0 disables.")
    seed: int | None = Field(
        default=None, description="Seed for sampling; the same seed gives the same tokens."
    )
    stop: list[str] | None = Field(default=None, description="Stop strings, trimmed from the output.")
    reuse: Literal["exact", "blend", "off"] = Field(
        default="exact",
        description=(
            "exact: reuse stored KV with zero loss; blend: also reuse pre-warmed nodes at any position "
            "(approximate, counted in raw['kvboost']['approx_tokens']); off: never read or write the store."
        ),
    )
    blend_recompute_ratio: float | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description="Blend mode: share of reused node tokens recomputed (None: the engine's setting).",
    )
    cache_salt: str | None = Field(
        default=None,
        min_length=1,
        description="Tenant of the KV cache: LLMs with different salts never share stored KV (None: shared).",
    )
    chunk_size: int | None = Field(
        default=None,
        gt=0,
        description="Tokens per stored chunk, the granularity of exact reuse (None: the engine's).",
    )
    context_window: int | None = Field(
        default=None, gt=0, description="Context window reported to LlamaIndex; None: the model's own."
    )

    @classmethod
    def class_name(cls) -> str:
        return "KVBoost"

    @property
    def engine(self) -> KVBoostEngine:
        """The shared engine (loaded on first use)."""
        from kvboost_rag.shared import EngineSpec, shared_engine

        return shared_engine(
            EngineSpec(self.model, self.dtype, self.device, self.store_dir, self.chunk_size, self.redis_url)
        )

    @property
    def metadata(self) -> LLMMetadata:
        window = self.context_window or self.engine.assembler.context_window or DEFAULT_CONTEXT_WINDOW
        return LLMMetadata(
            context_window=window,
            num_output=self.max_new_tokens,
            is_chat_model=True,
            # Hermes tool calls: rendered by templates that take tools (Qwen2.5), else by a fallback prompt
            is_function_calling_model=True,
            model_name=self.model,
        )

    # -- sync --------------------------------------------------------------------------------

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        request, parser = self._chat_request(messages, kwargs)
        result = self.engine.generate(request)
        return _chat_response(result, parser.whole(result.text))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        request, parser = self._chat_request(messages, kwargs)  # bad input fails at the call
        stream = self.engine.stream(request)

        def responses() -> ChatResponseGen:
            content = ""
            try:
                for piece in stream:
                    response, content = _chat_delta(piece, parser, content)
                    yield response
            finally:
                stream.close()  # a consumer that stops early ends the request here

        return responses()

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """Complete ``prompt`` as a user turn of the chat template (``formatted=True``: sent as is)."""
        result = self.engine.generate(self._request(self._completion_prompt(prompt, formatted), kwargs))
        return CompletionResponse(text=result.text, raw=_raw(result))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        request = self._request(self._completion_prompt(prompt, formatted), kwargs)
        stream = self.engine.stream(request)

        def responses() -> CompletionResponseGen:
            text = ""
            try:
                for piece in stream:
                    text += piece.text
                    yield _completion(text, piece)
            finally:
                stream.close()

        return responses()

    # -- async: the engine's scheduler serves these (concurrent calls share batches, and a
    #    cancelled task stops its request); streams are native: the engine hands each delta to
    #    the event loop as it comes out, and a consumer that stops ends the request ----------

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        engine = await self._aengine()
        request, parser = self._chat_request(messages, kwargs)
        result = await engine.agenerate(request)
        return _chat_response(result, parser.whole(result.text))

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        engine = await self._aengine()
        request, parser = self._chat_request(messages, kwargs)
        stream = engine.astream(request)
        await stream.start()  # bad input fails at the call

        async def responses() -> ChatResponseAsyncGen:
            content = ""
            try:
                async for piece in stream:
                    response, content = _chat_delta(piece, parser, content)
                    yield response
            finally:
                await stream.aclose()

        return responses()

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        engine = await self._aengine()
        result = await engine.agenerate(self._request(self._completion_prompt(prompt, formatted), kwargs))
        return CompletionResponse(text=result.text, raw=_raw(result))

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        engine = await self._aengine()
        stream = engine.astream(self._request(self._completion_prompt(prompt, formatted), kwargs))
        await stream.start()

        async def responses() -> CompletionResponseAsyncGen:
            text = ""
            try:
                async for piece in stream:
                    text += piece.text
                    yield _completion(text, piece)
            finally:
                await stream.aclose()

        return responses()

    # -- tools (FunctionCallingLLM) ----------------------------------------------------------

    def _prepare_chat_with_tools(
        self,
        tools: Sequence[BaseTool],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        tool_choice: str | dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """The ``chat`` arguments that offer ``tools``: ``tool_choice`` is ``"auto"``, ``"none"``,
        ``"required"`` or a tool name; ``tool_required`` means ``"required"`` when none is given."""
        messages = list(chat_history or [])
        if user_msg is not None:
            messages.append(
                ChatMessage(role=MessageRole.USER, content=user_msg)
                if isinstance(user_msg, str)
                else user_msg
            )
        specs = [tool.metadata.to_openai_tool(skip_length_check=True) for tool in tools]
        if tool_choice is None and tool_required:
            tool_choice = "required"
        return {"messages": messages, "tools": specs, "tool_choice": tool_choice, **kwargs}

    def _validate_chat_with_tools_response(
        self,
        response: ChatResponse,
        tools: Sequence[BaseTool],
        allow_parallel_tool_calls: bool = False,
        **kwargs: Any,
    ) -> ChatResponse:
        if not allow_parallel_tool_calls:  # keep the first call only
            calls = [b for b in response.message.blocks if isinstance(b, ToolCallBlock)]
            response.message.blocks = [
                b for b in response.message.blocks if not isinstance(b, ToolCallBlock) or b is calls[0]
            ]
        return response

    def get_tool_calls_from_response(
        self, response: ChatResponse, error_on_no_tool_call: bool = True, **kwargs: Any
    ) -> list[ToolSelection]:
        """The tool calls of a ``chat_with_tools`` response (its ``ToolCallBlock`` blocks)."""
        calls = [
            ToolSelection(
                tool_id=block.tool_call_id or "",
                tool_name=block.tool_name,
                tool_kwargs=block.tool_kwargs if isinstance(block.tool_kwargs, dict) else {},
            )
            for block in response.message.blocks
            if isinstance(block, ToolCallBlock)
        ]
        if not calls and error_on_no_tool_call:
            invalid = response.message.additional_kwargs.get("invalid_tool_calls")
            why = f" (calls that did not parse: {invalid})" if invalid else ""
            raise ValueError(f"the response has no tool call{why}; pass tool_required=True to force one")
        return calls

    # -- internals ---------------------------------------------------------------------------

    async def _aengine(self) -> KVBoostEngine:
        return await asyncio.to_thread(lambda: self.engine)  # the first use loads the model

    def _request(self, prompt: Any, kwargs: dict[str, Any]) -> Request:
        from kvboost_rag.shared import request_for

        options = dict(kwargs)
        request = request_for(prompt, self, options)
        for name in options:  # frameworks pass provider options freely; say which ones have no effect here
            logger.debug("KVBoost ignores the option %r", name)
        return request

    def _chat_request(
        self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]
    ) -> tuple[Request, ReplyParser]:
        """The engine request of a chat call, and the parser of its reply (which knows any tools)."""
        options = dict(kwargs)
        prompt, parser = offer_tools(self.engine.canonicalizer, to_chat_messages(messages), options)
        return self._request(prompt, options), parser

    def _completion_prompt(self, prompt: str, formatted: bool) -> Any:
        if formatted:
            return prompt
        messages = self._extend_messages([ChatMessage(role=MessageRole.USER, content=prompt)])
        return to_chat_messages(messages)


def _chat_delta(piece: StreamChunk, parser: ReplyParser, content: str) -> tuple[ChatResponse, str]:
    """A streamed piece as a chat response, and the content so far (the last one carries the calls)."""
    delta = parser.push(piece.text)
    if piece.result is None:
        content += delta
        message = ChatMessage(role=MessageRole.ASSISTANT, content=content)
        return ChatResponse(message=message, delta=delta), content
    rest, reply = parser.finish()
    response = _chat_response(piece.result, reply)
    response.delta = delta + rest
    return response, content + delta + rest


def _completion(text: str, piece: StreamChunk) -> CompletionResponse:
    return CompletionResponse(
        text=text, delta=piece.text, raw=None if piece.result is None else _raw(piece.result)
    )


def _chat_response(result: GenerationResult, reply: Reply) -> ChatResponse:
    """The reply as an assistant message: its content, then one ``ToolCallBlock`` per call."""
    blocks: list[Any] = [TextBlock(text=reply.content)] if reply.content or not reply.calls else []
    blocks += [
        ToolCallBlock(tool_call_id=c.id, tool_name=c.name, tool_kwargs=c.arguments) for c in reply.calls
    ]
    extra: dict[str, Any] = {}
    if reply.invalid:
        extra["invalid_tool_calls"] = [{"id": c.id, "raw": c.raw, "error": c.error} for c in reply.invalid]
    message = ChatMessage(role=MessageRole.ASSISTANT, blocks=blocks, additional_kwargs=extra)
    raw = _raw(result)
    if reply.calls:
        raw["finish_reason"] = "tool_calls"
    return ChatResponse(message=message, raw=raw)


def _raw(result: GenerationResult) -> dict[str, Any]:
    """OpenAI-style usage (read by TokenCountingHandler) plus kvboost's reuse details."""
    u = result.usage
    return {
        "usage": {
            "prompt_tokens": u.prompt_tokens,
            "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        },
        "finish_reason": result.finish_reason,
        "kvboost": result.reuse_report(),
    }
