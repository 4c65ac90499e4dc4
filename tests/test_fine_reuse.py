"""Fine-grained exact reuse (split-invariant forward): any shared prefix to within one chunk, bitwise,
whatever the store holds; the probe that guards it and the canonical-schedule fallback."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import essay_paragraphs, tiny_model, tiny_tokenizer

from kvboost_rag import EngineConfig, KVBoostEngine, Segment, UnsupportedModelError, invariance
from kvboost_rag.invariance import InvarianceReport

CHUNK = 16  # small chunks: many chunk boundaries inside short test prompts


def engine_for(model, tok, **config) -> KVBoostEngine:
    """An engine without held contexts: warm requests read through the store (see test_held_context.py)."""
    return KVBoostEngine(model, tok, config=EngineConfig(chunk_size=CHUNK, held_context_tokens=0, **config))


def first(engine: KVBoostEngine, prompt, **kw):
    return engine.generate(prompt, max_new_tokens=6, return_logits=True, **kw)


def assert_bitwise(a, b) -> None:
    assert torch.equal(a.first_logits, b.first_logits), (a.first_logits - b.first_logits).abs().max()
    assert a.token_ids == b.token_ids


def text_of(tok, n_tokens: int) -> str:
    """Real text of about ``n_tokens`` tokens (cut mid-word: the shared prefix ends inside a word)."""
    text = " ".join(essay_paragraphs(40, max_chars=3000))
    ids = tok.encode(text, add_special_tokens=False)[:n_tokens]
    return tok.decode(ids)[:-2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("prefix_tokens", [40, 300, 700])
def test_flat_prompts_reuse_any_shared_prefix_to_within_a_chunk(prefix_tokens, dtype):
    model, tok = tiny_model("llama", dtype), tiny_tokenizer()
    shared = text_of(tok, prefix_tokens)
    engine = engine_for(model, tok)
    assert engine.stats()["reuse"]["schedule"] == "invariant"
    first(engine, shared + " What is said first?")
    warm = first(engine, shared + " Name another point.")
    cold = first(engine_for(model, tok), shared + " Name another point.")
    assert cold.usage.cached_tokens == 0
    assert warm.usage.cached_tokens >= len(tok.encode(shared)) - CHUNK - 2
    assert warm.usage.cached_tokens + warm.usage.recomputed_tokens == warm.usage.prompt_tokens
    assert_bitwise(warm, cold)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["qwen2", "gemma", "gpt2"])
def test_every_share_of_hits_and_every_tier_gives_the_same_bits(arch, dtype, tmp_path):
    """0 %, partial (a prefix ending mid-chunk, mid-message, mid-word) and full hits, memory and disk."""
    model, tok = tiny_model(arch, dtype), tiny_tokenizer()
    doc = text_of(tok, 90)
    messages = [
        {"role": "system", "content": "Answer from the document."},
        {"role": "user", "content": doc + "\n\nWhich animal jumps?"},
    ]
    reference = first(engine_for(model, tok, reuse="off"), messages)
    partial_prompts = [
        [
            {"role": "system", "content": "Answer from the document."},
            {"role": "user", "content": doc[: len(doc) // 2]},
        ],
        [{"role": "system", "content": "Answer from the document."}],
        "<|im_start|>system\nAnswer from the doc",
    ]
    for partial in partial_prompts:
        engine = engine_for(model, tok)
        engine.warm(partial)
        hit = first(engine, messages)
        assert 0 < hit.usage.cached_tokens < hit.usage.prompt_tokens or isinstance(partial, str)
        assert_bitwise(hit, reference)
    config = EngineConfig(chunk_size=CHUNK, store_replies=False, held_context_tokens=0)  # through the store
    with KVBoostEngine(model, tok, config=config, store_dir=tmp_path) as writer:
        cold = first(writer, messages)
        assert cold.usage.cached_tokens == 0
        full = first(writer, messages)
        assert full.usage.cached_tokens_by_tier == {"memory": full.usage.prompt_tokens}
    with KVBoostEngine(model, tok, config=config, store_dir=tmp_path) as reader:
        from_disk = first(reader, messages)
    assert from_disk.usage.cached_tokens_by_tier == {"disk": from_disk.usage.prompt_tokens}
    for r in (cold, full, from_disk):
        assert_bitwise(r, reference)


def test_a_stored_chunk_without_logits_costs_one_token():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    engine = engine_for(model, tok)
    longer = first(engine, ["A system prompt that is shared. " * 3, "Then a question?"])
    shorter = first(engine, ["A system prompt that is shared. " * 3])
    assert shorter.usage.recomputed_tokens == 1 and longer.usage.prompt_tokens > shorter.usage.prompt_tokens
    assert_bitwise(shorter, first(engine_for(model, tok), ["A system prompt that is shared. " * 3]))
    # logits kept now
    assert first(engine, ["A system prompt that is shared. " * 3]).usage.recomputed_tokens == 0


def test_prewarming_never_changes_the_answer_and_serves_most_of_the_prompt(tmp_path):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    prefix, doc = "Use the context below.\n\nContext: ", text_of(tok, 400)
    prompt = prefix + doc + "\n\nQuestion: what is the first claim?"
    plain = first(engine_for(model, tok), prompt)
    engine = KVBoostEngine(model, tok, config=EngineConfig(chunk_size=CHUNK), store_dir=tmp_path)
    report = engine.prewarm([doc], prefix=prefix)
    assert report.documents == 1 and report.computed_tokens > 0
    assert engine.canonicalize(prompt).token_ids == engine_for(model, tok).canonicalize(prompt).token_ids
    warm = first(engine, prompt)
    assert_bitwise(warm, plain)
    assert warm.usage.cached_tokens >= 0.9 * warm.usage.prompt_tokens
    engine.close()

    # A fresh process reads the same prompt from the disk tier.
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(__import__("pathlib").Path(__file__).parent)!r})
        from helpers import tiny_model, tiny_tokenizer
        from kvboost_rag import EngineConfig, KVBoostEngine
        engine = KVBoostEngine(tiny_model("llama"), tiny_tokenizer(), config=EngineConfig(chunk_size={CHUNK}),
                               store_dir={str(tmp_path)!r})
        r = engine.generate({prompt!r}, max_new_tokens=6, return_logits=True)
        print(json.dumps({{"disk": r.usage.cached_tokens_by_tier.get("disk", 0),
                          "prompt": r.usage.prompt_tokens,
                          "tokens": r.token_ids, "logits": r.first_logits.tolist()}}))
    """)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["disk"] >= 0.9 * out["prompt"]
    assert out["tokens"] == plain.token_ids
    assert torch.equal(torch.tensor(out["logits"]), plain.first_logits)


