"""KVBoostEngine: the Python API that ties canonicalizer, store, assembler and runner together."""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
import uuid
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import CancelledError, Future
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import torch

from .assembler import Assembler
from .canonical import (
    Canonicalizer,
    CanonicalPrompt,
    PromptInput,
    Segment,
    is_messages,
    normalize_text,
    segments_before,
)
from .followups import FollowUps
from .config import EngineConfig, ReuseMode
from .batch import BatchRow, run_batch
from .blend import BlendSettings, blend_prefill, record_sources
from .errors import (
    ContextWindowExceededError,
    InvalidRequestError,
    KVBoostError,
    StoreError,
    UnsupportedModelError,
)
from .fingerprint import model_fingerprint, tokenizer_fingerprint
from .keys import Chunk, make_namespace, plan_chunks
from .invariance import InvarianceReport, remembered_invariance
from .models import kvboost_home, load_model
from .runner import PrefillOutcome, decode, holding_writes, prefill
from .sampling import SamplingParams
from .registry import DocumentRegistry
from .rope import RopeShifter
from .scheduler import Pending, Scheduler
from .store import DiskStore, KVStore, MemoryStore, TieredStore
from .textstream import TextStream

logger = logging.getLogger(__name__)

FinishReason = Literal["stop", "length"]

DEFAULT_INVARIANT_CHUNK = 64
"""Chunk size with the split-invariant forward: reuse to within 64 tokens of any shared prefix."""
DEFAULT_CANONICAL_CHUNK = 1024
"""Chunk size of the canonical schedule, where each chunk is also a forward step (see EngineConfig)."""


