"""Load-time probe: does a forward split at arbitrary points give the bits of one forward?

Fine-grained exact reuse relies on it: a stored prefix is reused at any block and
the rest computed in one call, so the KV of token i must not depend on where the
calls were split (see :mod:`kvboost_rag.block_attention`). Whether the platform's
kernels allow that depends on the model's shapes, the dtype, the device and the
BLAS library, so the engine runs this probe once per model fingerprint and
platform and remembers the answer in ``$KVBOOST_RAG_HOME/probes.json``. Where it
fails, the engine falls back to the canonical chunk schedule.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import torch

from .assembler import Assembler
from .block_attention import KEY_BLOCK, round_up
from .config import PrefillSchedule
from .errors import UnsupportedModelError
from .models import kvboost_home

logger = logging.getLogger(__name__)

PROBE_VERSION = 4
"""Bumped whenever the probe or the invariant forward changes, so remembered answers are redone."""

PROBE_TOKENS = KEY_BLOCK + 45
"""Long enough to cross a key block, so partial blocks are exercised."""

DECODE_STEPS = 3
"""Tokens at the end run one a call, as decode steps run them."""


def probe_tokens(window: int | None) -> int:
    """Tokens the probe runs: :data:`PROBE_TOKENS`, or with a sliding window, far enough past it that
    the last key block's queries skip whole blocks behind their window.

    >>> probe_tokens(None), probe_tokens(512), probe_tokens(128)
    (557, 1069, 1069)
    """
    if window is None:
        return PROBE_TOKENS
    return max(PROBE_TOKENS, round_up(window, KEY_BLOCK) + PROBE_TOKENS)


def splits(tokens: int) -> tuple[tuple[int, ...], ...]:
    """Cut points tried against one forward over ``tokens``: decode steps at the end, and calls of odd
    lengths, one of them across a key-block boundary."""
    return (tuple(range(tokens - DECODE_STEPS, tokens)), (3, 290, KEY_BLOCK + 18))


@dataclass(frozen=True)
class InvarianceReport:
    holds: bool
    detail: str
    """What was checked, or what differed."""
    seconds: float = 0.0


@contextmanager
def _invariant(assembler: Assembler) -> Iterator[None]:
    saved, assembler.invariant = assembler.invariant, True
    try:
        yield
    finally:
        assembler.invariant = saved


def _run(assembler: Assembler, ids: list[int], cuts: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """KV of all tokens run in calls cut at ``cuts``, and each call's last logits ``[calls, vocab]``."""
    cache = assembler.new_cache(len(ids))
    logits = []
    for start, end in zip((0, *cuts), (*cuts, len(ids)), strict=True):
        out = assembler.forward(cache, ids[start:end], start)
        assert out is not None
        logits.append(out)
    return assembler.extract(cache, 0, len(ids)), torch.stack(logits)


