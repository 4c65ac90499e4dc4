"""Decoding (kvboost_rag.decoding): decode steps with a prefill's bits, and speculation that never
changes the output (DESIGN.md contract 2)."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model, tiny_tokenizer

from kvboost_rag import EngineConfig, KVBoostEngine, Request
from kvboost_rag.assembler import Assembler
from kvboost_rag.decoding import DecodeStepper, decode
from kvboost_rag.warming import reply_head, store_reply_from_cache

EOS: frozenset[int] = frozenset()  # decode to max_new_tokens

# A prompt that repeats itself, so that the reply can quote it (and drafts get confirmed).
QUOTED = "The quick brown fox jumps over the lazy dog. " * 6


def invariant_assembler(model: torch.nn.Module) -> Assembler:
    assembler = Assembler(model)
    assembler.invariant = True  # what the engine sets once the probe holds (tests/test_fine_reuse.py)
    return assembler


def run_decode(
    assembler: Assembler, prompt: list[int], new_tokens: int, *, drafts: int, request: Request | None = None
) -> tuple[list[int], list[torch.Tensor], DecodeStepper]:
    """Tokens chosen and the logits each was chosen from (the prefill's first)."""
    cache = assembler.new_cache(len(prompt) + new_tokens)
    first = assembler.forward(cache, prompt, 0)
    assert first is not None
    stepper = DecodeStepper(assembler, cache, prompt, end=len(prompt) + new_tokens, max_draft_tokens=drafts)
    seen: list[torch.Tensor] = [first]
    original = stepper.next_logits

    def recording(token: int) -> torch.Tensor:
        seen.append(original(token))
        return seen[-1]

    stepper.next_logits = recording  # type: ignore[method-assign]
    request = request or Request("unused", max_new_tokens=new_tokens)
    tokens = list(decode(stepper, first, request, EOS, new_tokens))
    return tokens, seen[: len(tokens)], stepper


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3"])  # phi3 runs through transformers' modules
def test_speculation_gives_the_same_tokens_and_logits_bitwise(arch, dtype):
    model, tok = tiny_model(arch, dtype), tiny_tokenizer()
    assembler = invariant_assembler(model)
    prompt = tok.encode(QUOTED)
    plain, plain_logits, off = run_decode(assembler, prompt, 40, drafts=0)
    fast, fast_logits, on = run_decode(assembler, prompt, 40, drafts=7)
    assert off.stats.drafted_tokens == 0 and off.stats.forwards == 39
    assert on.stats.accepted_tokens > 0  # the test exercises verification
    assert on.stats.forwards < off.stats.forwards
    assert fast == plain
    for a, b in zip(fast_logits, plain_logits, strict=True):
        assert torch.equal(a, b)


def test_seeded_sampling_draws_the_same_tokens_with_speculation():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    assembler = invariant_assembler(model)
    prompt = tok.encode(QUOTED)
    request = Request("unused", max_new_tokens=40, temperature=0.7, seed=11)
    plain, _, _ = run_decode(assembler, prompt, 40, drafts=0, request=request)
    fast, _, on = run_decode(assembler, prompt, 40, drafts=7, request=request)
    assert on.stats.drafted_tokens > 0
    assert fast == plain


@pytest.mark.parametrize("drafts", [0, 7, 15])
def test_a_decoded_tokens_kv_is_what_a_prefill_of_the_same_tokens_gives(drafts):
    model, tok = tiny_model("llama", torch.bfloat16), tiny_tokenizer()
    assembler = invariant_assembler(model)
    prompt = tok.encode(QUOTED)
    tokens, logits, stepper = run_decode(assembler, prompt, 30, drafts=drafts)
    fed = [*prompt, *tokens[:-1]]  # the last token is chosen, never fed
    assert stepper.position == len(fed)
    decoded = stepper._cache
    cold = assembler.new_cache(len(fed))
    last = assembler.forward(cold, fed, 0)
    assert torch.equal(assembler.extract(decoded, 0, len(fed)), assembler.extract(cold, 0, len(fed)))
    assert last is not None and torch.equal(last, logits[-1])


def test_drafts_are_never_fed_past_the_last_position_that_can_be_chosen():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    assembler = invariant_assembler(model)
    prompt = tok.encode(QUOTED)
    fed_ends = []
    forward_tail = assembler.forward_tail

    def recording(cache, token_ids, start, logit_rows, **kw):
        fed_ends.append(start + len(token_ids))
        return forward_tail(cache, token_ids, start, logit_rows, **kw)

    assembler.forward_tail = recording  # type: ignore[method-assign]
    for new_tokens in (2, 9, 30):
        fed_ends.clear()
        tokens, _, stepper = run_decode(assembler, prompt, new_tokens, drafts=15)
        assert len(tokens) == new_tokens
        # the prefill fed the prompt; decode steps feed every token but the last one chosen
        assert max(fed_ends) <= len(prompt) + new_tokens - 1
    assert stepper.stats.drafted_tokens > 0


def test_without_the_split_invariant_forward_nothing_is_drafted():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    assembler = Assembler(model)  # invariant stays off: the canonical schedule
    tokens, _, stepper = run_decode(assembler, tok.encode(QUOTED), 12, drafts=7)
    assert not stepper.exact and stepper.stats.drafted_tokens == 0 and len(tokens) == 12


@pytest.mark.parametrize("max_batch_size", [1, 8], ids=["solo", "scheduler"])
def test_the_engine_reports_drafts_and_answers_the_same(max_batch_size):
    model, tok = tiny_model("llama"), tiny_tokenizer()

    def answer(drafts: int):
        config = EngineConfig(chunk_size=16, max_draft_tokens=drafts, max_batch_size=max_batch_size)
        with KVBoostEngine(model, tok, config=config) as engine:
            return engine.generate(QUOTED, max_new_tokens=32, return_logits=True)

    plain, fast = answer(0), answer(7)
    assert plain.usage.drafted_tokens == 0
    assert fast.usage.accepted_tokens > 0 and fast.usage.drafted_tokens >= fast.usage.accepted_tokens
    assert fast.token_ids == plain.token_ids and fast.text == plain.text
    assert torch.equal(fast.first_logits, plain.first_logits)


def test_a_reply_rendered_otherwise_is_stored_by_the_re_prefill():
    """Where the template renders the reply otherwise than the tokens generated, the chunks before
    the difference are stored at once and the rest by the background re-prefill."""
    model, tok = tiny_model("qwen2"), tiny_tokenizer()
    core = KVBoostEngine(model, tok, config=EngineConfig(chunk_size=16)).core
    history = [{"role": "user", "content": QUOTED}]
    prompt = core.canonicalize(history).token_ids
    cache = core.prefill(
        prompt, core.chunks(core.canonicalize(history)), store=None, capacity=len(prompt)
    ).cache
    altered = "Quite different words. " * 3
    assert not store_reply_from_cache(core, history, altered, None, cache, prompt)
    head = core.canonicalize(reply_head(core, history, altered), add_generation_prompt=False)
    stored = [core.store.contains(c.key) for c in core.chunks(head)]
    assert any(stored) and not all(stored)  # the prompt's chunks (from the cache), not the reply's
    assert stored == sorted(stored, reverse=True)