@dataclass
class Usage:
    """Token accounting of one request (DESIGN.md contract 6)."""

    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens read exactly from the store, all tiers."""
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    approx_tokens: int = 0
    """Prompt tokens reused approximately (blend mode); 0 in exact mode."""
    recomputed_tokens: int = 0
    """Prompt tokens run through the model."""
    stored_tokens: int = 0
    """Prompt tokens newly written to the store."""

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Timings:
    ttft_s: float
    """From the call to the first generated token: tokenization, lookup, loading and prefill included."""
    total_s: float
    prefill_s: float
    select_s: float = 0.0
    """Blend mode: time spent choosing the reused tokens to recompute (part of ``prefill_s``)."""


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    """Generated ids (EOS included when generation ended on it)."""
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    first_logits: torch.Tensor | None = None
    """float32 logits of the first generated position, when ``return_logits=True``."""
    reuse_note: str | None = None
    """Why chunk reuse was not used for this request, when it was not."""

    def reuse_report(self) -> dict[str, Any]:
        """Reuse and timing details as plain data, for framework response metadata."""
        u, t = self.usage, self.timings
        return {
            "cached_tokens": u.cached_tokens,
            "cached_tokens_by_tier": dict(u.cached_tokens_by_tier),
            "approx_tokens": u.approx_tokens,
            "recomputed_tokens": u.recomputed_tokens,
            "stored_tokens": u.stored_tokens,
            "ttft_s": t.ttft_s,
            "blend_select_s": t.select_s,
            "total_s": t.total_s,
            "reuse_note": self.reuse_note,
        }


class StreamChunk(NamedTuple):
    """One streaming step: a text delta; the last one also carries the full result."""

    text: str
    result: GenerationResult | None = None


@dataclass
class Request:
    """One generation request, for :meth:`KVBoostEngine.generate_batch` and :meth:`KVBoostEngine.submit`.

    The fields are the keyword arguments of :meth:`KVBoostEngine.generate`.
    """

    prompt: PromptInput
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    return_logits: bool = False
    add_generation_prompt: bool = True
    reuse: ReuseMode | None = None
    blend_recompute_ratio: float | None = None


class _Prepared(NamedTuple):
    request: Request
    canonical: CanonicalPrompt
    params: SamplingParams
    mode: ReuseMode
    submitted_at: float


@dataclass
class WarmReport:
    prompt_tokens: int
    cached_tokens: int
    stored_tokens: int
    seconds: float


@dataclass
class PrewarmReport:
    """What :meth:`KVBoostEngine.prewarm` did."""

    documents: int
    skipped: int
    """Documents whose every chunk was already stored (a resumed run skips them)."""
    tokens: int
    """Prompt tokens (prefix + document) over all documents processed."""
    computed_tokens: int
    seconds: float
    keys: list[str] = field(default_factory=list)
    """Prefix key of each pre-warmed document's last chunk, in input order (empty documents have none).
    The key names the exact ``prefix + document`` KV: ``engine.store.contains(key)`` tells whether it is stored."""

    @property
    def tokens_per_s(self) -> float:
        return self.computed_tokens / self.seconds if self.seconds > 0 else 0.0


def _token_offset(prompt: CanonicalPrompt, char_offset: int) -> int:
    """Token offset of the first segment that starts at ``char_offset`` of the prompt text or later.

    A paragraph cut (:func:`~kvboost_rag.canonical.split_paragraphs`) leaves a break's newlines
    with the paragraph after it, so a segment that starts with newlines just before counts too.
    """
    position = 0
    for segment, (start, _) in zip(prompt.segments, prompt.segment_spans, strict=True):
        lead = segment.text[: max(char_offset - position, 0)]
        if lead.strip("\n") == "" and len(lead) < len(segment.text):
            return start
        position += len(segment.text)
    return len(prompt)


def _shared_records(store: KVStore) -> Any:
    """Registry records of a tier that other processes share (the Redis tier), if the store has one."""
    for tier in getattr(store, "tiers", [store]):
        records = getattr(tier, "shared_records", None)
        if callable(records):
            return records()
    return None


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
            msg = f"{type(model).__name__} is not a decoder-only causal LM; load one with AutoModelForCausalLM"
            raise UnsupportedModelError(msg)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        self.model_name = model_name or getattr(model.config, "_name_or_path", "") or type(model).__name__
        self.assembler = Assembler(model, transposed_batch_weights=self.config.batch_transposed_weights)
        self.invariance = self._choose_schedule()
        self.chunk_size = self.config.chunk_size or (
            DEFAULT_INVARIANT_CHUNK if self.assembler.invariant else DEFAULT_CANONICAL_CHUNK
        )
        self.namespace = self._namespace()
        if store is not None and store_dir is not None:
            raise ValueError("pass either store or store_dir, not both")
        self.store: KVStore = store if store is not None else self._open_store(store_dir)
        self.registry = DocumentRegistry(
            Path(store_dir).expanduser() / "documents.sqlite" if store_dir else None,
            shared=_shared_records(self.store),  # a Redis tier shares documents between processes
        )
        self.canonicalizer = Canonicalizer(tokenizer)
        self.eos_ids = self._eos_ids()
        self._lock = threading.Lock()  # one prefill at a time (decode steps lock in the assembler)
        self._scheduler: Scheduler[Request] | None = None
        self._scheduler_lock = threading.Lock()
        self._shifter: RopeShifter | None = None
        self._followups = FollowUps(name="kvboost-reply-store")
        if self.config.reuse == "blend":
            self._blend_shifter()  # refuse an unsupported model now, not at the first request

    def _namespace(self) -> str:
        return make_namespace(
            model=model_fingerprint(self.model),
            tokenizer=tokenizer_fingerprint(self.tokenizer),
            dtype=str(next(self.model.parameters()).dtype),
            device=self.assembler.device.type,
            attention=self.assembler.attention_kernel,
        )

    def _choose_schedule(self) -> InvarianceReport | None:
        """Probe (or recall) split invariance and set the assembler's mode; None when not probed."""
        schedule = self.config.prefill_schedule
        if schedule == "canonical":
            return None
        saved, self.assembler.invariant = self.assembler.invariant, True
        probe_namespace = self._namespace()  # names the invariant kernel
        self.assembler.invariant = saved
        report = remembered_invariance(
            self.assembler, self._vocab_size(), probe_namespace, kvboost_home() / "probes.json"
        )
        if not report.holds and schedule == "invariant":
            msg = (
                f"prefill_schedule='invariant', but this model, dtype and device fail the split-invariance "
                f"probe ({report.detail}); use prefill_schedule='auto' to fall back to the canonical schedule"
            )
            raise UnsupportedModelError(msg)
        if not report.holds:
            logger.warning("split-invariance probe failed (%s); reuse is chunk-granular", report.detail)
        self.assembler.invariant = report.holds
        return report

    def _vocab_size(self) -> int:
        embeddings = self.model.get_input_embeddings()
        return int(embeddings.weight.shape[0])

    @property
    def reuse_note(self) -> str | None:
        """Why reuse is coarser than the split-invariant forward allows, or None."""
        if self.assembler.invariant:
            return None
        why = "prefill_schedule='canonical'" if self.invariance is None else self.invariance.detail
        return f"canonical chunk schedule ({why}): a stored prefix is reused in whole {self.chunk_size}-token chunks"

    def _open_store(self, store_dir: str | Path | None) -> KVStore:
        tiers: list[KVStore] = [MemoryStore(self.config.max_memory_bytes)]
        if store_dir is not None:
            tiers.append(DiskStore(store_dir, self.namespace, max_bytes=self.config.max_disk_bytes))
        if self.config.redis_url is not None:
            tiers.append(self._open_redis(self.config.redis_url))
        return tiers[0] if len(tiers) == 1 else TieredStore(tiers)

    def _open_redis(self, url: str) -> KVStore:
        """The shared Redis tier; opening it sends nothing, so a server that is down only costs misses."""
        try:
            from .store.redis import RedisStore
        except ImportError as e:
            msg = "redis_url needs the redis package: pip install 'kvboost-rag[redis]'"
            raise StoreError(msg) from e
        c = self.config
        known = set(inspect.signature(RedisStore).parameters) - {"url", "client", "namespace"}
        unknown = sorted(set(c.redis_options) - known)
        if unknown:
            msg = f"redis_options: unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            raise ValueError(msg)
        options = {"key_prefix": c.redis_key_prefix, "ttl_s": c.redis_ttl_s, "max_bytes": c.max_redis_bytes}
        return RedisStore(url, namespace=self.namespace, **(options | c.redis_options))

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
        config = EngineConfig.model_validate((config or EngineConfig()).model_dump() | config_overrides)
        model, tokenizer = load_model(name_or_path, dtype=dtype, device=device)
        return cls(model, tokenizer, config=config, store_dir=store_dir, model_name=name_or_path)

    # -- public API --------------------------------------------------------

    def canonicalize(self, prompt: PromptInput, *, add_generation_prompt: bool = True) -> CanonicalPrompt:
        """Segments and canonical token ids of a prompt, as the engine will run it."""
        return self.canonicalizer.canonicalize(prompt, add_generation_prompt=add_generation_prompt)

    def generate(
        self,
        prompt: PromptInput,
        *,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        return_logits: bool = False,
        add_generation_prompt: bool = True,
        reuse: ReuseMode | None = None,
        blend_recompute_ratio: float | None = None,
    ) -> GenerationResult:
        """Generate a completion. ``prompt``: a string, a list of strings/Segments, or chat messages.

        ``reuse`` overrides the engine's mode for this request: ``"off"`` runs the uncached path,
        ``"blend"`` also reuses pre-warmed documents at new positions (approximate; counted in
        ``usage.approx_tokens``), recomputing ``blend_recompute_ratio`` of them (default: the
        engine's ``blend_recompute_ratio``).

        Calls from several threads at once are served in batches (see :meth:`submit`).
        """
        request = Request(
            prompt, max_new_tokens, temperature, top_p, top_k, seed, stop, return_logits, add_generation_prompt, reuse,
            blend_recompute_ratio,
        )
        if self.config.max_batch_size == 1:
            return self._solo(self._prepare(request, time.perf_counter()))
        future = self.submit(request)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # interrupted while waiting: the row leaves its batch at the next token
            raise

    def stream(
        self,
        prompt: PromptInput,
        *,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        return_logits: bool = False,
        add_generation_prompt: bool = True,
        reuse: ReuseMode | None = None,
        blend_recompute_ratio: float | None = None,
    ) -> Iterator[StreamChunk]:
        """Like :meth:`generate`, yielding text deltas; the last item carries the result.

        Streams run one at a time, outside the batches.
        """
        request = Request(
            prompt, max_new_tokens, temperature, top_p, top_k, seed, stop, return_logits, add_generation_prompt, reuse,
            blend_recompute_ratio,
        )
        return self._run(self._prepare(request, time.perf_counter()))

    def submit(self, request: Request) -> Future[GenerationResult]:
        """Queue a request for the batching scheduler; returns a future of its result.

        Requests queued within ``config.batch_window_ms`` of each other, or while a batch
        runs, are served together. ``future.cancel()`` also stops a running request at
        its next token; the other requests of its batch are unaffected.
        """
        with self._scheduler_lock:
            if self._scheduler is None:
                self._scheduler = Scheduler(
                    self._serve_batch,
                    window_s=self.config.batch_window_ms / 1000,
                    max_batch_size=self.config.max_batch_size,
                )
        return self._scheduler.submit(request)

    async def agenerate(self, prompt: PromptInput, **kwargs: Any) -> GenerationResult:
        """:meth:`generate` for asyncio: served by the scheduler, so the event loop is never blocked.

        Cancelling the awaiting task stops the request at its next token.
        """
        return await asyncio.wrap_future(self.submit(Request(prompt, **kwargs)))

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
        items = [r if isinstance(r, Request) else Request(r, **defaults) for r in requests]
        results: list[GenerationResult | Exception | None] = [None] * len(items)
        prepared: dict[int, _Prepared] = {}
        for i, request in enumerate(items):
            try:
                prepared[i] = self._prepare(request, t0)
            except KVBoostError as e:
                if not return_exceptions:
                    raise
                results[i] = e
        for i, outcome in zip(prepared, self._run_prepared(list(prepared.values())), strict=True):
            if isinstance(outcome, BaseException) and not return_exceptions:
                raise outcome
            results[i] = outcome
        return results  # type: ignore[return-value]

    def warm(self, prompt: PromptInput, *, add_generation_prompt: bool = False) -> WarmReport:
        """Prefill a prompt (a system prompt, shared context) into the store without generating."""
        t0 = time.perf_counter()
        canonical = self.canonicalize(prompt, add_generation_prompt=add_generation_prompt)
        self._check_window(len(canonical), 0)
        with self._lock:
            out = self._prefill(canonical.token_ids, self._chunks(canonical), store=self.store, capacity=len(canonical))
        return WarmReport(len(canonical), sum(out.cached_by_tier.values()), out.stored_tokens, time.perf_counter() - t0)

    def prewarm(
        self,
        documents: Iterable[str],
        *,
        prefix: str | Sequence[Segment] = "",
        pin: bool = False,
        progress: Callable[[int], None] | None = None,
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
        ``progress`` is called with the token count of each finished document.

        >>> engine.prewarm(["Paris is the capital of France."], prefix="Context:\\n\\n")  # doctest: +SKIP
        """
        head = [Segment(prefix, "text")] if isinstance(prefix, str) else list(prefix)
        if not isinstance(prefix, str) and (not head or head[-1].kind != "message"):
            head.append(Segment("", "document"))  # the document is a segment of its own
        t0 = time.perf_counter()
        report = PrewarmReport(documents=0, skipped=0, tokens=0, computed_tokens=0, seconds=0.0)
        with self._lock:
            for doc in documents:
                doc = normalize_text(doc)
                if not doc:
                    continue
                *before, last = head
                canonical = self.canonicalize([*before, Segment(last.text + doc, last.kind)], add_generation_prompt=False)
                self._check_window(len(canonical), 0)
                chunks = self._chunks(canonical)
                report.documents += 1
                report.tokens += len(canonical)
                report.keys.append(chunks[-1].key)
                if all(self.store.contains(c.key) for c in chunks):
                    report.skipped += 1
                else:
                    out = self._prefill(canonical.token_ids, chunks, store=self.store, capacity=len(canonical))
                    report.computed_tokens += out.recomputed_tokens
                # where blend reuse finds this document's chunks, whatever precedes it at query time
                doc_start = _token_offset(canonical, len(canonical.text) - len(doc))
                record_sources(self.registry, self.namespace, canonical.token_ids, chunks,
                               [c.start >= doc_start for c in chunks])
                if pin:
                    for chunk in chunks:
                        self.store.pin(chunk.key)
                self.registry.register([doc])
                if progress is not None:
                    progress(len(canonical))
            self.store.flush()
        report.seconds = time.perf_counter() - t0
        return report

    def stats(self) -> dict[str, Any]:
        """Per-tier counters (hits, misses, puts, evictions, entries, bytes, pinned, hit rate), the number
        of registered documents, and ``reuse``: the prefill schedule, chunk size and probe result."""
        out: dict[str, Any] = {name: vars(s) | {"hit_rate": s.hit_rate} for name, s in self.store.stats().items()}
        out["documents"] = len(self.registry)
        out["reuse"] = {
            "schedule": "invariant" if self.assembler.invariant else "canonical",
            "chunk_tokens": self.chunk_size,
            "probe": None if self.invariance is None else self.invariance.detail,
            "note": self.reuse_note,
        }
        return out

    def flush(self) -> None:
        """Wait for background work: replies being stored for the next turn, and store writes."""
        self._followups.join()
        self.store.flush()

    def close(self) -> None:
        """Finish queued requests and background work, flush pending disk writes and release the store."""
        with self._scheduler_lock:
            scheduler, self._scheduler = self._scheduler, None
        if scheduler is not None:
            scheduler.close()
        self._followups.close()
        self.store.close()
        self.registry.close()

    def __enter__(self) -> KVBoostEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.model.config, self.tokenizer):
            value = getattr(source, "eos_token_id", None)
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        return frozenset(ids)

    def _blend_settings(self, recompute_ratio: float | None) -> BlendSettings:
        c = self.config
        ratio = c.blend_recompute_ratio if recompute_ratio is None else recompute_ratio
        return BlendSettings(ratio, c.blend_boundary_tokens, c.blend_select_layer)

    def _blend_shifter(self) -> RopeShifter:
        """The RoPE re-rotation of this model; raises UnsupportedModelError where blend cannot be exact."""
        if self._shifter is None:
            layers = self.assembler._num_layers()
            if self.config.blend_select_layer >= layers:
                msg = f"blend_select_layer={self.config.blend_select_layer}, but the model has {layers} layers; pick 0..{layers - 1}"
                raise ValueError(msg)
            self._shifter = RopeShifter(self.model)
        return self._shifter

    def _check_window(self, prompt_tokens: int, new_tokens: int) -> None:
        window = self.assembler.context_window
        if window is not None and prompt_tokens + max(new_tokens, 1) > window:
            msg = (
                f"the prompt has {prompt_tokens} tokens and the model's context window is {window}; "
                "shorten the prompt (fewer or shorter documents, less history) so at least one token can be generated"
            )
            raise ContextWindowExceededError(msg)

    def _prefill(self, token_ids: Sequence[int], chunks: Sequence[Chunk], **kwargs: Any) -> PrefillOutcome:
        return prefill(self.assembler, token_ids, chunks, step_tokens=self.config.max_forward_tokens, **kwargs)

    def _chunks(self, canonical: CanonicalPrompt) -> list[Chunk]:
        return plan_chunks(canonical, self.chunk_size, self.namespace)

    def _prepare(self, request: Request, submitted_at: float) -> _Prepared:
        """Validate and canonicalize a request (bad input raises here, before any work)."""
        params = SamplingParams(
            max_new_tokens=request.max_new_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            seed=request.seed,
            stop=SamplingParams.normalize_stop(request.stop),
        )
        mode = request.reuse or self.config.reuse
        if mode not in ("exact", "blend", "off"):
            raise InvalidRequestError(f"reuse={mode!r} is not a reuse mode; use 'exact', 'blend' or 'off'")
        ratio = request.blend_recompute_ratio
        if ratio is not None and not 0.0 <= ratio <= 1.0:
            raise InvalidRequestError(f"blend_recompute_ratio={ratio} is outside 0..1; pass a share such as 0.05")
        if mode == "blend":
            self._blend_shifter()
        canonical = self.canonicalize(request.prompt, add_generation_prompt=request.add_generation_prompt)
        self._check_window(len(canonical), 1)
        return _Prepared(request, canonical, params, mode, submitted_at)

    def _max_new_tokens(self, prepared: _Prepared) -> int:
        n_prompt = len(prepared.canonical)
        window = self.assembler.context_window or (n_prompt + prepared.params.max_new_tokens)
        return min(prepared.params.max_new_tokens, window - n_prompt)

    def _solo(self, prepared: _Prepared, cancel: threading.Event | None = None) -> GenerationResult:
        result = None
        steps = self._run(prepared)
        for chunk in steps:
            if cancel is not None and cancel.is_set():  # cancelled while running: stop at this token
                steps.close()
                raise CancelledError()
            result = chunk.result
        assert result is not None
        return result

    def _serve_batch(self, pending: Sequence[Pending[Request]]) -> list[GenerationResult | BaseException]:
        """Scheduler callback: prepare each request, isolating bad input, then run them together."""
        outcomes: list[GenerationResult | BaseException | None] = [None] * len(pending)
        prepared: list[tuple[int, _Prepared]] = []
        for i, p in enumerate(pending):
            try:
                prepared.append((i, self._prepare(p.request, p.submitted_at)))
            except Exception as e:
                outcomes[i] = e
        cancels = [pending[i].future.cancel_requested for i, _ in prepared]
        for (i, _), outcome in zip(prepared, self._run_prepared([p for _, p in prepared], cancels), strict=True):
            outcomes[i] = outcome
        return outcomes  # type: ignore[return-value]

    def _run_prepared(
        self, prepared: list[_Prepared], cancels: Sequence[threading.Event | None] | None = None
    ) -> list[GenerationResult | BaseException]:
        """Run prepared requests: alone when there is one (the exact solo path), else as a batch.

        Requests that cannot reuse chunks (sliding-window models beyond the window) and
        blend requests run alone.
        """
        cancels = list(cancels) if cancels is not None else [None] * len(prepared)
        n_total = [len(p.canonical) + self._max_new_tokens(p) for p in prepared]
        alone = [
            i for i, (p, n) in enumerate(zip(prepared, n_total, strict=True))
            if len(prepared) == 1 or p.mode == "blend" or self.assembler.exact_reuse_blocker(n)
        ]
        together = [i for i in range(len(prepared)) if i not in alone]
        outcomes: list[GenerationResult | BaseException | None] = [None] * len(prepared)
        for i in alone:
            try:
                outcomes[i] = self._solo(prepared[i], cancels[i])
            except Exception as e:
                outcomes[i] = e
        if together:
            try:
                batch = self._batch([prepared[i] for i in together], [cancels[i] for i in together])
            except Exception as e:  # e.g. out of memory: these requests fail, the others stand
                batch = [e] * len(together)
            for i, outcome in zip(together, batch, strict=True):
                outcomes[i] = outcome
        return outcomes  # type: ignore[return-value]

    def _follow_up(self, prepared: _Prepared, result: GenerationResult) -> None:
        """Queue storing a chat reply as the next turn will render it (see ``EngineConfig.store_replies``)."""
        messages = prepared.request.prompt
        if not self.config.store_replies or not is_messages(messages) or not prepared.request.add_generation_prompt:
            return
        self._followups.submit(lambda: self.store_reply(messages, result.text))  # type: ignore[arg-type]

    def store_reply(self, messages: Sequence[Mapping[str, Any]], reply: str) -> WarmReport | None:
        """Store ``messages`` followed by the assistant ``reply`` as the next turn will render them.

        The engine does this by itself after each chat answer (``EngineConfig.store_replies``);
        call it for a reply that came from elsewhere (edited, or from another model). Rendered
        with a following user message and cut before it, so the template output is the next
        turn's, not that of a conversation ending on the reply. Returns None when the template
        cannot render the conversation or it does not fit the context window.

        >>> engine.store_reply([{"role": "user", "content": "Hi"}], "Hello! How can I help?")  # doctest: +SKIP
        """
        marker = f"\x02reply-end-{uuid.uuid4().hex}\x03"
        following = [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": marker}]
        try:
            head = segments_before(self.canonicalizer.segments_of(following, add_generation_prompt=False), marker)
        except InvalidRequestError as e:  # a template that cannot render this: nothing to store
            logger.debug("reply not stored for the next turn: %s", e)
            return None
        while head and (head[-1].kind == "glue" or not head[-1].text):
            head.pop()  # the next message's opening belongs to the next turn's chunks
        if not head:
            return None
        canonical = self.canonicalize(head, add_generation_prompt=False)
        if self.assembler.exact_reuse_blocker(len(canonical) + 1) is not None:
            return None  # beyond a sliding window: nothing of it could be reused
        try:
            return self.warm(head)
        except ContextWindowExceededError:
            return None

    def _batch(
        self, prepared: list[_Prepared], cancels: list[threading.Event | None]
    ) -> list[GenerationResult | BaseException]:
        with self._followups.activity():
            return self._batch_rows(prepared, cancels)

    def _batch_rows(
        self, prepared: list[_Prepared], cancels: list[threading.Event | None]
    ) -> list[GenerationResult | BaseException]:
        t_prefill = time.perf_counter()
        rows = []
        prefix_keys = []
        with self._lock:
            for p, cancel in zip(prepared, cancels, strict=True):
                chunks = self._chunks(p.canonical)
                prefix_keys.append([(c.key, c.end) for c in chunks[:-1]])
                store = self.store if p.mode == "exact" else None
                prefix = None
                if len(chunks) > 1:  # every chunk but the last, exactly
                    prefix = self._prefill(
                        p.canonical.token_ids, chunks[:-1], store=store, capacity=chunks[-1].start, need_logits=False
                    )
                rows.append(BatchRow(p.canonical.token_ids, prefix, chunks[-1].start, p.params,
                                     self._max_new_tokens(p), cancel))
        shared = 0  # tokens of the leading chunks that every row has (same keys: same KV)
        for column in zip(*prefix_keys):
            if any(key != column[0] for key in column):
                break
            shared = column[0][1]
        outputs = run_batch(self.assembler, self.tokenizer, rows, self.eos_ids, self._lock, shared)
        done = time.perf_counter()
        results: list[GenerationResult | BaseException] = []
        for p, row, out in zip(prepared, rows, outputs, strict=True):
            if out.finish_reason == "cancelled":
                results.append(CancelledError())
                continue
            cached = row.prefix.cached_by_tier if row.prefix else {}
            usage = Usage(
                prompt_tokens=len(p.canonical),
                completion_tokens=len(out.token_ids),
                cached_tokens=sum(cached.values()),
                cached_tokens_by_tier=dict(cached),
                recomputed_tokens=(row.prefix.recomputed_tokens if row.prefix else 0) + len(p.canonical) - row.prefix_tokens,
                stored_tokens=row.prefix.stored_tokens if row.prefix else 0,
            )
            results.append(
                GenerationResult(
                    text=out.text,
                    token_ids=out.token_ids,
                    finish_reason=out.finish_reason,  # type: ignore[arg-type]
                    usage=usage,
                    timings=Timings(out.first_token_at - p.submitted_at, done - p.submitted_at,
                                    out.first_token_at - t_prefill),
                    first_logits=out.first_logits if p.request.return_logits else None,
                    reuse_note=self.reuse_note if p.mode == "exact" else None,
                )
            )
            if p.mode == "exact":
                self._follow_up(p, results[-1])  # type: ignore[arg-type]
        return results

    def _run(self, prepared: _Prepared) -> Iterator[StreamChunk]:
        """One request alone: text deltas, then the result; background work waits until it is done."""
        with self._followups.activity():
            last = yield from self._steps(prepared)
        assert last.result is not None
        if prepared.mode == "exact":
            self._follow_up(prepared, last.result)
        yield last

    def _steps(self, prepared: _Prepared) -> Generator[StreamChunk, None, StreamChunk]:
        """Prefill and decode one request, yielding text deltas; returns the last delta with the result."""
        canonical, params, mode, t0 = prepared.canonical, prepared.params, prepared.mode, prepared.submitted_at
        return_logits = prepared.request.return_logits
        n_prompt = len(canonical)
        max_new = self._max_new_tokens(prepared)
        blocker = self.assembler.exact_reuse_blocker(n_prompt + max_new)
        reuse = mode != "off" and blocker is None
        if blocker is not None:
            logger.info("chunk reuse off for this request: %s", blocker)
        ids = canonical.token_ids
        # The lock covers the prefill only: decoding yields to the caller, and a stream that is
        # abandoned half-way must not keep other requests out (forward calls lock on their own).
        with self._lock:
            t_prefill = time.perf_counter()
            if blocker is None:
                chunks = self._chunks(canonical)
            else:  # plain generation: one forward over the whole prompt through the model's own cache
                chunks = [Chunk(0, n_prompt, "")]
            if mode == "blend" and blocker is None:
                with holding_writes(self.assembler):
                    out = blend_prefill(
                        self.assembler, self._blend_shifter(), canonical, chunks,
                        store=self.store, registry=self.registry, namespace=self.namespace,
                        settings=self._blend_settings(prepared.request.blend_recompute_ratio),
                        capacity=n_prompt + max_new, store_last_logits=self.config.store_last_logits,
                    )
            else:
                out = self._prefill(
                    ids, chunks, store=self.store if reuse else None, capacity=n_prompt + max_new,
                    store_last_logits=self.config.store_last_logits, reusable=blocker is None,
                )
            prefill_s = time.perf_counter() - t_prefill
        usage = Usage(
            prompt_tokens=n_prompt,
            cached_tokens=sum(out.cached_by_tier.values()),
            cached_tokens_by_tier=dict(out.cached_by_tier),
            approx_tokens=out.approx_tokens,
            recomputed_tokens=out.recomputed_tokens,
            stored_tokens=out.stored_tokens,
        )
        text = TextStream(self.tokenizer, params.stop)
        ttft = None
        finish: FinishReason = "length"
        for token in decode(self.assembler, out.cache, out.logits, n_prompt, params, self.eos_ids, max_new):
            if ttft is None:
                ttft = time.perf_counter() - t0
            delta = text.push(token)
            if token in self.eos_ids or text.stopped:
                finish = "stop"
                break
            if delta:
                yield StreamChunk(delta)
        tail = text.finish()
        usage.completion_tokens = len(text.ids)
        result = GenerationResult(
            text=text.text,
            token_ids=list(text.ids),
            finish_reason=finish,
            usage=usage,
            timings=Timings(ttft_s=ttft or 0.0, total_s=time.perf_counter() - t0, prefill_s=prefill_s,
                            select_s=out.select_s),
            first_logits=out.logits.clone() if return_logits else None,
            reuse_note=blocker or (self.reuse_note if reuse else None),
        )
        return StreamChunk(tail, result)
