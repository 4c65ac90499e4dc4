"""Contracts 1 and 2 on the real offline models (SmolLM2-135M, Qwen2.5-0.5B tokenizer) and real text."""

from __future__ import annotations

import pytest
import torch
from helpers import essay_paragraphs

from kvboost_rag import EngineConfig, KVBoostEngine, Segment
from kvboost_rag.canonical import Canonicalizer
from kvboost_rag.keys import make_namespace, plan_chunks

pytestmark = pytest.mark.real_model

SYSTEM = "You are a careful assistant. Answer the question from the documents only."


def rag_messages(docs: list[str], question: str) -> list[dict]:
    blocks = [{"type": "text", "text": f"Document {i + 1}:\n{d}\n\n"} for i, d in enumerate(docs)]
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": [*blocks, {"type": "text", "text": question}]},
    ]


@pytest.fixture(scope="module")
def smol_fp32(smollm2):
    model, tok = smollm2
    return model, tok


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_smollm2_cold_partial_full_are_bitwise_identical(smol_fp32, dtype):
    model32, tok = smol_fp32
    model = model32 if dtype == torch.float32 else _bf16_copy(model32)
    docs = essay_paragraphs(3)
    messages = rag_messages(docs, "What is the first document about? One sentence.")
    cfg = EngineConfig(chunk_size=64)
    ref = KVBoostEngine(model, tok, config=cfg.model_copy(update={"reuse": "off"})).generate(
        messages, max_new_tokens=10, return_logits=True
    )
    engine = KVBoostEngine(model, tok, config=cfg)
    engine.warm(rag_messages(docs[:1], "")[:1])  # only the system prompt: a partial hit
    partial = engine.generate(messages, max_new_tokens=10, return_logits=True)
    full = engine.generate(messages, max_new_tokens=10, return_logits=True)
    assert 0 < partial.usage.cached_tokens < partial.usage.prompt_tokens
    assert full.usage.cached_tokens == full.usage.prompt_tokens
    for r in (partial, full):
        assert torch.equal(r.first_logits, ref.first_logits)
        assert r.token_ids == ref.token_ids


_BF16 = {}


def _bf16_copy(model):
    import copy

    if "m" not in _BF16:
        _BF16["m"] = copy.deepcopy(model).to(torch.bfloat16)
    return _BF16["m"]


def test_smollm2_greedy_equals_hf_generate_on_real_prompts(smol_fp32):
    """Greedy tokens equal HF ``generate`` on the same canonical ids (float32), for 10 real-text prompts."""
    model, tok = smol_fp32
    engine = KVBoostEngine(model, tok, config=EngineConfig(chunk_size=128))
    paragraphs = essay_paragraphs(20, min_chars=400, max_chars=1200)
    questions = ["Summarize the documents in one sentence.", "What is the main claim of the first document?"]
    eos = sorted(engine.eos_ids)
    for i in range(10):
        messages = rag_messages(paragraphs[2 * i : 2 * i + 2], questions[i % 2])
        ours = engine.generate(messages, max_new_tokens=12)
        engine.flush()  # the reply is stored in the background: let it finish before using the model directly
        ids = torch.tensor([engine.canonicalize(messages).token_ids])
        with torch.inference_mode():
            hf = model.generate(
                ids, max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=eos[0]
            )
        assert ours.token_ids == hf[0, ids.shape[1] :].tolist(), f"prompt {i}"