def test_chat_turn_two_recomputes_only_the_new_message():
    model, tok = tiny_model("qwen2"), tiny_tokenizer()
    engine = engine_for(model, tok)
    history = [
        {"role": "system", "content": "You are terse. " * 4},
        {"role": "user", "content": text_of(tok, 120) + " Summarise."},
    ]
    turn1 = engine.generate(history, max_new_tokens=24)
    engine.flush()  # the reply is stored for the next turn after the answer is returned
    question = "And the second point, briefly?"
    history += [{"role": "assistant", "content": turn1.text}, {"role": "user", "content": question}]
    turn2 = first(engine, history)
    assert turn2.usage.recomputed_tokens <= len(tok.encode(question)) + 32
    assert_bitwise(turn2, first(engine_for(model, tok), history))


def test_replies_are_not_stored_when_turned_off():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    engine = engine_for(model, tok, store_replies=False)
    history = [{"role": "user", "content": "Say something long."}]
    engine.generate(history, max_new_tokens=16)
    entries = engine.stats()["memory"]["entries"]
    engine.flush()
    assert engine.stats()["memory"]["entries"] == entries


# -- the probe and the fallback ---------------------------------------------------------------


def test_probe_passes_for_the_tiny_models_and_is_remembered(tmp_path, monkeypatch):
    model = tiny_model("llama")
    engine = engine_for(model, tiny_tokenizer(), prefill_schedule="canonical")
    memo = tmp_path / "probes.json"
    calls = []
    real = invariance.check_split_invariance
    monkeypatch.setattr(
        invariance, "check_split_invariance", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    first_report = invariance.remembered_invariance(engine.assembler, 400, "ns", memo)
    again = invariance.remembered_invariance(engine.assembler, 400, "ns", memo)
    assert first_report.holds and again == first_report and len(calls) == 1
    assert json.loads(memo.read_text())


def test_probe_catches_a_forward_that_depends_on_the_split(monkeypatch):
    engine = engine_for(tiny_model("llama"), tiny_tokenizer(), prefill_schedule="canonical")
    real_forward = engine.assembler.forward

    def noisy(cache, token_ids, start, **kw):  # a platform whose kernels depend on the call's length
        out = real_forward(cache, token_ids, start, **kw)
        with torch.inference_mode():
            for layer in cache.layers:
                layer.keys[..., start:, :] += 1e-6 * len(token_ids)
        return out

    monkeypatch.setattr(engine.assembler, "forward", noisy)
    report = invariance.check_split_invariance(engine.assembler, 400)
    assert not report.holds and "differs" in report.detail


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_failed_probe_falls_back_to_the_canonical_schedule_and_says_so(monkeypatch, dtype):
    failed = InvarianceReport(False, "a forward split at [3] differs from one forward")
    monkeypatch.setattr("kvboost_rag.invariance.remembered_invariance", lambda *a, **k: failed)
    model, tok = tiny_model("llama", dtype), tiny_tokenizer()
    engine = KVBoostEngine(model, tok)
    reuse = engine.stats()["reuse"]
    assert reuse["schedule"] == "canonical" and reuse["chunk_tokens"] == 1024 and "differs" in reuse["note"]
    prompt = [Segment("Shared system text. " * 30), Segment("A question?")]
    cold = first(engine, prompt)
    assert "canonical chunk schedule" in cold.reuse_note
    warm = first(engine, prompt)
    assert warm.usage.cached_tokens == warm.usage.prompt_tokens
    assert_bitwise(warm, cold)
    with pytest.raises(UnsupportedModelError, match="prefill_schedule='auto'"):
        KVBoostEngine(model, tok, config=EngineConfig(prefill_schedule="invariant"))


def test_canonical_schedule_is_exact_with_partial_hits():
    model, tok = tiny_model("mistral"), tiny_tokenizer()
    prompt = [Segment("A shared prefix. " * 12), Segment("The question?")]
    engine = engine_for(model, tok, prefill_schedule="canonical")
    assert engine.reuse_note and engine.stats()["reuse"]["schedule"] == "canonical"
    engine.warm(prompt[:1])
    partial = first(engine, prompt)
    assert 0 < partial.usage.cached_tokens < partial.usage.prompt_tokens
    assert_bitwise(partial, first(engine_for(model, tok, prefill_schedule="canonical", reuse="off"), prompt))


def test_the_schedules_store_under_different_namespaces():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    assert engine_for(model, tok).namespace != engine_for(model, tok, prefill_schedule="canonical").namespace


def test_long_runs_split_by_max_forward_tokens_keep_the_bits():
    model, tok = tiny_model("phi3"), tiny_tokenizer()
    prompt = text_of(tok, 300)
    small_steps = first(engine_for(model, tok, max_forward_tokens=40), prompt)
    assert_bitwise(small_steps, first(engine_for(model, tok), prompt))
