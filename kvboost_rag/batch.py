"""Batched generation: shared prefixes come from the store, last chunks and decoding run as one batch.

Every request's prompt except its last chunk is prefilled over the canonical
schedule, one request after another, through the store: a prefix that several
requests share is computed by the first and read by the others, and everything
stored keeps the exact bits of the unbatched path. The last chunks (typically
the distinct questions) then run as one padded forward, and decoding advances
all rows together, each with its own sampling and stopping; a finished row
leaves the batch.

Batch cache layout (slots; each row's positions are its own):

    [ prefix (row i: P_i tokens, zeros to P) | suffix (row i: right-aligned, s_i tokens) | decoded ]
      0 ............................... P      P ............................... P + S     P + S + t

A prefix that every row shares (the same leading chunks) is kept once, outside
these slots, and every row attends to it first (``chunk_attention.SHARED_PREFIX_NAME``).

The pads are masked out, and a pad query attends to itself only so that its
(unused) output stays finite.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .assembler import Assembler
from .request import Request
from .runner import PrefillOutcome
from .sampling import select_token
from .textstream import TextStream


@dataclass
class BatchRow:
    """One request as the batch runs it."""

    token_ids: list[int]
    """All canonical prompt ids."""
    prefix: PrefillOutcome | None
    """Cache of every chunk but the last (None: the prompt is one chunk)."""
    prefix_tokens: int
    request: Request
    max_new_tokens: int
    cancelled: threading.Event | None = None
    on_delta: Callable[[str], None] | None = None
    """Called with each piece of new text as the row's tokens come out (streams)."""
    on_finish: Callable[[RowOutput], None] | None = None
    """Called with the row's output as it leaves the batch (its result need not wait for the others)."""


@dataclass
class RowOutput:
    text: str
    token_ids: list[int]
    finish_reason: str
    """``stop``, ``length``, ``cancelled``, or ``error``."""
    first_logits: torch.Tensor
    """float32 ``[vocab]`` of the first generated position."""
    first_token_at: float
    """``time.perf_counter()`` when the row's first token was chosen."""
    error: Exception | None = None
    """What ended the row, when ``finish_reason`` is ``error``."""


def run_batch(
    assembler: Assembler,
    tokenizer: object,
    rows: Sequence[BatchRow],
    eos_ids: frozenset[int],
    prefill_lock: threading.Lock,
    shared_tokens: int = 0,
) -> list[RowOutput]:
    """Prefill the rows' last chunks as one batch over their prefixes, then decode all rows together.

    ``shared_tokens``: how many leading prompt tokens every row's prefix holds identically (whole
    chunks with the same keys); where the assembler can, they are kept once for all rows.
    ``prefill_lock`` is held for the batched prefill only, as for a lone request.
    """
    device = assembler.device
    count = len(rows)
    skip = shared_tokens if count > 1 and assembler.shares_prefixes else 0
    first_prefix = rows[0].prefix
    shared = assembler.shared_prefix(first_prefix.cache, skip) if skip and first_prefix is not None else None
    width = max(r.prefix_tokens for r in rows) - skip  # P: each row's own prefix slots
    suffixes = [r.token_ids[r.prefix_tokens :] for r in rows]
    span = max(len(s) for s in suffixes)  # S
    capacity = width + span + max(r.max_new_tokens for r in rows)
    prefixes = [(r.prefix.cache if r.prefix else None, r.prefix_tokens) for r in rows]
    cache = assembler.batch_cache(prefixes, capacity, skip)

    # valid[b, slot]: row b may attend to this slot (prefix and suffix pads are False)
    valid = torch.zeros(count, width + span, dtype=torch.bool, device=device)
    ids = torch.zeros(count, span, dtype=torch.long, device=device)
    positions = torch.zeros(count, span, dtype=torch.long, device=device)
    for b, (row, suffix) in enumerate(zip(rows, suffixes, strict=True)):
        valid[b, : row.prefix_tokens - skip] = True
        pad = span - len(suffix)
        valid[b, width + pad :] = True
        ids[b, pad:] = torch.tensor(suffix, dtype=torch.long)
        positions[b, pad:] = torch.arange(row.prefix_tokens, len(row.token_ids))
    slots = torch.arange(width + span, device=device)
    query_slots = slots[width:].unsqueeze(1)  # [S, 1]
    causal = slots.unsqueeze(0) <= query_slots  # [S, P + S]
    own = slots.unsqueeze(0) == query_slots
    mask = (valid.unsqueeze(1) & causal) | own  # [rows, S, P + S]
    with prefill_lock:
        logits = assembler.forward_rows(cache, ids, positions, mask.unsqueeze(1), shared)  # [rows, vocab]

    first_logits = logits.clone()
    streams = [TextStream(tokenizer, r.request.stop_strings) for r in rows]
    generators = [r.request.generator(logits.device) for r in rows]
    outputs: list[RowOutput | None] = [None] * count
    first_token_at = [0.0] * count

    def leave(i: int, reason: str, error: Exception | None = None) -> None:
        stream = streams[i]
        out = RowOutput(stream.text, list(stream.ids), reason, first_logits[i], first_token_at[i], error)
        outputs[i] = out
        on_finish = rows[i].on_finish
        if on_finish is not None:
            on_finish(out)

    next_position = torch.tensor([len(r.token_ids) for r in rows], device=device)
    active = list(range(count))  # request index of each live batch row
    step = 0
    while True:
        chosen, keep = [], []
        for b, i in enumerate(active):
            row, stream = rows[i], streams[i]
            if row.cancelled is not None and row.cancelled.is_set():
                leave(i, "cancelled")
                continue
            try:
                token = select_token(logits[b], row.request, generators[i])
            except Exception as e:  # this row alone fails; the others go on
                leave(i, "error", e)
                continue
            if step == 0:
                first_token_at[i] = time.perf_counter()
            delta = stream.push(token)
            ends = token in eos_ids or stream.stopped or step + 1 >= row.max_new_tokens
            if ends:
                delta += stream.finish()
            if delta and row.on_delta is not None:
                row.on_delta(delta)
            if ends:
                leave(i, "length" if token not in eos_ids and not stream.stopped else "stop")
                continue
            chosen.append(token)
            keep.append(b)
        if not keep:
            break
        if len(keep) < len(active):
            index = torch.tensor(keep, device=device)
            assembler.keep_rows(cache, index)
            valid, next_position = valid.index_select(0, index), next_position.index_select(0, index)
            active = [active[b] for b in keep]
        valid = torch.cat([valid, valid.new_ones(len(active), 1)], dim=1)
        tokens = torch.tensor(chosen, device=device).unsqueeze(1)
        logits = assembler.forward_rows(
            cache, tokens, next_position.unsqueeze(1), valid[:, None, None, :], shared
        )
        next_position += 1
        step += 1
    return [o for o in outputs if o is not None]