def test_smollm2_a_chat_turn_sent_at_once_reads_the_reply_bitwise(smol_fp32):
    """The reply's KV is stored with the answer (decode steps have a prefill's bits), so a turn sent
    at once, as an agent loop sends it, recomputes only what is new, with no background re-prefill."""
    model, tok = smol_fp32
    engine = KVBoostEngine(model, tok)
    queued = []
    engine.generation.followups.submit = queued.append  # type: ignore[method-assign]
    history = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Name three primary colours, comma separated, nothing else."},
    ]
    turn1 = engine.generate(history, max_new_tokens=48)
    assert turn1.finish_reason == "stop" and turn1.usage.completion_tokens > 3
    assert not queued  # stored with the answer
    question = "Now name one more."
    history += [{"role": "assistant", "content": turn1.text}, {"role": "user", "content": question}]
    turn2 = engine.generate(history, max_new_tokens=8, return_logits=True)
    assert turn2.usage.recomputed_tokens <= len(tok.encode(question)) + 32
    fresh = KVBoostEngine(model, tok).generate(history, max_new_tokens=8, return_logits=True)
    assert fresh.usage.cached_tokens == 0
    assert turn2.token_ids == fresh.token_ids and torch.equal(turn2.first_logits, fresh.first_logits)


@pytest.fixture(scope="module")
def qwen_tokenizer():
    from transformers import AutoTokenizer

    from kvboost_rag.errors import MissingModelPackageError
    from kvboost_rag.models import converted_alias_dir

    try:
        return AutoTokenizer.from_pretrained(converted_alias_dir("qwen2.5-coder-0.5b-instruct"))
    except MissingModelPackageError as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("which", ["smollm2", "qwen2.5"])
def test_real_tokenizers_keep_boundaries_stable_and_round_trip(which, request):
    tok = (
        request.getfixturevalue("smol_fp32")[1]
        if which == "smollm2"
        else request.getfixturevalue("qwen_tokenizer")
    )
    canon = Canonicalizer(tok)
    docs = essay_paragraphs(6)
    ns = make_namespace(model="m")
    for i, doc in enumerate(docs):
        before, after = docs[i - 1], docs[(i + 1) % len(docs)]
        alone = canon.canonicalize([Segment(doc, "document")])
        inside = canon.canonicalize([Segment(before), Segment(doc, "document"), Segment(after)])
        assert inside.segment_token_ids[1] == alone.segment_token_ids[0]
        assert canon.decode(inside.token_ids) == inside.text
        # what follows a document never changes its chunks' keys
        head = plan_chunks(canon.canonicalize([Segment(before), Segment(doc)]), 64, ns)
        assert plan_chunks(inside, 64, ns)[: len(head)] == head
    messages = rag_messages(docs[:3], "Why?\r\nReally?")
    c = canon.canonicalize(messages)
    assert canon.decode(c.token_ids) == c.text
    assert c.text == tok.apply_chat_template(
        [
            {
                **m,
                "content": m["content"]
                if isinstance(m["content"], str)
                else "".join(b["text"] for b in m["content"]),
            }
            for m in messages
        ],
        tokenize=False,
        add_generation_prompt=True,
    ).replace("\r\n", "\n")


@pytest.mark.parametrize("prefix_tokens", [300, 700, 1500])
def test_smollm2_flat_prompts_reuse_a_shared_prefix_to_within_64_tokens(smol_fp32, prefix_tokens):
    """A flat prompt sharing a prefix of P tokens (cut mid-word) with a stored one reads >= P - 64 of them,
    and its first logits are bitwise those of a fresh engine with an empty store."""
    model, tok = smol_fp32
    text = " ".join(essay_paragraphs(30, max_chars=3000))
    shared = tok.decode(tok.encode(text, add_special_tokens=False)[:prefix_tokens])[:-2]
    engine = KVBoostEngine(model, tok)
    assert engine.stats()["reuse"] == {
        "schedule": "invariant",
        "chunk_tokens": 64,
        "probe": engine.invariance.detail,
        "note": None,
    }
    engine.generate(shared + " What is the main point?", max_new_tokens=1)
    prompt = shared + " Which example stands out?"
    warm = engine.generate(prompt, max_new_tokens=4, return_logits=True)
    cold = KVBoostEngine(model, tok).generate(prompt, max_new_tokens=4, return_logits=True)
    assert warm.usage.cached_tokens >= len(engine.canonicalize(shared)) - 64
    assert torch.equal(warm.first_logits, cold.first_logits) and warm.token_ids == cold.token_ids
