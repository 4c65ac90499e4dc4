"""Row-major linears: on CPU, a batched or decode step's linear layers multiply by transposed weights.

Layout: ``nn.Linear`` keeps its weight ``[out, in]`` and reads it transposed; the copies made here
are ``[in, out]`` (row-major for ``x @ weight_t``), made on first use and kept for the model's life.
Only batched steps and decode steps swap them in, never a prefill, so exact mode's stored KV is
untouched; the swap is held under the forward lock only.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class RowMajorLinears:
    """The transposed weight copies of one model, and the swaps that use them."""

    def __init__(self, model: PreTrainedModel, *, enabled: bool = True) -> None:
        self._model = model
        self._enabled = enabled
        self.transposed: dict[torch.nn.Linear, torch.Tensor] = {}
        """The ``[in, out]`` copies made so far, by module."""

    @contextmanager
    def every_linear(self) -> Iterator[None]:
        """On CPU, run every linear layer of a batched step against a transposed copy of its weight.

        CPU BLAS multiplies a few rows by a ``[out, in]`` weight read transposed several times
        slower than by an ``[in, out]`` one (576x576 fp32, 8 rows: 0.37 ms against 0.05 ms;
        a whole SmolLM2 decode step of 8 rows: 151 ms against 113 ms). The copies cost the
        linear weights' size once.
        """
        with self._swapped(m for m in self._model.modules() if type(m) is torch.nn.Linear):
            yield

    @contextmanager
    def lm_head(self) -> Iterator[None]:
        """On CPU, the LM head of a one-token decode step against a transposed copy of its weight.

        For one row the layers' own products are as fast either way, but the LM head's is not
        (SmolLM2, 576 -> 49,152: 10.9 ms against 5.2 ms, a tenth of the step). Every decode step
        of every path goes through here, so a request's tokens are the same whether its prompt
        was reused or computed.
        """
        head = self._model.get_output_embeddings()
        with self._swapped([head] if type(head) is torch.nn.Linear else []):
            yield

    @contextmanager
    def _swapped(self, modules: Iterable[torch.nn.Linear]) -> Iterator[None]:
        """Inside, ``modules`` multiply by a transposed copy of their weight (made on first use and
        kept; subclasses such as quantized layers are never passed and keep their own forward)."""
        if not self._enabled or next(self._model.parameters()).device.type != "cpu":
            yield
            return
        swapped = list(modules)
        for module in swapped:
            weight_t = self.transposed.get(module)
            if weight_t is None:
                with torch.no_grad():
                    weight_t = self.transposed[module] = module.weight.detach().t().contiguous()
            # An instance attribute shadows the class's forward until the del below.
            module.forward = functools.partial(  # type: ignore[method-assign]
                _row_major_linear, weight_t=weight_t, bias=module.bias
            )
        try:
            yield
        finally:
            for module in swapped:
                del module.forward


def _row_major_linear(x: torch.Tensor, *, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``nn.Linear`` with the weight given as ``[in, out]``."""
    y = torch.matmul(x, weight_t)
    return y if bias is None else y + bias
