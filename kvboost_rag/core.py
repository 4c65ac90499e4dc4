"""The engine's working parts, and the small steps every request takes with them.

:class:`EngineCore` is what generation and warm-up share: the model behind its
assembler, the canonicalizer, the store and document registry, the namespace
that keys them, and the lock that lets one prefill run at a time.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .assembler import Assembler
from .blend import BlendSettings
from .canonical import Canonicalizer, CanonicalPrompt, PromptInput
from .config import EngineConfig
from .errors import ContextWindowExceededError
from .fingerprint import model_fingerprint, tokenizer_fingerprint
from .held_context import HeldContexts
from .keys import Chunk, make_namespace, plan_chunks, salted
from .prefix_index import PrefixIndex
from .registry import DocumentRegistry
from .rope import RopeShifter
from .runner import PrefillOutcome, prefill
from .store import KVStore


@dataclass
class EngineCore:
    """Shared by :mod:`.generation` and :mod:`.warming`; built by :class:`~kvboost_rag.KVBoostEngine`."""

    config: EngineConfig
    assembler: Assembler
    canonicalizer: Canonicalizer
    store: KVStore
    registry: DocumentRegistry
    namespace: str
    chunk_size: int
    reuse_note: str | None
    """Why reuse is coarser than the split-invariant forward allows, or None."""
    eos_ids: frozenset[int]
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Held by a prefill (one at a time); decode steps lock in the assembler."""
    prefix_index: PrefixIndex = field(default_factory=PrefixIndex)
    """The stored chunks this engine has seen, by parent key: prefills reuse a missing chunk's
    leading tokens from them."""
    held: HeldContexts = field(default_factory=lambda: HeldContexts(0))
    """The caches of the last exact requests, for requests that continue them."""
    _shifter: RopeShifter | None = None

    @property
    def tokenizer(self) -> Any:
        return self.canonicalizer.tokenizer

    def canonicalize(self, prompt: PromptInput, *, add_generation_prompt: bool = True) -> CanonicalPrompt:
        return self.canonicalizer.canonicalize(prompt, add_generation_prompt=add_generation_prompt)

    def chunks(self, canonical: CanonicalPrompt, salt: str | None = None) -> list[Chunk]:
        """The prompt's chunks, keyed under the tenant ``salt`` (None: the shared keys)."""
        return plan_chunks(canonical, self.chunk_size, salted(self.namespace, salt))

    def prefill(self, token_ids: Sequence[int], chunks: Sequence[Chunk], **kwargs: Any) -> PrefillOutcome:
        """:func:`~kvboost_rag.runner.prefill` with the configured forward size and the prefix index."""
        return prefill(
            self.assembler,
            token_ids,
            chunks,
            step_tokens=self.config.max_forward_tokens,
            index=self.prefix_index,
            **kwargs,
        )

    def check_window(self, prompt_tokens: int, new_tokens: int) -> None:
        """Refuse a prompt that leaves no room for ``new_tokens`` (at least one) in the context window."""
        window = self.assembler.context_window
        if window is not None and prompt_tokens + max(new_tokens, 1) > window:
            msg = (
                f"the prompt has {prompt_tokens} tokens and the model's context window is {window}; "
                "shorten the prompt (fewer or shorter documents, less history) "
                "so at least one token can be generated"
            )
            raise ContextWindowExceededError(msg)

    def room_for(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """``max_new_tokens``, capped by what the context window leaves after the prompt."""
        window = self.assembler.context_window or (prompt_tokens + max_new_tokens)
        return min(max_new_tokens, window - prompt_tokens)

    def blend_shifter(self) -> RopeShifter:
        """The RoPE re-rotation of this model; raises UnsupportedModelError where blend cannot be exact."""
        if self._shifter is None:
            layers = self.assembler.num_layers
            if self.config.blend_select_layer >= layers:
                msg = (
                    f"blend_select_layer={self.config.blend_select_layer}, "
                    f"but the model has {layers} layers; "
                    f"pick 0..{layers - 1}"
                )
                raise ValueError(msg)
            self._shifter = RopeShifter(self.assembler.model)
        return self._shifter

    def blend_settings(self, recompute_ratio: float | None) -> BlendSettings:
        c = self.config
        ratio = c.blend_recompute_ratio if recompute_ratio is None else recompute_ratio
        return BlendSettings(ratio, c.blend_boundary_tokens, c.blend_select_layer)


def namespace_of(assembler: Assembler, tokenizer: Any) -> str:
    """The store namespace of the model as ``assembler`` runs it (weights, tokenizer, dtype, kernel)."""
    model = assembler.model
    return make_namespace(
        model=model_fingerprint(model),
        tokenizer=tokenizer_fingerprint(tokenizer),
        dtype=str(next(model.parameters()).dtype),
        device=assembler.device.type,
        attention=assembler.attention_kernel,
    )


def eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """Every end-of-sequence id the model's generation config, config or tokenizer names."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return frozenset(ids)
