"""RoPE re-rotation: move stored keys from the positions they were computed at to new ones.

Rotary embeddings turn a key at position ``p`` into ``s·R(p)·k``, where ``R(p)``
rotates each pair of dimensions by ``p·θᵢ`` and ``s`` is the variant's
attention scaling (1 except for yarn and longrope). Whenever the angles are
linear in ``p`` with fixed frequencies (default, linear, llama3, yarn, and
longrope within one of its two regimes), ``R(n) = R(n - p)·R(p)``, so a stored
key moves to position ``n`` by one more rotation. The cos/sin come from the
model's own rotary module at both positions, so every frequency tweak of the
variant is reproduced exactly rather than re-derived here:

    R(n)·R(p)ᵀ = R_hf(n)·R_hf(p)ᵀ / s²,  with R_hf = s·R and s² = cos_hf² + sin_hf².

Variants whose frequencies depend on the sequence length (dynamic NTK) have no
such delta rotation and are refused.
"""

from __future__ import annotations

from typing import Any

import torch

ROTATE_HALF_FAMILIES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3_text", "granite", "olmo2"}
)
"""Model types whose attention applies RoPE with ``rotate_half`` (pairs ``i`` and ``i + d/2``) to a
leading slice of the head dimension, the layout :class:`RopeShifter` reproduces."""

STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn", "longrope"})


def _text_config(model: Any) -> Any:
    return model.config.get_text_config(decoder=True)


def blend_blocker(model: Any) -> str | None:
    """Why keys of ``model`` cannot be re-rotated exactly (so blend reuse cannot serve it), or None."""
    text = _text_config(model)
    model_type = getattr(text, "model_type", "?")
    if model_type not in ROTATE_HALF_FAMILIES:
        return (
            f"blend reuse re-rotates rotary position embeddings, and {model_type!r} models are not supported "
            f"(supported families: {', '.join(sorted(ROTATE_HALF_FAMILIES))}); use reuse='exact'"
        )
    if getattr(model.base_model, "rotary_emb", None) is None:
        return f"this {model_type!r} model has no shared rotary embedding module; use reuse='exact'"
    params = getattr(text, "rope_parameters", None) or {"rope_type": "default"}
    # one set of parameters, or one per layer type (Gemma 3: local and global layers)
    per_type = [params] if "rope_type" in params else list(params.values())
    for kind in per_type:
        rope_type = kind.get("rope_type", "default") if isinstance(kind, dict) else None
        if rope_type not in STATIC_ROPE_TYPES:
            return (
                f"RoPE type {rope_type!r} changes its frequencies with the sequence length, "
                "so stored keys cannot be moved to new positions exactly; use reuse='exact'"
            )
    return None


class RopeShifter:
    """Re-rotates stored keys of one model to new positions.

    Layout of ``kv``: ``[layers, 2, kv_heads, tokens, head_dim]`` (index 0: keys).
    """

    def __init__(self, model: Any) -> None:
        blocker = blend_blocker(model)
        if blocker is not None:
            from .errors import UnsupportedModelError

            raise UnsupportedModelError(blocker)
        self.rotary = model.base_model.rotary_emb
        text = _text_config(model)
        params = text.rope_parameters or {}
        per_type = "rope_type" not in params and bool(params)
        self.layer_types: list[str] | None = list(text.layer_types) if per_type else None
        """Each layer's type where the rotary module keeps one set of frequencies per type."""
        # longrope switches to its long-context frequencies once a forward reaches past the
        # original context; within the short regime its frequencies are fixed.
        self.max_position = (
            params.get("original_max_position_embeddings") if params.get("rope_type") == "longrope" else None
        )

    def can_move(self, old_end: int, new_end: int) -> bool:
        """Whether keys computed in a forward ending at ``old_end`` can move to positions ending at
        ``new_end``."""
        return self.max_position is None or max(old_end, new_end) <= self.max_position

    def _cos_sin(
        self, positions: torch.Tensor, device: torch.device, layer_type: str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos/sin ``[tokens, rot_dim]`` of the model's rotary module (its scaling included), for
        the layers of ``layer_type`` where frequencies differ by type."""
        probe = torch.empty(0, device=device, dtype=torch.float32)
        at = positions.to(device).unsqueeze(0)
        cos, sin = self.rotary(probe, at) if layer_type is None else self.rotary(probe, at, layer_type)
        return cos[0].float(), sin[0].float()

    def _delta(
        self, old: torch.Tensor, new: torch.Tensor, device: torch.device, layer_type: str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[tokens, rot_dim]`` of the rotation from positions ``old`` to ``new``."""
        cos_o, sin_o = self._cos_sin(old, device, layer_type)
        cos_n, sin_n = self._cos_sin(new, device, layer_type)
        scale_sq = cos_o * cos_o + sin_o * sin_o
        return (cos_n * cos_o + sin_n * sin_o) / scale_sq, (sin_n * cos_o - cos_n * sin_o) / scale_sq

    @torch.inference_mode()
    def move(self, kv: torch.Tensor, old_start: int, new_start: int) -> torch.Tensor:
        """``kv`` with keys moved from positions ``old_start..`` to ``new_start..`` (values unchanged).

        Returns a new tensor, or ``kv`` itself when the positions are equal: never modify the result in place.
        """
        if old_start == new_start:
            return kv
        tokens = kv.shape[3]
        old = torch.arange(old_start, old_start + tokens)
        new = old - old_start + new_start
        if self.layer_types is None:
            cos_d, sin_d = self._delta(old, new, kv.device)  # [tokens, rot_dim], every layer
        else:
            deltas = {kind: self._delta(old, new, kv.device, kind) for kind in set(self.layer_types)}
            # [layers, 1, tokens, rot_dim]: each layer its type's rotation
            cos_d = torch.stack([deltas[kind][0] for kind in self.layer_types])[:, None]
            sin_d = torch.stack([deltas[kind][1] for kind in self.layer_types])[:, None]
        rot_dim = cos_d.shape[-1]
        out = kv.clone()
        keys = kv[:, 0, :, :, :rot_dim].float()  # [layers, kv_heads, tokens, rot_dim]
        half = rot_dim // 2
        rotated_half = torch.cat((-keys[..., half:], keys[..., :half]), dim=-1)
        out[:, 0, :, :, :rot_dim] = (keys * cos_d + rotated_half * sin_d).to(kv.dtype)
        return out
