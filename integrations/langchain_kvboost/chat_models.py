"""ChatKVBoost: a LangChain chat model backed by a local kvboost-rag engine."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.messages.tool import tool_call_chunk
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import BaseModel, ConfigDict, Field, PlainSerializer

from langchain_kvboost import tools as hermes
from langchain_kvboost.messages import to_chat_messages

if TYPE_CHECKING:
    from kvboost_rag import GenerationResult, KVBoostEngine, Request


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
        from kvboost_rag.shared import EngineSpec, shared_engine

        return shared_engine(
            EngineSpec(self.model, self.dtype, self.device, self.store_dir, self.chunk_size, self.redis_url)
        )

    # -- generation --------------------------------------------------------------------------

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
        hermes.forced_prefix(tool_choice, formatted)  # validates a named tool_choice now
        return super().bind(tools=formatted, tool_choice=tool_choice, **kwargs)

    def _prompt(
        self, messages: list[BaseMessage], tools: list[dict] | None, tool_choice: Any
    ) -> tuple[Any, str]:
        """The engine prompt, and the text the reply is started with (forced tool calls)."""
        chat = to_chat_messages(messages)
        if not tools or tool_choice == "none":
            return chat, ""
        from kvboost_rag import Segment

        engine = self.engine
        if hermes.template_renders_tools(engine.tokenizer):
            segments = engine.canonicalizer.segments_of(chat, tools=tools)
        else:
            segments = engine.canonicalizer.segments_of(hermes.with_fallback_prompt(chat, tools))
        prefix = hermes.forced_prefix(tool_choice, tools)
        return (segments + [Segment(prefix, "text")] if prefix else segments), prefix

    def _request(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> tuple[Request, str, set[str] | None]:
        """The engine request, the forced reply start, and the tool names to parse calls of (None: none)."""
        from kvboost_rag.shared import request_for

        tools = kwargs.pop("tools", None)
        tool_choice = kwargs.pop("tool_choice", None)
        prompt, prefix = self._prompt(messages, tools, tool_choice)
        request = request_for(prompt, self, kwargs, stop=stop)
        names = {t["function"]["name"] for t in tools} if tools and tool_choice != "none" else None
        return request, prefix, names

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        request, prefix, tool_names = self._request(messages, stop, kwargs)
        return self._chat_result(self.engine.generate(request), prefix, tool_names)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        # Served by the engine's scheduler: concurrent calls share batches, the event loop stays
        # free, and cancelling the task stops the request at its next token.
        engine = await asyncio.to_thread(lambda: self.engine)  # the first use loads the model
        request, prefix, tool_names = self._request(messages, stop, kwargs)
        return self._chat_result(await engine.agenerate(request), prefix, tool_names)

    def _chat_result(self, result: GenerationResult, prefix: str, tool_names: set[str] | None) -> ChatResult:
        content, calls, invalid = (
            hermes.parse(prefix + result.text, tool_names) if tool_names else (result.text, [], [])
        )
        message = AIMessage(
            content=content,
            tool_calls=calls,
            invalid_tool_calls=invalid,
            usage_metadata=_usage(result),
            response_metadata=self._response_metadata(result, bool(calls)),
        )
        return ChatResult(generations=[ChatGeneration(message=message)])

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        request, prefix, tool_names = self._request(messages, stop, kwargs)
        text, shown = prefix, 0  # with tools, content stops where a tool call starts
        for piece in self.engine.stream(request):
            text += piece.text
            if tool_names:
                # a bare call object (no tags) is only known at the end: hold back a reply that opens with "{"
                safe = "" if text.lstrip().startswith("{") else text[: hermes.content_safe_length(text)]
                if piece.result is not None:
                    safe = hermes.parse(text, tool_names)[0]
                delta, shown = safe[shown:], max(shown, len(safe))
            else:
                delta = piece.text
            if piece.result is None:
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=delta))
            else:
                calls = hermes.parse(text, tool_names)[1] if tool_names else []
                chunk = ChatGenerationChunk(
                    message=AIMessageChunk(
                        content=delta,
                        tool_call_chunks=[
                            tool_call_chunk(name=c["name"], args=json.dumps(c["args"]), id=c["id"], index=i)
                            for i, c in enumerate(calls)
                        ],
                        usage_metadata=_usage(piece.result),
                        response_metadata=self._response_metadata(piece.result, bool(calls)),
                        chunk_position="last",
                    )
                )
            if run_manager is not None and delta:
                run_manager.on_llm_new_token(delta, chunk=chunk)
            yield chunk

    def _response_metadata(self, result: GenerationResult, called_tools: bool = False) -> dict[str, Any]:
        return {
            "model_name": self.model,
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
