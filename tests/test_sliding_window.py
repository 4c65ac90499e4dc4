"""Sliding-window and hybrid models (Mistral with a window, Gemma 3's sliding layers around a global
one): exact reuse at any length, past the window too; answers equal to transformers' own cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_answers_as_the_models_own_cache, essay_paragraphs, tiny_model, tiny_tokenizer

from kvboost_rag import EngineConfig, KVBoostEngine, Request, block_attention, invariance
from kvboost_rag.assembler import Assembler
from kvboost_rag.assembler.buffered_cache import buffered_layers
from kvboost_rag.batch import RunningBatch
from kvboost_rag.block_attention import KEY_BLOCK, block_causal_attention, queries_at
from kvboost_rag.decoding import DecodeStepper
from kvboost_rag.warming import reply_head, store_reply_from_cache

ARCHS = ["mistral-window", "gemma3"]  # windows of 128 tokens
DTYPES = [torch.float32, torch.bfloat16]


def text_of(tok, n_tokens: int, skip: int = 0) -> str:
    text = " ".join(essay_paragraphs(60, max_chars=3000))
    return tok.decode(tok.encode(text, add_special_tokens=False)[skip : skip + n_tokens])


def engine_for(model, tok) -> KVBoostEngine:
    """An engine without held contexts: warm requests read through the store."""
    return KVBoostEngine(model, tok, config=EngineConfig(chunk_size=64, held_context_tokens=0))


def test_windowed_attention_is_transformers_window_and_split_invariant():
    """A query at p attends keys p - window < k <= p; rows get the same bits in any call."""
    torch.manual_seed(0)
    heads, kv_heads, dim, window, total = 4, 2, 16, 200, 1300
    q = torch.randn(1, heads, total, dim, dtype=torch.bfloat16)
    k = torch.randn(1, kv_heads, block_attention.round_up(total, KEY_BLOCK), dim, dtype=torch.bfloat16)
    v = torch.randn_like(k)

    def attend(start: int, end: int) -> torch.Tensor:
        with queries_at(start, end - start, heads // kv_heads, q.dtype, q.device, windows=(None, window)):
            out, _ = block_causal_attention(
                torch.nn.Module(), q[:, :, start:end], k, v, None, scaling=0.25, sliding_window=window
            )
        return out

    whole = attend(0, total)
    assert torch.equal(torch.cat([attend(0, 700), attend(700, 1030), attend(1030, total)], dim=1), whole)
    positions = torch.arange(total)
    allowed = (positions[None, :] <= positions[:, None]) & (positions[None, :] > positions[:, None] - window)
    reference = F.scaled_dot_product_attention(
        q.float(),
        k[:, :, :total].float().repeat_interleave(2, dim=1),
        v[:, :, :total].float().repeat_interleave(2, dim=1),
        attn_mask=allowed,
        scale=0.25,
    ).transpose(1, 2)
    torch.testing.assert_close(whole.float(), reference, rtol=0.02, atol=0.02)


def test_a_window_the_forward_did_not_declare_is_refused():
    q = torch.randn(1, 2, 8, 16)
    k = v = torch.randn(1, 2, KEY_BLOCK, 16)
    with queries_at(0, 8, 1, q.dtype, q.device), pytest.raises(RuntimeError, match="window of 64"):
        block_causal_attention(torch.nn.Module(), q, k, v, None, sliding_window=64)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_the_probe_holds_past_the_window(arch, dtype):
    assembler = Assembler(tiny_model(arch, dtype))
    assert assembler.attention_window == 128
    report = invariance.check_split_invariance(assembler, 400)
    assert report.holds, report.detail
    assert f"{invariance.probe_tokens(128)} tokens" in report.detail


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_shared_prefix_past_the_window_is_read_and_answers_as_a_fresh_engine(arch, dtype):
    model, tok = tiny_model(arch, dtype), tiny_tokenizer()
    prefix = text_of(tok, 1000)  # past the 128-token window and two 512-key blocks
    engine = engine_for(model, tok)
    engine.generate(prefix + " What comes first?", max_new_tokens=4)
    prompt = prefix + " And what comes last, in a few words?"
    warm = engine.generate(prompt, max_new_tokens=6, return_logits=True)
    cold = engine_for(model, tok).generate(prompt, max_new_tokens=6, return_logits=True)
    shared = len(engine.canonicalize(prefix).token_ids)
    assert warm.reuse_note is None
    assert warm.usage.cached_tokens >= shared - 64
    assert torch.equal(warm.first_logits, cold.first_logits)
    assert warm.token_ids == cold.token_ids


@pytest.mark.parametrize("arch", ARCHS)
def test_answers_past_the_window_equal_transformers_own_forward(arch):
    """Logits as the model's own forward gives them (float32: the same arithmetic up to rounding; a
    window left out moves them by ~1), greedy tokens as HF ``generate`` gives them."""
    model, tok = tiny_model(arch), tiny_tokenizer()
    prompt = text_of(tok, 1100, skip=50) + " Sum it up."
    engine = engine_for(model, tok)
    engine.generate(prompt, max_new_tokens=1)  # stored: the answer below reads it
    result = engine.generate(prompt, max_new_tokens=12, return_logits=True)
    assert result.usage.cached_tokens == result.usage.prompt_tokens
    assert_answers_as_the_models_own_cache(engine, model, prompt, result, tolerance=1e-4)


def test_a_chat_past_the_window_computes_only_its_new_turn():
    model, tok = tiny_model("gemma3", torch.bfloat16), tiny_tokenizer()
    engine = engine_for(model, tok)
    messages = [
        {"role": "system", "content": "Answer from the notes."},
        {"role": "user", "content": text_of(tok, 600) + "\nWhat is the first claim?"},
    ]
    first = engine.generate(messages, max_new_tokens=8)
    following = [*messages, {"role": "assistant", "content": first.text}, {"role": "user", "content": "Why?"}]
    second = engine.generate(following, max_new_tokens=8, return_logits=True)
    fresh = engine_for(model, tok).generate(following, max_new_tokens=8, return_logits=True)
    assert second.usage.recomputed_tokens <= 64
    assert torch.equal(second.first_logits, fresh.first_logits) and second.token_ids == fresh.token_ids


@pytest.mark.parametrize("arch", ARCHS)
def test_requests_past_the_window_decode_together_as_each_decodes_alone(arch):
    """A batch masks the slots behind each sliding layer's window: seeded samples (which follow the
    whole distribution, not only its top token) are those each request draws alone."""
    model, tok = tiny_model(arch), tiny_tokenizer()
    engine = engine_for(model, tok)
    prompts = [text_of(tok, 400 + 150 * k, skip=k * 500) + " Go on." for k in range(3)]
    assert engine.core.assembler.batch_blocker(600) is None
    settings = {"max_new_tokens": 16, "temperature": 1.0, "seed": 7}
    together = engine.generate_batch(prompts, **settings)
    for prompt, result in zip(prompts, together, strict=True):
        assert result.token_ids == engine_for(model, tok).generate(prompt, **settings).token_ids


@pytest.mark.parametrize(
    ("arch", "kv_heads"), [("mistral-window", 2), ("gemma3", 1)], ids=["mistral-window", "gemma3-one-kv-head"]
)
def test_blend_past_the_window_with_every_token_recomputed_is_exact_mode(arch, kv_heads):
    """Blend's recompute applies each layer's window: recomputing every reused token (ratio 1) gives
    the answer and, within rounding, the logits of exact mode; a window left out moves them by ~1.
    (Gemma 3 270M has one KV head, a layout whose cache slots PyTorch copies differently.)"""
    model, tok = tiny_model(arch, num_key_value_heads=kv_heads), tiny_tokenizer()
    docs = [text_of(tok, 300, skip=k * 400) for k in range(3)]
    engine = engine_for(model, tok)
    engine.prewarm(docs, prefix="Notes:\n\n")
    prompt = "Notes:\n\n" + "\n\n".join(reversed(docs)) + "\n\nWhat comes first?"
    blended = engine.generate(
        prompt, max_new_tokens=8, return_logits=True, reuse="blend", blend_recompute_ratio=1.0
    )
    exact = engine_for(model, tok).generate(prompt, max_new_tokens=8, return_logits=True)
    assert blended.usage.blended_tokens > 500 and blended.usage.approx_tokens == 0
    torch.testing.assert_close(blended.first_logits, exact.first_logits, rtol=1e-4, atol=1e-4)
    assert blended.token_ids == exact.token_ids


def segments(tok) -> list:
    from kvboost_rag import Segment

    return [
        Segment("You answer from the documents. Keep answers short.", "text"),
        *(Segment(text_of(tok, 220, skip=k * 300), "document") for k in range(3)),
        Segment("Which claim comes first? One sentence.", "text"),
    ]


@pytest.mark.parametrize("tier", ["memory", "disk"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_cold_partial_and_full_hits_past_the_window_are_bitwise_identical(arch, dtype, tier, tmp_path):
    """Contract 2 on hybrid models: 0 %, partial and full hits, from memory or (a new engine) disk."""
    model, tok = tiny_model(arch, dtype), tiny_tokenizer()
    prompt = segments(tok)
    config = EngineConfig(chunk_size=64, held_context_tokens=0)  # through the store

    def engine(store: str) -> KVBoostEngine:
        return KVBoostEngine(
            model, tok, config=config, store_dir=tmp_path / store if tier == "disk" else None
        )

    def run(e: KVBoostEngine):
        return e.generate(prompt, max_new_tokens=8, return_logits=True)

    uncached = run(KVBoostEngine(model, tok, config=config.model_copy(update={"reuse": "off"})))

    def reopened(e: KVBoostEngine, store: str) -> KVBoostEngine:
        """The same engine from memory; a new one over the same folder from disk."""
        if tier == "memory":
            return e
        e.close()
        return engine(store)

    first = engine("full")
    cold = run(first)
    assert cold.usage.prompt_tokens > 500 and cold.usage.cached_tokens == 0
    full = run(reopened(first, "full"))
    second = engine("partial")
    second.warm(prompt[:2])  # the opening and the first document
    partial = run(reopened(second, "partial"))
    assert full.usage.cached_tokens == full.usage.prompt_tokens
    assert full.usage.cached_tokens_by_tier == {tier: full.usage.prompt_tokens}
    assert 0 < partial.usage.cached_tokens < partial.usage.prompt_tokens
    for result in (cold, full, partial):
        assert torch.equal(result.first_logits, uncached.first_logits)
        assert result.token_ids == uncached.token_ids


def _greedy_steps(assembler, ids: list[int], steps: int, keep_from: int | None) -> tuple[torch.Tensor, int]:
    """Logits of ``steps`` greedy decode steps after ``ids``, and the most slots a sliding layer held."""
    cache = assembler.new_cache(len(ids) + steps)
    logits = assembler.forward(cache, ids, 0)
    stepper = DecodeStepper(
        assembler, cache, ids, end=len(ids) + steps + 1, max_draft_tokens=4, keep_from=keep_from
    )
    out, most_slots = [], 0
    for _ in range(steps):
        logits = stepper.next_logits(int(logits.argmax()))
        out.append(logits)
        most_slots = max(most_slots, *(lay._k.shape[2] for lay in buffered_layers(cache) if lay.window))
    return torch.stack(out), most_slots


@pytest.mark.parametrize("arch", ARCHS)
def test_a_long_decode_keeps_about_a_window_per_sliding_layer_with_the_same_bits(arch):
    """Sliding layers drop the key blocks no later step attends, as transformers' own cache keeps only
    the window: at 2,000 positions each holds at most 3 key blocks; every logit keeps its bits."""
    model, tok = tiny_model(arch, torch.bfloat16), tiny_tokenizer()
    assembler = engine_for(model, tok).core.assembler
    ids = tok.encode(text_of(tok, 1100), add_special_tokens=False)
    dropping, most_slots = _greedy_steps(assembler, ids, 900, keep_from=None)
    keeping, all_slots = _greedy_steps(assembler, ids, 900, keep_from=0)
    assert most_slots <= 3 * KEY_BLOCK < all_slots
    assert torch.equal(dropping, keeping)


@pytest.mark.parametrize("keep_reply", [True, False], ids=["reply-kept", "reply-dropped"])
def test_a_reply_past_the_window_is_stored_from_the_cache_only_where_it_was_kept(keep_reply):
    """A chat reply is stored from the request's own cache when it ends: decoding keeps its positions
    (``keep_from``), so the next turn computes only itself, with a fresh engine's bits; where they
    were dropped, storing says so (the idle re-prefill stores it) and nothing wrong is stored."""
    model, tok = tiny_model("mistral-window", torch.bfloat16), tiny_tokenizer()
    engine = engine_for(model, tok)
    core = engine.core
    messages = [{"role": "user", "content": text_of(tok, 560) + "\nGo on."}]
    reply = text_of(tok, 1100, skip=3000)  # text that tokenizes back to itself, as a real reply does
    following = [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": "Why?"}]
    engine.generate(messages, max_new_tokens=1)  # the prompt's chunks are stored
    prompt_ids = engine.canonicalize(messages).token_ids
    head = core.canonicalize(reply_head(core, messages, reply), add_generation_prompt=False).token_ids
    assert head[: len(prompt_ids)] == prompt_ids
    reply_ids = head[len(prompt_ids) :]  # as the next turn renders the reply
    cache = core.assembler.new_cache(len(prompt_ids) + len(reply_ids))
    core.assembler.forward(cache, prompt_ids, 0)
    stepper = DecodeStepper(
        core.assembler,
        cache,
        prompt_ids,
        end=len(prompt_ids) + len(reply_ids) + 1,
        max_draft_tokens=0,
        keep_from=len(prompt_ids) if keep_reply else None,
    )
    for token in reply_ids:  # the reply's tokens fed as a decode feeds them
        stepper.next_logits(token)
    assert cache.held_from == (512 if keep_reply else 1024)  # the window alone would drop to 1,024
    stored = store_reply_from_cache(core, messages, reply, None, cache, [*prompt_ids, *reply_ids])
    assert stored == keep_reply
    second = engine.generate(following, max_new_tokens=4, return_logits=True)
    fresh = engine_for(model, tok).generate(following, max_new_tokens=4, return_logits=True)
    assert torch.equal(second.first_logits, fresh.first_logits)
    if keep_reply:
        assert second.usage.recomputed_tokens <= 64


def test_a_lone_row_that_dropped_blocks_joins_a_batch_and_keeps_its_tokens(monkeypatch):
    """The lone row's dropped positions come back as zeros when others join (the batch masks them by
    position); it decodes as it would alone."""
    model, tok = tiny_model("mistral-window", torch.bfloat16), tiny_tokenizer()
    restored: list[int] = []
    real_end_lone = RunningBatch._end_lone

    def end_lone(self: RunningBatch) -> None:
        if self._stepper is not None:
            restored.append(max(self._cache.key_starts()))
        real_end_lone(self)

    monkeypatch.setattr(RunningBatch, "_end_lone", end_lone)
    batching = KVBoostEngine(model, tok, config=EngineConfig(chunk_size=64, batch_window_ms=0))
    batching.eos_ids = frozenset()
    long = Request(text_of(tok, 1100, skip=40) + " Go on.", max_new_tokens=40)
    joiner = Request(text_of(tok, 300, skip=900) + " Why?", max_new_tokens=8)
    steps = [0]
    joined: list = []
    real_step = RunningBatch.step

    def step(self: RunningBatch) -> bool:
        going = real_step(self)
        steps[0] += 1
        if steps[0] == 10:
            joined.append(batching.submit(joiner))
        return going

    monkeypatch.setattr(RunningBatch, "step", step)
    result = batching.submit(long).result(timeout=120)
    joined_result = joined[0].result(timeout=120)
    batching.close()
    assert restored and restored[0] == KEY_BLOCK  # the lone row had dropped a block when the joiner came
    alone = engine_for(model, tok)
    assert result.token_ids == alone.generate(long).token_ids
    assert joined_result.token_ids == alone.generate(joiner).token_ids
