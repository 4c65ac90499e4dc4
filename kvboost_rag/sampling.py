"""Next-token selection under a request's sampling settings."""

from __future__ import annotations

import torch

from .request import Request


def select_token(logits: torch.Tensor, request: Request, generator: torch.Generator | None) -> int:
    """Pick the next token from float32 logits ``[vocab]`` (greedy when ``request.temperature == 0``)."""
    if request.temperature == 0:
        return int(torch.argmax(logits))
    temperature = max(request.temperature, torch.finfo(logits.dtype).tiny)  # below it, the tensor holds 0
    scores = logits / temperature
    if not torch.isfinite(scores).all():
        # A tiny temperature overflows; shifted so the top score is 0, the others fall to -inf at worst
        # (the same softmax, which is shift-invariant), and sampling stays well-defined.
        scores = (logits - logits.max()) / temperature
    if request.top_k:
        kth = torch.topk(scores, min(request.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if request.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(-1)
        # drop a token when the tokens before it already reach top_p (the first one is always kept)
        drop_sorted = (cumulative - torch.softmax(sorted_scores, dim=-1)) >= request.top_p
        drop_sorted[0] = False  # rounding can leave the first above a tiny top_p; it always stays
        scores = scores.masked_fill(
            torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), float("-inf")
        )
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
