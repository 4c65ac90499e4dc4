"""ChatKVBoost: a LangChain chat model backed by a local kvboost-rag engine."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal, NamedTuple

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.messages.tool import InvalidToolCall, ToolCall, tool_call_chunk
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import BaseModel, ConfigDict, Field, PlainSerializer

from kvboost_rag.tool_calls import ReplyParser, forced_prefix, offer_tools
from langchain_kvboost.messages import to_chat_messages

if TYPE_CHECKING:
    from kvboost_rag import GenerationResult, KVBoostEngine, Request, StreamChunk


def clear_engines() -> None:
    """Close and forget every engine the process-wide registry holds."""
    from kvboost_rag.shared import close_shared_engines

    close_shared_engines()


def _redacted(url: str | None) -> str | None:
    """The URL as dumps show it: without its password (imported on use, so the adapter loads light)."""
    from kvboost_rag.config import redacted_url

    return redacted_url(url)


class ChatKVBoost(BaseChatModel):
    """Chat model over a local HF causal LM that reuses the KV of repeated context.

    System prompts, retrieved documents and chat history that come back in the
    next call are read from the KV store instead of being recomputed; answers in
    ``reuse="exact"`` mode are bitwise identical to the uncached path.

    Construction is cheap: the engine loads on first use and is shared by every
    ``ChatKVBoost`` with the same model, dtype, device, store and chunk size.

    Example:
        .. code-block:: python

            from langchain_kvboost import ChatKVBoost

            llm = ChatKVBoost(model="smollm2-135m-instruct", store_dir="./kv", max_tokens=64)
            msg = llm.invoke([("system", "Be brief."), ("human", "What is a KV cache?")])
            msg.usage_metadata["input_token_details"]["cache_read"]
    """

    model_config = ConfigDict(populate_by_name=True)

    model: str = Field(default="smollm2-135m-instruct", alias="model_name")
    """Alias (``smollm2-135m-instruct``, ``qwen2.5-coder-0.5b-instruct``), HF model id or local path."""
    store_dir: str | None = None
    """KV store directory shared across processes and restarts; None keeps KV in memory only."""
    redis_url: Annotated[str | None, PlainSerializer(_redacted)] = Field(default=None, repr=False)
    """Shared Redis tier (``redis://host:port/0``) read by every worker process; None: off."""
    dtype: str = "auto"
    """Weights and KV dtype: ``auto`` (bfloat16 where the hardware runs it natively, else float32),
    ``bfloat16``, ``float32`` or ``float16``."""
    device: str | None = None
    """Torch device (``cpu``, ``cuda``); None keeps the loader's default."""
    temperature: float = 0.0
    """Sampling temperature; 0 is greedy."""
    max_tokens: int = 256
    """Most tokens to generate per call."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = 0
    """Sample among the k most likely tokens; 0 disables."""
    seed: int | None = None
    """Seed for sampling; the same seed gives the same tokens."""
    stop: list[str] | None = Field(default=None, alias="stop_sequences")
    """Stop strings, applied to the text and trimmed from it."""
    reuse: Literal["exact", "blend", "off"] = "exact"
    """``exact`` reuses stored KV with zero loss; ``blend`` also reuses pre-warmed documents at any
    position (approximate, counted in ``response_metadata["kvboost"]["approx_tokens"]``);
    ``off`` never reads or writes the store."""
    blend_recompute_ratio: float | None = Field(default=None, ge=0.0, le=1.0)
    """Blend mode: share of reused document tokens recomputed (None: the engine's setting)."""
    chunk_size: int | None = None
    """Tokens per stored chunk: the granularity of exact reuse (None: the engine's default, 64 tokens
    with the split-invariant forward)."""
    cache_salt: str | None = Field(default=None, min_length=1)
    """Tenant of the KV cache: models with different salts never share stored KV (None: shared);
    also per call (``invoke(..., cache_salt=...)``)."""

    @property
    def _llm_type(self) -> str:
        return "kvboost"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "dtype": self.dtype,
            "temperature": self.temperature,
            "reuse": self.reuse,
        }

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> Any:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "kvboost"
        params["ls_model_name"] = kwargs.get("model", self.model)
        params["ls_model_type"] = "chat"
        params["ls_temperature"] = kwargs.get("temperature", self.temperature)
        params["ls_max_tokens"] = kwargs.get("max_tokens", self.max_tokens)
        return params

    @property
    def engine(self) -> KVBoostEngine:
        """The shared engine (loaded on first use)."""
        return self._engine_of(self.model)

    def _engine_of(self, model: str) -> KVBoostEngine:
        """The shared engine of ``model`` with this chat model's dtype, device and store."""
        from kvboost_rag.shared import EngineSpec, shared_engine

        return shared_engine(
            EngineSpec(model, self.dtype, self.device, self.store_dir, self.chunk_size, self.redis_url)
        )

    # -- generation --------------------------------------------------------------------------
    # invoke and stream share one path: the request (with any tools), the engine's pieces, and
    # one ReplyParser that splits content from tool calls; invoke feeds it the whole reply.

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type[BaseModel] | Callable | BaseTool],
        *,
        tool_choice: str | dict | bool | None = None,
        **kwargs: Any,
    ) -> Runnable[Any, AIMessage]:
        """Offer tools to the model; calls come back in ``AIMessage.tool_calls``.

        ``tool_choice``: ``"auto"`` (default), ``"none"``, ``"any"``/``"required"`` (must call
        one), or a tool name (must call that one; the reply is started for the model).
        """
        formatted = [convert_to_openai_tool(t) for t in tools]
        forced_prefix(tool_choice, formatted)  # validates a named tool_choice now
        return super().bind(tools=formatted, tool_choice=tool_choice, **kwargs)

    def _call(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]) -> _Call:
        """What one call runs: its engine (``model=`` in the call picks another), request and parser."""
        from kvboost_rag.shared import request_for

        model = kwargs.pop("model", None) or self.model
        engine = self._engine_of(model)
        prompt, parser = offer_tools(engine.canonicalizer, to_chat_messages(messages), kwargs)
        return _Call(model, engine, request_for(prompt, self, kwargs, stop=stop), parser)

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        call = self._call(messages, stop, kwargs)
        return self._chat_result(call, call.engine.generate(call.request))

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        # Served by the engine's scheduler: concurrent calls share batches, the event loop stays
        # free, and cancelling the task stops the request at its next token.
        call = await asyncio.to_thread(self._call, messages, stop, kwargs)  # the first use loads the model
        return self._chat_result(call, await call.engine.agenerate(call.request))

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        call = self._call(messages, stop, kwargs)
        stream = call.engine.stream(call.request)
        try:
            for piece in stream:
                chunk = self._chunk(call, piece)
                if run_manager is not None and chunk.text:
                    run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk
        finally:
            stream.close()  # a consumer that stops early ends the request here

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        # Native: the engine hands each delta to the event loop as it comes out (no worker
        # thread per chunk); a consumer that stops or is cancelled stops the request.
        call = await asyncio.to_thread(self._call, messages, stop, kwargs)
        stream = call.engine.astream(call.request)
        try:
            async for piece in stream:
                chunk = self._chunk(call, piece)
                if run_manager is not None and chunk.text:
                    await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk
        finally:
            await stream.aclose()

    def _chunk(self, call: _Call, piece: StreamChunk) -> ChatGenerationChunk:
        """A streamed piece as a chunk; the last one carries the tool calls, usage and metadata
        (calls that do not parse are left out of a stream; :meth:`invoke` reports them)."""
        delta = call.parser.push(piece.text)
        if piece.result is None:
            return ChatGenerationChunk(message=AIMessageChunk(content=delta))
        rest, reply = call.parser.finish()
        message = AIMessageChunk(
            content=delta + rest,
            tool_call_chunks=[
                tool_call_chunk(name=c.name, args=json.dumps(c.arguments), id=c.id, index=i)
                for i, c in enumerate(reply.calls)
            ],
            usage_metadata=_usage(piece.result),
            response_metadata=_response_metadata(call.model, piece.result, bool(reply.calls)),
            chunk_position="last",
        )
        return ChatGenerationChunk(message=message)

    def _chat_result(self, call: _Call, result: GenerationResult) -> ChatResult:
        """The whole reply as one message: the same parser, fed the reply in one piece."""
        reply = call.parser.whole(result.text)
        message = AIMessage(
            content=reply.content,
            tool_calls=[
                ToolCall(name=c.name, args=c.arguments, id=c.id, type="tool_call") for c in reply.calls
            ],
            invalid_tool_calls=[
                InvalidToolCall(name=None, args=c.raw, id=c.id, error=c.error, type="invalid_tool_call")
                for c in reply.invalid
            ],
            usage_metadata=_usage(result),
            response_metadata=_response_metadata(call.model, result, bool(reply.calls)),
        )
        return ChatResult(generations=[ChatGeneration(message=message)])


class _Call(NamedTuple):
    """One call: the model it runs on, that model's engine, the request and its reply's parser."""

    model: str
    engine: KVBoostEngine
    request: Request
    parser: ReplyParser


def _response_metadata(model: str, result: GenerationResult, called_tools: bool) -> dict[str, Any]:
    return {
        "model_name": model,
        "model_provider": "kvboost",
        "finish_reason": "tool_calls" if called_tools else result.finish_reason,
        "kvboost": result.reuse_report(),
    }


def _usage(result: GenerationResult) -> UsageMetadata:
    u = result.usage
    return UsageMetadata(
        input_tokens=u.prompt_tokens,
        output_tokens=u.completion_tokens,
        total_tokens=u.total_tokens,
        input_token_details={"cache_read": u.cached_tokens, "cache_creation": u.stored_tokens},
    )
