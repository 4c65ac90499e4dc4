"""A hand-run forward of Llama-family decoder stacks (Llama, Qwen2, Mistral) over our buffered caches.

A short forward (a decode step, a verification of drafted tokens, a question over a stored
prompt) reads every weight once and computes little, so its cost is the weight read plus
whatever runs around the products. Through transformers' modules that is a lot: a SmolLM2
step of one token costs ~50 ms on a 2-core CPU, of which the products are ~25 ms and module
calls, hooks, mask and kwargs handling much of the rest. This module runs the same
arithmetic as the model's own modules, op for op (RMSNorm in float32, RoPE from the model's
rotary module, SiLU-gated MLP), as one flat loop over the layers, with:

- on a CPU with oneDNN (float32 and bfloat16), every linear weight packed once for oneDNN
  (``mkldnn._reorder_linear_weight``), and q/k/v and gate/up run as one product each (fewer,
  larger calls). ``F.linear`` reorders a bfloat16 weight on every call and runs a few float32
  rows through slow kernels; all SmolLM2 products of one 8-row step take 13 ms packed against
  29 ms (bfloat16), 24 ms against 69 ms (float32). Packed products give each row the same bits
  whatever the row count (in bfloat16 the bits of ``F.linear`` too; in float32 other bits);
- other devices keep ``F.linear`` per projection, as the modules do;
- the work between the products (residual adds, RMSNorm, RoPE) through a glue
  (:mod:`.native_glue`): two compiled C functions where a C compiler exists, else the modules'
  PyTorch ops.

It runs the split-invariant forwards (prefill, decode and verification alike), so the
load-time probe covers it: the probe compares split forwards through this path, and the
namespace names it (:data:`KERNEL_TAG`), so stored KV is never mixed between it and the
modules' path. Models it does not take (:meth:`LeanForward.supports` says why) run the
modules.

Layouts: hidden states ``[1, rows, hidden]``; queries ``[1, heads, rows, head_dim]``; keys
and values ``[1, kv_heads, rows, head_dim]`` into the cache.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from .. import block_attention
from .buffered_cache import BufferedCache, buffered_layers
from .native_glue import Glue, RMSNorm, TorchGlue, glue_for

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..chunk_attention import AttentionFunction

KERNEL_TAG = "lean1"
"""Names this forward in the store namespace (with :func:`kernel_tag`'s glue); bump it whenever its
arithmetic changes."""

SUPPORTED_MODEL_TYPES = frozenset({"llama", "qwen2", "mistral"})
"""Model types whose decoder layers are pre-norm RMSNorm + RoPE attention + SiLU-gated MLP."""


def _packs_for_onednn(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is multiplied as a oneDNN-packed weight (float32 or bfloat16, CPU with oneDNN)."""
    return (
        weight.dtype in (torch.float32, torch.bfloat16)
        and weight.device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class _Projections:
    """Several linear projections of one input: one packed product split into parts, or one
    ``F.linear`` per part."""

    PACK_ROWS_HINT = 8
    """Rows oneDNN lays the packed weight out for (any row count runs; this is the decode case)."""

    def __init__(self, linears: Sequence[torch.nn.Linear]) -> None:
        weights = [lin.weight.detach() for lin in linears]
        biases = [lin.bias.detach() if lin.bias is not None else None for lin in linears]
        self.sizes = [w.shape[0] for w in weights]
        self.packed: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        if _packs_for_onednn(weights[0]) and all((b is None) == (biases[0] is None) for b in biases):
            fused = torch.cat(weights) if len(weights) > 1 else weights[0]
            self.packed = torch.ops.mkldnn._reorder_linear_weight(fused, self.PACK_ROWS_HINT)
            if biases[0] is not None:
                self.bias = torch.cat([b for b in biases if b is not None])
        self.weights, self.biases = weights, biases

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.packed is not None:
            return list(self.fused(x).split(self.sizes, dim=-1))
        return [F.linear(x, w, b) for w, b in zip(self.weights, self.biases, strict=True)]

    def fused(self, x: torch.Tensor) -> torch.Tensor:
        """The projections side by side on the last axis."""
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        parts = self(x)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


@dataclass(frozen=True)
class _Layer:
    attention_module: torch.nn.Module
    """The model's own attention module (attention functions read ``layer_idx`` from it)."""
    input_norm: RMSNorm
    qkv: _Projections
    o_proj: _Projections
    post_norm: RMSNorm
    gate_up: _Projections
    down: _Projections
    act: Callable[[torch.Tensor], torch.Tensor]
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    window: int | None
    """The sliding window the model's module applies (None: full attention)."""


class LeanForward:
    """The decoder stack of one loaded model, run by hand (see the module docstring)."""

    def __init__(self, model: PreTrainedModel) -> None:
        base: Any = model.base_model  # the Llama layout, checked by supports()
        text = model.config.get_text_config(decoder=True)
        self._embed: Callable[[torch.Tensor], torch.Tensor] = base.embed_tokens
        self._rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]] = base.rotary_emb
        self._norm = RMSNorm(base.norm.weight.detach(), base.norm.variance_epsilon)
        self.glue = glue_of(model)
        """The work between the products: compiled where it can be (see :mod:`.native_glue`)."""
        self._head = _Projections([model.get_output_embeddings()])
        self._layers = []
        for layer, window in zip(base.layers, block_attention.layer_windows(model.config), strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            self._layers.append(
                _Layer(
                    attention_module=attn,
                    input_norm=RMSNorm(
                        layer.input_layernorm.weight.detach(), layer.input_layernorm.variance_epsilon
                    ),
                    qkv=_Projections([attn.q_proj, attn.k_proj, attn.v_proj]),
                    o_proj=_Projections([attn.o_proj]),
                    post_norm=RMSNorm(
                        layer.post_attention_layernorm.weight.detach(),
                        layer.post_attention_layernorm.variance_epsilon,
                    ),
                    gate_up=_Projections([mlp.gate_proj, mlp.up_proj]),
                    down=_Projections([mlp.down_proj]),
                    act=mlp.act_fn,
                    heads=text.num_attention_heads,
                    kv_heads=text.num_key_value_heads,
                    head_dim=attn.head_dim,
                    scaling=attn.scaling,
                    window=window,
                )
            )

    @staticmethod
    def supports(model: PreTrainedModel) -> str | None:
        """Why this forward cannot run ``model``, or None when it can."""
        config = model.config
        text = config.get_text_config(decoder=True)
        if text.model_type not in SUPPORTED_MODEL_TYPES:
            return f"model type {text.model_type!r} is not one of {sorted(SUPPORTED_MODEL_TYPES)}"
        if getattr(text, "hidden_act", None) != "silu":
            return f"activation {getattr(text, 'hidden_act', None)!r} is not silu"
        base = getattr(model, "base_model", None)
        needed = ("embed_tokens", "rotary_emb", "norm", "layers")
        if base is None or not all(hasattr(base, name) for name in needed):
            return "the model lacks the Llama layout (embed_tokens, rotary_emb, norm, layers)"
        if type(model.get_output_embeddings()) is not torch.nn.Linear:
            return "the LM head is not a plain linear layer"
        for layer in base.layers:
            attn = getattr(layer, "self_attn", None)
            projections = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
            mlp = getattr(layer, "mlp", None)
            projections += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
            if any(type(p) is not torch.nn.Linear for p in projections):
                return "a projection is not a plain linear layer (quantized or adapted weights)"
            for norm in (
                getattr(layer, "input_layernorm", None),
                getattr(layer, "post_attention_layernorm", None),
            ):
                if not hasattr(norm, "variance_epsilon") or not hasattr(norm, "weight"):
                    return "a layer norm is not an RMSNorm"
        return None

    @torch.inference_mode()
    def forward(
        self,
        cache: BufferedCache,
        ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionFunction,
        keep: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """Run ``ids``/``positions`` ``[1, rows]`` over ``cache`` with ``attention``; float32 logits
        ``[len(keep), vocab]`` of the rows ``keep`` (None: skip the LM head)."""
        hidden = self._embed(ids)  # [1, rows, hidden]
        cos, sin = self._rotary(hidden, positions)  # [1, rows, head_dim]
        half = sin.shape[-1] // 2
        # rotate_half(x) * sin == swap_halves(x) * sin with its first half negated (bit for bit)
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        rows = ids.shape[1]
        glue = self.glue
        # each layer's input norm is taken with the residual add that ends the layer before it
        normed = glue.norm(hidden, self._layers[0].input_norm)
        last = len(self._layers) - 1
        for index, (layer, cache_layer) in enumerate(zip(self._layers, buffered_layers(cache), strict=True)):
            qkv = layer.qkv.fused(normed)  # [1, rows, (heads + 2 * kv_heads) * dim]
            q, k, v = glue.rope_split(qkv, cos, sin, layer.heads, layer.kv_heads)
            keys, values = cache_layer.update(k, v)
            out, _ = attention(
                layer.attention_module,
                q,
                keys,
                values,
                None,
                dropout=0.0,
                scaling=layer.scaling,
                sliding_window=layer.window,
            )
            attended = layer.o_proj.fused(out.reshape(1, rows, -1))
            hidden, normed = glue.add_norm(hidden, attended, layer.post_norm)
            gate, up = layer.gate_up(normed)
            down = layer.down.fused(layer.act(gate) * up)
            if index < last:
                hidden, normed = glue.add_norm(hidden, down, self._layers[index + 1].input_norm)
            else:
                hidden = hidden + down
        if keep is None:
            return None
        normed = glue.norm(hidden[:, keep], self._norm)
        (logits,) = self._head(normed)
        return logits[0].float()


def glue_of(model: PreTrainedModel) -> Glue:
    """The glue a lean forward of ``model`` runs: compiled where its hidden states and every norm
    weight share one dtype it takes, PyTorch ops otherwise."""
    base: Any = model.base_model
    norms = [base.norm.weight] + [
        n.weight for layer in base.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)
    ]
    dtypes = {base.embed_tokens.weight.dtype, *(w.dtype for w in norms)}
    if len(dtypes) != 1:
        return TorchGlue()
    return glue_for(dtypes.pop(), base.norm.weight.device)


def kernel_tag(model: PreTrainedModel) -> str:
    """Names the lean forward of ``model`` in the store namespace: :data:`KERNEL_TAG` and its glue."""
    glue = glue_of(model)
    return f"{KERNEL_TAG}-{glue.tag}" if glue.tag else KERNEL_TAG


_SHARED: weakref.WeakKeyDictionary[torch.nn.Module, LeanForward] = weakref.WeakKeyDictionary()
_SHARED_GUARD = threading.Lock()


def lean_forward_of(model: PreTrainedModel) -> LeanForward:
    """The lean forward of ``model``, made once and shared by every assembler of that model: its
    packed weights are a copy of the model's, and a second copy would only cost memory (and, on
    a machine whose memory bandwidth suffers from a larger footprint, speed). The model's weights
    are read once, as the engine's fingerprint is: a model changed in place needs a new one."""
    with _SHARED_GUARD:
        lean = _SHARED.get(model)
        if lean is None:
            lean = _SHARED[model] = LeanForward(model)
        return lean
