"""An engine's working parts built from a model: the assembler and its prefill schedule (probed),
the store and document registry, all in one :class:`~kvboost_rag.core.EngineCore`."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

from .assembler import Assembler
from .canonical import Canonicalizer
from .config import EngineConfig
from .core import EngineCore, eos_ids, namespace_of
from .held_context import HeldContexts
from .invariance import InvarianceReport, choose_schedule, schedule_note
from .registry import REGISTRY_DB, DocumentRegistry
from .store import KVStore
from .store.factory import open_store


class BuiltCore(NamedTuple):
    core: EngineCore
    invariance: InvarianceReport | None
    """The split-invariance probe's report (None: ``prefill_schedule="canonical"``, nothing probed)."""


def build_core(
    model: Any, tokenizer: Any, config: EngineConfig, *, store: KVStore | None, store_dir: str | Path | None
) -> BuiltCore:
    """The parts that requests share; ``store`` (else one opened by ``config`` in ``store_dir``) is
    closed again when the registry cannot be opened."""
    assembler = Assembler(model, transposed_batch_weights=config.batch_transposed_weights)
    namespace = partial(namespace_of, assembler, tokenizer)
    invariance = choose_schedule(assembler, config.prefill_schedule, namespace)
    chunk_size = config.chunk_tokens(invariant=assembler.invariant)
    name = namespace()
    store = store if store is not None else open_store(config, name, store_dir)
    try:
        registry = DocumentRegistry(
            Path(store_dir).expanduser() / REGISTRY_DB if store_dir else None,
            shared=store.shared_records(),  # a Redis tier shares documents between processes
            file_mode=config.store_file_mode,
        )
    except BaseException:
        store.close()
        raise
    core = EngineCore(
        config,
        assembler,
        Canonicalizer(tokenizer),
        store,
        registry,
        name,
        chunk_size,
        schedule_note(invariance, assembler.invariant, chunk_size),
        eos_ids(model, tokenizer),
        held=HeldContexts(config.held_context_tokens),
    )
    return BuiltCore(core, invariance)