def _verified(assembler: Assembler, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """KV of all tokens, and the logits of the last ``DECODE_STEPS`` tokens from one call (a
    verification of drafted tokens), after the tokens before them."""
    cache = assembler.new_cache(len(ids))
    head = len(ids) - DECODE_STEPS
    assembler.forward(cache, ids[:head], 0, logits=False)
    logits = assembler.forward_tail(cache, ids[head:], head, DECODE_STEPS)
    assert logits is not None
    return assembler.extract(cache, 0, len(ids)), logits


def check_split_invariance(assembler: Assembler, vocab_size: int, *, seed: int = 0) -> InvarianceReport:
    """Run random tokens as one forward and as split forwards; compare all KV and the last logits bitwise."""
    t0 = time.perf_counter()
    if not assembler.can_run_invariant:
        return InvarianceReport(False, f"no split-invariant attention for device {assembler.device.type}")
    generator = torch.Generator().manual_seed(seed)
    tokens = probe_tokens(assembler.attention_window)
    ids = torch.randint(0, vocab_size, (tokens,), generator=generator).tolist()
    try:
        with _invariant(assembler):
            kv, logits = _run(assembler, ids, ())
            for cuts in splits(tokens):
                kv_split, logits_split = _run(assembler, ids, cuts)
                if not torch.equal(kv, kv_split) or not torch.equal(logits[-1], logits_split[-1]):
                    diff = (kv.float() - kv_split.float()).abs().max().item()
                    detail = (
                        f"a forward split at {list(cuts)} differs from one forward (KV by up to {diff:.1e})"
                    )
                    return InvarianceReport(False, detail, time.perf_counter() - t0)
            kv_verified, logits_verified = _verified(assembler, ids)
            steps = _run(assembler, ids, splits(tokens)[0])[1][-DECODE_STEPS:]
            if not torch.equal(kv, kv_verified) or not torch.equal(steps, logits_verified):
                detail = f"{DECODE_STEPS} tokens verified in one call differ from {DECODE_STEPS} decode steps"
                return InvarianceReport(False, detail, time.perf_counter() - t0)
    except (NotImplementedError, RuntimeError, ValueError) as e:
        return InvarianceReport(False, f"the split-invariant forward failed: {e}", time.perf_counter() - t0)
    detail = (
        f"{tokens} tokens split {len(splits(tokens))} ways and decode steps verified in one call: "
        "KV and logits bitwise equal to one forward"
    )
    return InvarianceReport(True, detail, time.perf_counter() - t0)


def platform_key(namespace: str) -> str:
    """What the probe's answer depends on: the model's namespace, torch, and the CPU's kernels."""
    parts = [
        str(PROBE_VERSION),
        namespace,
        torch.__version__,
        platform.machine(),
        torch.backends.cpu.get_cpu_capability(),
    ]
    if torch.cuda.is_available():
        parts.append(torch.cuda.get_device_name())
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


def remembered_invariance(
    assembler: Assembler, vocab_size: int, namespace: str, memo: Path
) -> InvarianceReport:
    """:func:`check_split_invariance`, run once per platform key and remembered in the ``memo`` JSON file."""
    key = platform_key(namespace)
    try:
        known = json.loads(memo.read_text())
    except (OSError, ValueError):
        known = {}
    if isinstance(known.get(key), dict):
        try:
            return InvarianceReport(**known[key])
        except TypeError:
            pass  # written by another version: probe again
    report = check_split_invariance(assembler, vocab_size)
    logger.info("split-invariance probe (%.2f s): %s", report.seconds, report.detail)
    known[key] = asdict(report)
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=memo.parent, delete=False, suffix=".tmp") as f:
            json.dump(known, f)
        os.replace(f.name, memo)  # atomic: a concurrent reader sees the old or the new file
    except OSError as e:
        logger.warning("could not remember the split-invariance probe in %s (%s)", memo, e)
    return report


def choose_schedule(
    assembler: Assembler, schedule: PrefillSchedule, namespace_of: Callable[[], str], memo: Path | None = None
) -> InvarianceReport | None:
    """Probe (or recall from ``memo``) split invariance and set ``assembler.invariant`` by the answer.

    ``memo`` defaults to ``$KVBOOST_RAG_HOME/probes.json``.

    ``namespace_of()`` names the model as the assembler now runs it (it is called in invariant
    mode, so the name covers the invariant kernel). Returns None when ``schedule`` is
    ``"canonical"`` (nothing probed); raises where ``"invariant"`` was asked for and fails.
    """
    if schedule == "canonical":
        return None
    with _invariant(assembler):
        probe_namespace = namespace_of()
    embeddings = cast(torch.Tensor, assembler.model.get_input_embeddings().weight)
    vocab_size = int(embeddings.shape[0])
    memo = memo if memo is not None else kvboost_home() / "probes.json"
    report = remembered_invariance(assembler, vocab_size, probe_namespace, memo)
    if not report.holds and schedule == "invariant":
        msg = (
            f"prefill_schedule='invariant', but this model, dtype and device fail the split-invariance "
            f"probe ({report.detail}); use prefill_schedule='auto' to fall back to the canonical schedule"
        )
        raise UnsupportedModelError(msg)
    if not report.holds:
        logger.warning("split-invariance probe failed (%s); reuse is chunk-granular", report.detail)
    assembler.invariant = report.holds
    return report


def schedule_note(report: InvarianceReport | None, invariant: bool, chunk_size: int) -> str | None:
    """Why reuse is coarser than the split-invariant forward allows, or None when it is not."""
    if invariant:
        return None
    why = "prefill_schedule='canonical'" if report is None else report.detail
    return f"canonical chunk schedule ({why}): a stored prefix is reused in whole {chunk_size}-token chunks"


def schedule_stats(report: InvarianceReport | None, invariant: bool, chunk_size: int) -> dict[str, Any]:
    """``engine.stats()["reuse"]``: the prefill schedule, chunk size, probe result and note."""
    return {
        "schedule": "invariant" if invariant else "canonical",
        "chunk_tokens": chunk_size,
        "probe": None if report is None else report.detail,
        "note": schedule_note(report, invariant, chunk_size),
    }
