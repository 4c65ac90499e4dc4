"""Fingerprints of a model and a tokenizer: a stored chunk is never served to another one."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

_ATTR = "_kvboost_fingerprint"


def model_fingerprint(model: torch.nn.Module) -> str:
    """SHA-256 over the config, dtype and every weight byte (≈1.5 GB/s here).

    Cached on the model object; a model whose weights are changed in place must
    be fingerprinted again with :func:`refresh_model_fingerprint`.
    """
    cached = getattr(model, _ATTR, None)
    if cached is None:
        cached = refresh_model_fingerprint(model)
    return cached


def refresh_model_fingerprint(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    config = getattr(model, "config", None)
    if config is not None:
        h.update(json.dumps(config.to_dict(), sort_keys=True, default=str).encode())
    h.update(type(model).__name__.encode())
    seen: set[int] = set()  # tied weights are hashed once
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        t = tensor.detach()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        raw = t.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        h.update(raw.data)  # a memoryview of the array's bytes, as memoryview(raw)
    digest = h.hexdigest()
    setattr(model, _ATTR, digest)
    return digest


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """SHA-256 over the tokenizer's full definition, special tokens and chat template."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    specials = getattr(tokenizer, "special_tokens_map", {})
    h.update(json.dumps(specials, sort_keys=True, default=str).encode())
    h.update(str(getattr(tokenizer, "chat_template", None)).encode())
    return h.hexdigest()
