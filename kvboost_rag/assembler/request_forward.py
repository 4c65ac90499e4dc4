"""The forward of one request's next tokens at consecutive positions over its cache: prefill chunks,
decode steps, verification of drafted tokens.

In invariant mode, over a buffered cache, a call is split-invariant: it runs a multiple of
``ROW_MULTIPLE`` rows (the tokens, then filler rows whose KV is dropped after the call) and its LM
head multiplies a multiple of ``ROW_MULTIPLE`` rows too, so each token's KV and logits are the
same bits however the prompt is split into calls. It runs through the lean forward where the model
takes it, else through the model's modules with the split-invariant attention switched in.

Layouts: ids and positions ``[1, rows]`` (``rows`` = tokens, rounded up to ``ROW_MULTIPLE`` when
split-invariant); logits float32 ``[logit_rows, vocab]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext

import torch
from transformers.cache_utils import Cache

from .. import block_attention
from .buffered_cache import BufferedCache
from .model_call import ModelCall


@torch.inference_mode()
def forward_tail(
    call: ModelCall,
    cache: Cache,
    token_ids: Sequence[int],
    start: int,
    logit_rows: int,
    *,
    invariant: bool,
    exact_rows: bool,
) -> torch.Tensor | None:
    """Run ``token_ids`` at positions ``start..`` over ``cache``; float32 logits ``[logit_rows, vocab]``
    of the last ``logit_rows`` tokens (None for 0). ``invariant``: the assembler's mode;
    ``exact_rows=False`` runs a one-row decode step as it is, not split-invariantly."""
    n = len(token_ids)
    split_invariant = invariant and exact_rows and isinstance(cache, BufferedCache)
    rows = block_attention.round_up(n, block_attention.ROW_MULTIPLE) if split_invariant else n
    device = call.device
    ids = torch.tensor([[*token_ids, *[token_ids[-1]] * (rows - n)]], dtype=torch.long, device=device)
    positions = torch.arange(start, start + rows, device=device).unsqueeze(0)
    keep: int | torch.Tensor | None = None
    if logit_rows and split_invariant:
        # The LM head multiplies a multiple of ROW_MULTIPLE rows (the last wanted one repeated),
        # so its kernel, and each row's bits, are the same whatever the call and however many
        # rows it wants: a prefill's last logits, a decode step's, a verified draft's.
        wanted = list(range(n - logit_rows, n))
        wanted += [n - 1] * (block_attention.round_up(logit_rows, block_attention.ROW_MULTIPLE) - logit_rows)
        keep = torch.tensor(wanted, device=device)
    elif logit_rows:
        keep = logit_rows
    out: torch.Tensor | None = None
    with call.lock:
        lean = call.lean_for(cache) if split_invariant else None
        if lean is not None:
            assert isinstance(cache, BufferedCache)  # lean_for checked
            assert keep is None or isinstance(keep, torch.Tensor)
            with call.attention.invariant_queries(cache, start, rows, real=n):
                out = lean.forward(cache, ids, positions, block_attention.block_causal_attention, keep)
        else:
            inputs = call.inputs(ids, positions, cache)
            head: AbstractContextManager[None] = (
                call.linears.lm_head() if n == 1 and not exact_rows and keep is not None else nullcontext()
            )
            with call.attention.for_call(cache, start, rows, n, split_invariant=split_invariant), head:
                if keep is None:
                    call.model.base_model(**inputs)
                else:
                    out = call.model(**inputs, logits_to_keep=keep).logits[0].float()
    if rows != n:
        assert isinstance(cache, BufferedCache)  # padded rows only in invariant mode, over our caches
        cache.truncate(start + n)
    return out[:logit_rows] if out is not None else None
