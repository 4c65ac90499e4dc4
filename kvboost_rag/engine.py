"""KVBoostEngine: the Python API over canonicalizer, store, assembler and runner.

The engine is a facade: it loads and checks the model, has its parts built (the prefill
schedule chosen, the store opened: :mod:`.engine_build`), and hands requests through
:mod:`.dispatch` to :mod:`.generation`, warm-ups to :mod:`.warming`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from .async_stream import AsyncStream, Feed
from .canonical import CanonicalPrompt, PromptInput, Segment
from .config import EngineConfig
from .dispatch import Dispatcher
from .engine_build import build_core
from .errors import KVBoostError, UnsupportedModelError
from .followups import FollowUps
from .generation import Generation
from .invariance import schedule_stats
from .models import load_model
from .prepared import Prepared
from .request import Request
from .results import GenerationResult, PrewarmReport, WarmReport
from .store import KVStore
from .streams import CancellableStream, ScheduledStream
from .warming import prewarm, store_reply, warm


class KVBoostEngine:
    """Generate with a HF causal LM, reusing the KV of repeated context chunk by chunk.

    Safe to call from several threads: concurrent :meth:`generate` calls are served in batches
    (see :meth:`generate_batch`), streams one at a time.

    >>> engine = KVBoostEngine.from_pretrained("smollm2-135m-instruct")  # doctest: +SKIP
    >>> r = engine.generate([{"role": "user", "content": "Hi!"}], max_new_tokens=8)  # doctest: +SKIP
    >>> r.usage.cached_tokens, r.timings.ttft_s  # doctest: +SKIP
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        config: EngineConfig | None = None,
        store: KVStore | None = None,
        store_dir: str | Path | None = None,
        model_name: str | None = None,
    ) -> None:
        if getattr(model.config, "is_encoder_decoder", False) or not hasattr(model, "generate"):
            msg = (
                f"{type(model).__name__} is not a decoder-only causal LM; load one with AutoModelForCausalLM"
            )
            raise UnsupportedModelError(msg)
        if store is not None and store_dir is not None:
            raise ValueError("pass either store or store_dir, not both")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        self.model_name = model_name or getattr(model.config, "_name_or_path", "") or type(model).__name__
        self.core, self.invariance = build_core(
            model, tokenizer, self.config, store=store, store_dir=store_dir
        )
        core = self.core  # its parts, also by the names the engine has always had
        self.assembler, self.canonicalizer = core.assembler, core.canonicalizer
        self.store, self.registry = core.store, core.registry
        self.namespace, self.chunk_size = core.namespace, core.chunk_size
        self._followups = FollowUps(name="kvboost-reply-store")
        self.generation = Generation(self.core, self._followups)
        self._dispatch = Dispatcher(self.generation, self.config)
        if self.config.reuse == "blend":
            self.core.blend_shifter()  # refuse an unsupported model now, not at the first request

    @property
    def eos_ids(self) -> frozenset[int]:
        """Token ids that end generation."""
        return self.core.eos_ids

    @eos_ids.setter
    def eos_ids(self, ids: frozenset[int]) -> None:
        self.core.eos_ids = frozenset(ids)

    @property
    def reuse_note(self) -> str | None:
        """Why reuse is coarser than the split-invariant forward allows, or None."""
        return self.core.reuse_note

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        *,
        store_dir: str | None = None,
        dtype: str | torch.dtype = "auto",
        device: str | None = None,
        config: EngineConfig | None = None,
        **config_overrides: Any,
    ) -> KVBoostEngine:
        """Load an alias (``smollm2-135m-instruct``, ``qwen2.5-coder-0.5b-instruct``), HF id or local path."""
        base = dict(config or EngineConfig())  # the fields as set: a dump would redact the secrets
        config = EngineConfig.model_validate(base | config_overrides)
        model, tokenizer = load_model(name_or_path, dtype=dtype, device=device)
        return cls(model, tokenizer, config=config, store_dir=store_dir, model_name=name_or_path)

    # -- generation ----------------------------------------------------------

    def canonicalize(self, prompt: PromptInput, *, add_generation_prompt: bool = True) -> CanonicalPrompt:
        """Segments and canonical token ids of a prompt, as the engine will run it."""
        return self.core.canonicalize(prompt, add_generation_prompt=add_generation_prompt)

    def generate(self, prompt: PromptInput | Request, **settings: Any) -> GenerationResult:
        """Generate a completion. ``prompt``: a string, a list of strings/Segments, chat messages, or a
        :class:`~kvboost_rag.Request`; ``settings``: its fields (``max_new_tokens``, ``temperature``,
        ``top_p``, ``top_k``, ``seed``, ``stop``, ``reuse``, ``cache_salt``, ...), each documented there.

        Calls from several threads at once are served in batches (see :meth:`submit`).
        """
        return self._dispatch.run(Request.coerce(prompt, settings))

    def stream(self, prompt: PromptInput | Request, **settings: Any) -> CancellableStream | ScheduledStream:
        """Like :meth:`generate`, yielding text deltas; the last item carries the result. Bad input
        raises here, before the first item.

        Streams are served by the batching scheduler as :meth:`generate` calls are: a lone stream
        runs the exact single-request path, concurrent ones share batches (and their decode steps)
        with each other and with non-streamed requests, each getting its deltas as its tokens come
        out. A reader that falls ``config.stream_buffer_deltas`` behind is stopped
        (:class:`~kvboost_rag.errors.StreamOverflowError`); the batch never waits for it. With
        ``max_batch_size=1`` a stream runs in the calling thread.

        ``stream.cancel()``, from any thread, stops the request at its next layer or token
        (a long prefill too); the stream then raises ``concurrent.futures.CancelledError``.
        """
        request = Request.coerce(prompt, settings)
        return self._dispatch.stream(self.generation.prepare(request, time.perf_counter()))

    def astream(self, prompt: PromptInput | Request, **settings: Any) -> AsyncStream:
        """:meth:`stream` for asyncio: ``async for piece in engine.astream(...)``. The request is
        served by the batching scheduler and each delta is handed to the event loop as it comes
        out, by callback: no thread waits for it, and the loop never blocks. Bad input raises at
        the first item (or at ``await stream.start()``); leaving the loop early, ``await
        stream.aclose()`` or cancelling the reading task stops the request at its next layer or token.
        """
        request = Request.coerce(prompt, settings)

        def open_feed(loop: asyncio.AbstractEventLoop) -> Feed:  # prepared as the stream starts
            return self._dispatch.feed(self.generation.prepare(request, time.perf_counter()), loop)

        return AsyncStream(open_feed)

    def submit(self, request: Request) -> Future[GenerationResult]:
        """Queue a request for the batching scheduler; returns a future of its result.

        Requests queued within ``config.batch_window_ms`` of each other, or while a batch
        runs, are served together. ``future.cancel()`` also stops a running request at
        its next token; the other requests of its batch are unaffected.
        """
        return self._dispatch.submit(request)

    async def agenerate(self, prompt: PromptInput | Request, **settings: Any) -> GenerationResult:
        """:meth:`generate` for asyncio: served by the scheduler, so the event loop is never blocked;
        cancelling the awaiting task stops the request at its next token."""
        return await asyncio.wrap_future(self.submit(Request.coerce(prompt, settings)))

    def generate_batch(
        self, requests: Sequence[Request | PromptInput], *, return_exceptions: bool = False, **defaults: Any
    ) -> list[GenerationResult | Exception]:
        """Generate for many requests at once; results come back in request order.

        Items are :class:`Request` objects or bare prompts (which take ``defaults``, the keyword
        arguments of :meth:`generate`). Shared prompt prefixes are computed once; the last
        chunks and the decoding run as one batch, every request with its own sampling and
        stopping. With ``return_exceptions=True`` a bad request yields its exception in
        its slot and the others still run; otherwise the first bad request raises before
        anything runs.

        In exact mode each request's KV prefix is bit-exact; the batched last chunk and
        decoding differ from a lone run only by float rounding (different matrix shapes),
        and greedy tokens match a lone run on the test corpus (``tests/test_batch.py``).
        """
        t0 = time.perf_counter()
        results: list[GenerationResult | Exception | None] = [None] * len(requests)
        prepared: dict[int, Prepared] = {}
        for i, item in enumerate(requests):
            try:
                prepared[i] = self.generation.prepare(Request.coerce(item, defaults), t0)
            except KVBoostError as e:
                if not return_exceptions:
                    raise
                results[i] = e
        for i, outcome in zip(prepared, self.generation.run_all(list(prepared.values())), strict=True):
            if isinstance(outcome, BaseException) and not return_exceptions:
                raise outcome
            results[i] = outcome  # type: ignore[assignment]
        return results  # type: ignore[return-value]

    # -- warm-up ---------------------------------------------------------------

    def warm(
        self, prompt: PromptInput, *, add_generation_prompt: bool = False, cache_salt: str | None = None
    ) -> WarmReport:
        """Prefill a prompt (a system prompt, shared context) into the store without generating;
        ``cache_salt``: for that tenant's requests only (see :attr:`Request.cache_salt`)."""
        return warm(self.core, prompt, add_generation_prompt=add_generation_prompt, salt=cache_salt)

    def prewarm(
        self,
        documents: Iterable[str],
        *,
        prefix: str | Sequence[Segment] = "",
        pin: bool = False,
        progress: Callable[[int], None] | None = None,
        cache_salt: str | None = None,
    ) -> PrewarmReport:
        """Store the exact KV of ``prefix + document`` for each document and register the documents.

        ``prefix`` is what precedes the documents at query time, in the form the
        prompts will take:

        - a string: flat prompts ``prefix + document + ...``;
        - segments: a segment list ``[*prefix, Segment(document, "document"), ...]``;
          when the last segment is a chat ``message`` (as the framework integrations
          render it with :func:`~kvboost_rag.canonical.segments_before`), the document
          continues that message's text, as a template inlines it.

        Such a prompt then reads the stored KV (to within one chunk of where the
        document ends), and blend reuse finds the document's paragraphs anywhere.
        Pre-warming never changes a prompt's tokens, only what is stored. Documents
        already stored are skipped, so an interrupted run can simply be started again.
        ``progress`` is called with the token count of each finished document. With
        ``cache_salt`` the documents serve that tenant's requests only.

        >>> engine.prewarm(["Paris is the capital of France."], prefix="Context:\\n\\n")  # doctest: +SKIP
        """
        return prewarm(self.core, documents, prefix=prefix, pin=pin, progress=progress, salt=cache_salt)

    def store_reply(
        self, messages: Sequence[Mapping[str, Any]], reply: str, *, cache_salt: str | None = None
    ) -> WarmReport | None:
        """Store ``messages`` followed by the assistant ``reply`` as the next turn will render them.

        The engine does this by itself after each chat answer (``EngineConfig.store_replies``);
        call it for a reply that came from elsewhere (edited, or from another model). Rendered
        with a following user message and cut before it, so the template output is the next
        turn's, not that of a conversation ending on the reply. Returns None when the template
        cannot render the conversation or it does not fit the context window.

        >>> engine.store_reply([{"role": "user", "content": "Hi"}], "Hello!")  # doctest: +SKIP
        """
        return store_reply(self.core, messages, reply, cache_salt)

    # -- state and lifetime ------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Per-tier counters (hits, misses, puts, evictions, entries, bytes, pinned, hit rate), the number
        of registered documents, ``reuse``: the prefill schedule, chunk size and probe result, and
        ``context``: the held contexts (:attr:`EngineConfig.held_context_tokens`)."""
        out: dict[str, Any] = {
            name: vars(s) | {"hit_rate": s.hit_rate} for name, s in self.store.stats().items()
        }
        out["documents"] = len(self.registry)
        out["reuse"] = schedule_stats(self.invariance, self.assembler.invariant, self.chunk_size)
        out["context"] = self.core.held.stats()
        return out

    def flush(self) -> None:
        """Wait for background work: replies being stored for the next turn, and store writes."""
        self._followups.join()
        self.store.flush()

    def close(self) -> None:
        """Finish queued requests and background work, flush pending disk writes and release the store."""
        self._dispatch.close()
        self._followups.close()
        self.store.close()
        self.registry.close()

    def __enter__(self) -> KVBoostEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
