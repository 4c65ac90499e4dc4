"""KVBoostEngine: the Python API that ties canonicalizer, store, assembler and runner together."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import torch

from .assembler import Assembler
from .canonical import Canonicalizer, CanonicalPrompt, PromptInput, Segment, normalize_text
from .config import EngineConfig, ReuseMode
from .errors import ContextWindowExceededError, UnsupportedModelError
from .fingerprint import model_fingerprint, tokenizer_fingerprint
from .keys import Chunk, make_namespace, plan_chunks
from .models import load_model
from .runner import decode, prefill
from .sampling import SamplingParams
from .registry import DocumentRegistry
from .store import DiskStore, KVStore, MemoryStore, TieredStore
from .textstream import TextStream

logger = logging.getLogger(__name__)

FinishReason = Literal["stop", "length"]


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


class StreamChunk(NamedTuple):
    """One streaming step: a text delta; the last one also carries the full result."""

    text: str
    result: GenerationResult | None = None


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

    @property
    def tokens_per_s(self) -> float:
        return self.computed_tokens / self.seconds if self.seconds > 0 else 0.0


class KVBoostEngine:
    """Generate with a HF causal LM, reusing the KV of repeated context chunk by chunk.

    Safe to call from several threads (requests run one at a time).

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
        self.assembler = Assembler(model)
        self.namespace = make_namespace(
            model=model_fingerprint(model),
            tokenizer=tokenizer_fingerprint(tokenizer),
            dtype=str(next(model.parameters()).dtype),
            device=self.assembler.device.type,
            attention=self.assembler.attention_kernel,
        )
        if store is not None and store_dir is not None:
            raise ValueError("pass either store or store_dir, not both")
        self.store: KVStore = store if store is not None else self._open_store(store_dir)
        self.registry = DocumentRegistry(Path(store_dir).expanduser() / "documents.sqlite" if store_dir else None)
        finder = self.registry.find if self.config.find_documents else None
        self.canonicalizer = Canonicalizer(tokenizer, find_documents=finder)
        self.eos_ids = self._eos_ids()
        self._lock = threading.Lock()  # one prefill at a time (decode steps lock in the assembler)

    def _open_store(self, store_dir: str | Path | None) -> KVStore:
        memory = MemoryStore(self.config.max_memory_bytes)
        if store_dir is None:
            return memory
        disk = DiskStore(store_dir, self.namespace, max_bytes=self.config.max_disk_bytes)
        return TieredStore([memory, disk])

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        *,
        store_dir: str | None = None,
        dtype: str | torch.dtype = "bfloat16",
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
    ) -> GenerationResult:
        """Generate a completion. ``prompt``: a string, a list of strings/Segments, or chat messages."""
        result = None
        for chunk in self.stream(
            prompt,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=stop,
            return_logits=return_logits,
            add_generation_prompt=add_generation_prompt,
            reuse=reuse,
        ):
            result = chunk.result
        assert result is not None
        return result

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
    ) -> Iterator[StreamChunk]:
        """Like :meth:`generate`, yielding text deltas; the last item carries the result.

        ``reuse`` overrides the engine's mode for this request (``"off"``: the uncached path).
        """
        t0 = time.perf_counter()
        params = SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=SamplingParams.normalize_stop(stop),
        )
        canonical = self.canonicalize(prompt, add_generation_prompt=add_generation_prompt)
        self._check_window(len(canonical), 1)
        return self._run(canonical, params, return_logits, t0, reuse or self.config.reuse)

    def warm(self, prompt: PromptInput, *, add_generation_prompt: bool = False) -> WarmReport:
        """Prefill a prompt (a system prompt, shared context) into the store without generating."""
        t0 = time.perf_counter()
        canonical = self.canonicalize(prompt, add_generation_prompt=add_generation_prompt)
        self._check_window(len(canonical), 0)
        with self._lock:
            chunks = self._chunks(canonical)
            out = prefill(self.assembler, canonical.token_ids, chunks, store=self.store, capacity=len(canonical))
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

        ``prefix`` is the rendered prompt text that precedes the documents in your
        template (or its segments, as the framework integrations pass it). A later
        prompt ``prefix + document + ...`` is split at the registered document and
        reuses its KV. Documents already stored are skipped, so an interrupted run
        can simply be started again. ``progress`` is called with the token count of
        each finished document.
        """
        head = [Segment(prefix, "text")] if isinstance(prefix, str) else list(prefix)
        t0 = time.perf_counter()
        report = PrewarmReport(documents=0, skipped=0, tokens=0, computed_tokens=0, seconds=0.0)
        with self._lock:
            for doc in documents:
                doc = normalize_text(doc)
                if not doc:
                    continue
                canonical = self.canonicalize([*head, Segment(doc, "document")], add_generation_prompt=False)
                self._check_window(len(canonical), 0)
                chunks = self._chunks(canonical)
                report.documents += 1
                report.tokens += len(canonical)
                if all(self.store.contains(c.key) for c in chunks):
                    report.skipped += 1
                else:
                    out = prefill(self.assembler, canonical.token_ids, chunks, store=self.store, capacity=len(canonical))
                    report.computed_tokens += out.recomputed_tokens
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
        """Per-tier counters (hits, misses, puts, evictions, entries, bytes, pinned, hit rate)."""
        out: dict[str, Any] = {name: vars(s) | {"hit_rate": s.hit_rate} for name, s in self.store.stats().items()}
        out["documents"] = len(self.registry)
        return out

    def close(self) -> None:
        """Flush pending disk writes and release the store."""
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

    def _check_window(self, prompt_tokens: int, new_tokens: int) -> None:
        window = self.assembler.context_window
        if window is not None and prompt_tokens + max(new_tokens, 1) > window:
            msg = (
                f"the prompt has {prompt_tokens} tokens and the model's context window is {window}; "
                "shorten the prompt (fewer or shorter documents, less history) so at least one token can be generated"
            )
            raise ContextWindowExceededError(msg)

    def _chunks(self, canonical: CanonicalPrompt) -> list[Chunk]:
        return plan_chunks(canonical, self.config.chunk_size, self.namespace)

    def _run(
        self, canonical: CanonicalPrompt, params: SamplingParams, return_logits: bool, t0: float, mode: ReuseMode
    ) -> Iterator[StreamChunk]:
        n_prompt = len(canonical)
        window = self.assembler.context_window or (n_prompt + params.max_new_tokens)
        max_new = min(params.max_new_tokens, window - n_prompt)
        blocker = self.assembler.exact_reuse_blocker(n_prompt + max_new)
        reuse = mode == "exact" and blocker is None
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
            out = prefill(
                self.assembler,
                ids,
                chunks,
                store=self.store if reuse else None,
                capacity=n_prompt + max_new,
                store_last_logits=self.config.store_last_logits,
                reusable=blocker is None,
            )
            prefill_s = time.perf_counter() - t_prefill
        usage = Usage(
            prompt_tokens=n_prompt,
            cached_tokens=sum(out.cached_by_tier.values()),
            cached_tokens_by_tier=dict(out.cached_by_tier),
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
            timings=Timings(ttft_s=ttft or 0.0, total_s=time.perf_counter() - t0, prefill_s=prefill_s),
            first_logits=out.logits.clone() if return_logits else None,
            reuse_note=blocker,
        )
        yield StreamChunk(tail, result)
