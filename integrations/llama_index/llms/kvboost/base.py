"""KVBoost: a LlamaIndex LLM backed by a local kvboost-rag engine."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Generator, Iterator, Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar, cast

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
)
from llama_index.core.constants import DEFAULT_CONTEXT_WINDOW
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.llm import LLM
from llama_index.llms.kvboost.messages import to_chat_messages
from pydantic import Field, PlainSerializer

if TYPE_CHECKING:
    from kvboost_rag import GenerationResult, KVBoostEngine, Request, StreamChunk

logger = logging.getLogger(__name__)

T = TypeVar("T")


def _redacted(url: str | None) -> str | None:
    """The URL as dumps show it: without its password (imported on use, so the adapter loads light)."""
    from kvboost_rag.config import redacted_url

    return redacted_url(url)


class KVBoost(LLM):
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
            is_function_calling_model=False,
            model_name=self.model,
        )

    # -- sync --------------------------------------------------------------------------------

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._chat(messages, kwargs)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return self._stream_chat(messages, kwargs)

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """Complete ``prompt`` as a user turn of the chat template (``formatted=True``: sent as is)."""
        return self._complete(prompt, formatted, kwargs)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return self._stream_complete(prompt, formatted, kwargs)

    # -- async: the engine's scheduler serves these (concurrent calls share batches, and a
    #    cancelled task stops its request); streams advance in worker threads ------------------

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        engine = await self._aengine()
        result = await engine.agenerate(self._request(to_chat_messages(messages), kwargs))
        return _chat_response(result)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        await self._aengine()
        return _in_worker_thread(self._stream_chat(messages, kwargs))

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        engine = await self._aengine()
        result = await engine.agenerate(self._request(self._completion_prompt(prompt, formatted), kwargs))
        return CompletionResponse(text=result.text, raw=_raw(result))

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        await self._aengine()
        return _in_worker_thread(self._stream_complete(prompt, formatted, kwargs))

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

    def _completion_prompt(self, prompt: str, formatted: bool) -> Any:
        if formatted:
            return prompt
        messages = self._extend_messages([ChatMessage(role=MessageRole.USER, content=prompt)])
        return to_chat_messages(messages)

    def _chat(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> ChatResponse:
        return _chat_response(self.engine.generate(self._request(to_chat_messages(messages), kwargs)))

    def _stream_chat(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> ChatResponseGen:
        request = self._request(to_chat_messages(messages), kwargs)  # bad input fails at the call
        return (
            ChatResponse(
                message=ChatMessage(role=MessageRole.ASSISTANT, content=text),
                delta=piece.text,
                raw=None if piece.result is None else _raw(piece.result),
            )
            for text, piece in _accumulate(self.engine.stream(request))
        )

    def _complete(self, prompt: str, formatted: bool, kwargs: dict[str, Any]) -> CompletionResponse:
        result = self.engine.generate(self._request(self._completion_prompt(prompt, formatted), kwargs))
        return CompletionResponse(text=result.text, raw=_raw(result))

    def _stream_complete(self, prompt: str, formatted: bool, kwargs: dict[str, Any]) -> CompletionResponseGen:
        request = self._request(self._completion_prompt(prompt, formatted), kwargs)
        return (
            CompletionResponse(
                text=text, delta=piece.text, raw=None if piece.result is None else _raw(piece.result)
            )
            for text, piece in _accumulate(self.engine.stream(request))
        )


def _accumulate(pieces: Iterator[StreamChunk]) -> Iterator[tuple[str, StreamChunk]]:
    """Each streamed piece with the text so far."""
    text = ""
    for piece in pieces:
        text += piece.text
        yield text, piece


_DONE = object()


async def _in_worker_thread(items: Generator[T, None, None]) -> AsyncGenerator[T, None]:
    """Iterate a blocking generator in worker threads, one step at a time."""
    try:
        while (item := await asyncio.to_thread(next, items, _DONE)) is not _DONE:
            yield cast(T, item)
    finally:
        # A step still running in its thread (the caller was cancelled) cannot be closed now;
        # the generator is then closed when it is collected.
        with contextlib.suppress(ValueError):
            items.close()


def _chat_response(result: GenerationResult) -> ChatResponse:
    return ChatResponse(
        message=ChatMessage(role=MessageRole.ASSISTANT, content=result.text), raw=_raw(result)
    )


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
