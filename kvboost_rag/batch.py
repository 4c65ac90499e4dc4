"""Batched generation: rows decode together, and new rows join between decode steps.

Every request's prompt except its last chunk is prefilled over the canonical
schedule, one request after another, through the store: a prefix that several
requests share is computed by the first and read by the others, and everything
stored keeps the exact bits of the unbatched path. The last chunks of the rows
admitted together then run as one padded forward (a row that had to compute
part of its prompt anyway brings it whole, with its logits), and decoding
advances all running rows together, each with its own sampling and stopping.
A finished row leaves at once; rows admitted later
(:meth:`RunningBatch.admit` between two :meth:`RunningBatch.step` calls) join
the next step.

Batch cache layout (slots; each row's positions are its own):

    [ prefix (row i: P_i tokens, zeros to P) | suffix (row i: right-aligned, s_i tokens) | decoded ]
      0 ............................... P      P ............................... P + S     P + S + t

Rows admitted later bring a cache of that layout of their own; it is laid beside the running
rows', the shorter of the two padded with masked zero slots, so that every row's next token
again goes to one common slot.

A prefix that every row shares (the same leading chunks) is kept once, outside
these slots, and every row attends to it first (``chunk_attention.SHARED_PREFIX_NAME``).

The pads are masked out, and a pad query attends to itself only so that its
(unused) output stays finite.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache

from . import block_attention
from .assembler import Assembler, batch_rows
from .assembler.buffered_cache import BufferedCache, buffered_layers
from .decoding import DecodeStepper, SpeculationStats
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
    """Cache of the first ``prefix_tokens`` prompt tokens: every chunk but the last (None: the prompt
    is one chunk), or the whole prompt with its last logits (the row runs no prefill in the batch)."""
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
    speculation: SpeculationStats | None = None
    """Drafts of a row that decoded alone for a while (None: it decoded in a batch only)."""
    exact_cache: Cache | None = None
    """The row's cache when its KV has a prefill's bits (a row that decoded alone with the
    split-invariant forward): ``cache_ids`` are its tokens."""
    cache_ids: list[int] = field(default_factory=list)


@dataclass
class _Running:
    """A row between its admission and its end."""

    row: BatchRow
    stream: TextStream
    generator: torch.Generator | None
    first_logits: torch.Tensor
    emitted: int = 0
    first_token_at: float = 0.0
    speculation: SpeculationStats | None = None
    """Its drafts while it decoded alone (the adopted row)."""


class RunningBatch:
    """Rows that decode together; :meth:`admit` adds rows, :meth:`step` advances every row by a token.

    ``shared_tokens``: how many leading prompt tokens every row's prefix holds identically (whole
    chunks with the same keys), this batch's rows and those admitted later alike; where the
    assembler can, they are kept once for all rows. ``prefill_lock`` is held for each admission's
    batched prefill only, as for a lone request.
    """

    def __init__(
        self,
        assembler: Assembler,
        tokenizer: object,
        eos_ids: frozenset[int],
        prefill_lock: threading.Lock,
        shared_tokens: int = 0,
        *,
        max_draft_tokens: int = 0,
    ) -> None:
        self._assembler = assembler
        self._max_draft_tokens = max_draft_tokens
        self._stepper: DecodeStepper | None = None
        """Decodes the lone adopted row (drafting ahead), until others are admitted."""
        self._tokenizer = tokenizer
        self._eos_ids = eos_ids
        self._prefill_lock = prefill_lock
        self.shared_tokens = shared_tokens if assembler.shares_prefixes else 0
        """Leading prompt tokens kept once for all rows (0: none)."""
        self._shared: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._running: list[_Running] = []  # in batch row order
        self._cache: Cache | None = None
        self._valid = torch.zeros(0, 0, dtype=torch.bool)  # [rows, slots]: the row may attend to the slot
        self._next_position = torch.zeros(0, dtype=torch.long)  # [rows]
        self._logits = torch.zeros(0)  # [rows, vocab]: what each row's next token is chosen from

    def __len__(self) -> int:
        return len(self._running)

    @property
    def lone(self) -> bool:
        """Whether one adopted row decodes on the exact single-request path (no row was admitted yet)."""
        return self._stepper is not None

    def adopt(self, row: BatchRow, keep_from: int | None = None) -> None:
        """Start with one row whose whole prompt is prefilled (``row.prefix``, with its last logits):
        while it runs alone it decodes on the exact single-request path, one token per forward,
        bitwise as a lone request; once others are admitted it decodes as a row of the batch.
        ``keep_from``: as for :class:`.DecodeStepper` (the row's reply stored from its cache)."""
        prefix = row.prefix
        if (
            self._running
            or prefix is None
            or prefix.logits is None
            or row.prefix_tokens != len(row.token_ids)
        ):
            raise ValueError("adopt takes a first row whose whole prompt is prefilled, with its logits")
        cache, device = prefix.cache, self._assembler.device
        for layer in buffered_layers(cache):
            layer.stop = None  # the row's cancellation ends the row, not a batch forward
        first = prefix.logits
        self._cache, self.shared_tokens = cache, 0
        self._stepper = DecodeStepper(
            self._assembler,
            cache,
            row.token_ids,
            end=len(row.token_ids) + row.max_new_tokens,
            max_draft_tokens=self._max_draft_tokens,
            keep_from=keep_from,
        )
        self._running = [
            _Running(
                row,
                TextStream(self._tokenizer, row.request.stop_strings),
                row.request.generator(device),
                first,
                speculation=self._stepper.stats,
            )
        ]
        self._valid = torch.ones(1, len(row.token_ids), dtype=torch.bool, device=device)
        self._next_position = torch.tensor([len(row.token_ids)], device=device)
        self._logits = first.unsqueeze(0)

    def admit(self, rows: Sequence[BatchRow]) -> None:
        """Prefill the rows' last chunks as one batch over their prefixes; they take part from the
        next :meth:`step` on. Each row's prefix must hold the batch's ``shared_tokens``."""
        if not rows:
            return
        self._end_lone()
        assembler, device, skip = self._assembler, self._assembler.device, self.shared_tokens
        if skip and self._shared is None:
            first = rows[0].prefix
            assert first is not None  # shared tokens lie in a prefix
            self._shared = batch_rows.shared_prefix(first.cache, skip)
        width = max(r.prefix_tokens for r in rows) - skip  # P: each row's own prefix slots
        suffixes = [r.token_ids[r.prefix_tokens :] for r in rows]
        span = max(len(s) for s in suffixes)  # S
        capacity = width + span + max(r.max_new_tokens for r in rows)
        prefixes = [(r.prefix.cache if r.prefix else None, r.prefix_tokens) for r in rows]
        cache = batch_rows.batch_cache(assembler.num_layers, prefixes, capacity, skip)

        valid = torch.zeros(len(rows), width + span, dtype=torch.bool, device=device)
        ids = torch.zeros(len(rows), span, dtype=torch.long, device=device)
        positions = torch.zeros(len(rows), span, dtype=torch.long, device=device)
        for b, (row, suffix) in enumerate(zip(rows, suffixes, strict=True)):
            if row.prefix_tokens < skip:
                msg = f"a row's prefix holds {row.prefix_tokens} tokens, fewer than the {skip} shared ones"
                raise ValueError(msg)
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
        if span:
            with self._prefill_lock:
                logits = assembler.forward_rows(
                    cache, ids, positions, mask.unsqueeze(1), self._shared, _slot_positions(valid, skip)
                )
        else:  # every row's whole prompt is prefilled
            logits = torch.zeros(len(rows), 0, device=device)
        firsts = [
            r.prefix.logits if not suffix and r.prefix is not None and r.prefix.logits is not None else out
            for r, suffix, out in zip(rows, suffixes, logits.clone(), strict=True)
        ]
        if any(f.numel() == 0 for f in firsts):
            raise ValueError("a row whose whole prompt is prefilled brings its last logits")
        logits = torch.stack(firsts)
        joined = [
            _Running(
                r, TextStream(self._tokenizer, r.request.stop_strings), r.request.generator(device), first
            )
            for r, first in zip(rows, firsts, strict=True)
        ]
        next_position = torch.tensor([len(r.token_ids) for r in rows], device=device)
        if self._cache is None:
            self._cache, self._valid, self._next_position, self._logits = cache, valid, next_position, logits
        else:  # beside the running rows: both padded to the longer slot count
            slots_now = max(self._valid.shape[1], valid.shape[1])
            # room for the tokens to come, up to one key block: a join copies every row's buffers,
            # so a large max_new_tokens must not make it copy (and zero) more; past it they grow
            left = [run.row.max_new_tokens - run.emitted for run in self._running]
            left += [r.max_new_tokens for r in rows]
            batch_rows.join_rows(self._cache, cache, slots_now + min(max(left), block_attention.KEY_BLOCK))
            self._valid = torch.cat([_pad_slots(self._valid, slots_now), _pad_slots(valid, slots_now)])
            self._next_position = torch.cat([self._next_position, next_position])
            self._logits = torch.cat([self._logits, logits])
        self._running.extend(joined)

    def share(self, tokens: int) -> None:
        """Keep the first ``tokens`` slots of the lone adopted row once, as the prefix that rows admitted
        from now on share (``shared_tokens`` becomes ``tokens``); the row decodes as a batch row from
        the next step. No effect where the assembler cannot share prefixes."""
        if self._stepper is None:
            raise ValueError("share takes the lone adopted row's prefix, before any row is admitted")
        if not self._assembler.shares_prefixes or tokens == 0:
            return
        self._end_lone()
        assert self._cache is not None  # the adopted row's
        self._shared = batch_rows.share_prefix(self._cache, tokens)
        self._valid = self._valid[:, tokens:]  # [1, own slots]
        self.shared_tokens = tokens

    def unshare(self) -> None:
        """Give every running row its own copy of the shared prefix, so that rows without it can join
        (``shared_tokens`` becomes 0). Decoding goes on unchanged, reading the prefix per row."""
        if self._shared is not None and self._cache is not None:
            batch_rows.unshare_prefix(self._cache, self._shared)
            prefix = self._valid.new_ones(self._valid.shape[0], self.shared_tokens)
            self._valid = torch.cat([prefix, self._valid], dim=1)  # [rows, shared + own slots]
        self._shared, self.shared_tokens = None, 0

    def step(self) -> bool:
        """Choose every row's next token, let finished rows leave, and run one decode forward over the
        rest; False once no row is left."""
        chosen: list[int] = []
        keep: list[int] = []
        for b, run in enumerate(self._running):
            row, stream = run.row, run.stream
            if row.cancelled is not None and row.cancelled.is_set():
                self._leave(run, "cancelled")
                continue
            try:
                token = select_token(self._logits[b], row.request, run.generator)
            except Exception as e:  # this row alone fails; the others go on
                self._leave(run, "error", e)
                continue
            if run.emitted == 0:
                run.first_token_at = time.perf_counter()
            run.emitted += 1
            delta = stream.push(token)
            ends = token in self._eos_ids or stream.stopped or run.emitted >= row.max_new_tokens
            if ends:
                delta += stream.finish()
            if delta and row.on_delta is not None:
                row.on_delta(delta)
            if ends:
                self._leave(run, "length" if token not in self._eos_ids and not stream.stopped else "stop")
                continue
            chosen.append(token)
            keep.append(b)
        if not keep:
            self._running, self._cache = [], None  # the buffers go now, not with the batch object
            return False
        assert self._cache is not None  # rows are running
        if len(keep) < len(self._running):
            index = torch.tensor(keep, device=self._valid.device)
            batch_rows.keep_rows(self._cache, index)
            self._valid = self._valid.index_select(0, index)
            self._next_position = self._next_position.index_select(0, index)
            self._running = [self._running[b] for b in keep]
        self._valid = torch.cat([self._valid, self._valid.new_ones(len(keep), 1)], dim=1)
        if self._stepper is not None:  # as a lone request decodes
            self._logits = self._stepper.next_logits(chosen[0]).unsqueeze(0)
        else:
            tokens = torch.tensor(chosen, device=self._valid.device).unsqueeze(1)
            self._logits = self._assembler.forward_rows(
                self._cache,
                tokens,
                self._next_position.unsqueeze(1),
                self._valid[:, None, None, :],
                self._shared,
                _slot_positions(self._valid, self.shared_tokens),
            )
        self._next_position += 1
        return True

    def _end_lone(self) -> None:
        """The lone row decodes as a batch row from now on: drafts not yet confirmed leave its cache,
        and positions its sliding-window layers dropped come back as zeros (batches mask them by
        position: they lie behind the window)."""
        if self._stepper is not None:
            self._stepper.settle()
            self._stepper = None
            if isinstance(self._cache, BufferedCache):
                self._cache.restore_dropped()

    def _leave(self, run: _Running, reason: str, error: Exception | None = None) -> None:
        stream, stepper = run.stream, self._stepper
        out = RowOutput(stream.text, list(stream.ids), reason, run.first_logits, run.first_token_at, error)
        out.speculation = run.speculation
        if stepper is not None:  # the lone row: its cache goes with its output
            stepper.settle()
            if stepper.exact:
                fed = stepper.position - len(run.row.token_ids)
                out.exact_cache, out.cache_ids = self._cache, [*run.row.token_ids, *stream.ids[:fed]]
        if run.row.on_finish is not None:
            run.row.on_finish(out)


def _slot_positions(valid: torch.Tensor, shared_tokens: int) -> torch.Tensor:
    """The position of the token in each of the rows' own slots ``[rows, slots]``: the valid slots of a
    row hold its tokens in order after the shared ones (a masked slot gets its predecessor's)."""
    return shared_tokens + valid.cumsum(dim=1) - 1


def _pad_slots(valid: torch.Tensor, slots: int) -> torch.Tensor:
    """``valid`` ``[rows, s]`` widened to ``[rows, slots]`` with masked (False) slots."""
    return torch.cat([valid, valid.new_zeros(valid.shape[0], slots - valid.shape[1])], dim=1)
