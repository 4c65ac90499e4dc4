"""Fine-grained exact reuse: flat prompts sharing a prefix of P tokens, and pre-warming (any model).

Per prefix length P (a flat string cut mid-word), per repetition, back to back:
- a prompt ``shared + question A`` fills the store;
- ``shared + question B`` on that engine (warm) and on a fresh engine with an empty store (cold);
  the first logits must be bitwise equal, the tokens read from the store are reported;
- pre-warming: ``engine.prewarm([doc], prefix)`` then the flat prompt ``prefix + doc + question``,
  against a fresh engine on the same prompt (bitwise equal, share of the prompt read).

Ratios are per repetition, then the median. Targets (DESIGN.md): any shared prefix reused to
within 64 tokens, bitwise; to the token (only the tokens past the longest common prefix with
what is stored are recomputed).

    python benchmarks/prefix_reuse.py [--lengths 300,700,1500] [--reps 3] [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    DEFAULT_MODEL,
    QUESTIONS,
    RESULTS_DIR,
    essay_text,
    summary,
    text_of_tokens,
    write_results,
)

from kvboost_rag import GenerationResult, KVBoostEngine  # noqa: E402
from kvboost_rag.models import load_model  # noqa: E402


def question(i: int) -> str:
    return " " + QUESTIONS[i % len(QUESTIONS)]


def against_fresh(engine: KVBoostEngine, prompt: str) -> tuple[GenerationResult, GenerationResult, bool]:
    """The prompt on ``engine`` (warm) and on a fresh engine with an empty store;
    whether they agree bitwise."""
    warm = engine.generate(prompt, max_new_tokens=1, return_logits=True)
    with KVBoostEngine(engine.model, engine.tokenizer) as fresh:
        cold = fresh.generate(prompt, max_new_tokens=1, return_logits=True)
    return warm, cold, torch.equal(warm.first_logits, cold.first_logits) and warm.token_ids == cold.token_ids


def flat_prefixes(engine: KVBoostEngine, text: str, lengths: list[int], reps: int) -> list[dict]:
    rows = []
    tok = engine.tokenizer
    for p in lengths:
        samples: dict[str, list[float]] = {
            "cold": [],
            "warm": [],
            "reused": [],
            "short_of_prefix": [],
            "past_common": [],
            "speedup": [],
        }
        bitwise = True
        for r in range(reps):
            shared = text_of_tokens(tok, text, p, offset_tokens=p * (r + 1))[:-3]  # ends mid-word
            shared_tokens = len(engine.canonicalize(shared).token_ids)
            engine.generate(shared + question(2 * r), max_new_tokens=1)
            warm, cold, same = against_fresh(engine, shared + question(2 * r + 1))
            stored_ids = engine.canonicalize(shared + question(2 * r)).token_ids
            ids = engine.canonicalize(shared + question(2 * r + 1)).token_ids
            differ = (i for i, (a, b) in enumerate(zip(stored_ids, ids, strict=False)) if a != b)
            common = next(differ, min(len(stored_ids), len(ids)))
            bitwise &= same
            samples["cold"].append(cold.timings.ttft_s)
            samples["warm"].append(warm.timings.ttft_s)
            samples["reused"].append(warm.usage.cached_tokens)
            samples["short_of_prefix"].append(shared_tokens - warm.usage.cached_tokens)
            # tokens recomputed beyond those past the longest common prefix (0: reuse to the token)
            samples["past_common"].append(warm.usage.recomputed_tokens - (len(ids) - common))
            samples["speedup"].append(cold.timings.ttft_s / warm.timings.ttft_s)
        row = {"prefix_tokens": p, "bitwise": bitwise, **{k: summary(v) for k, v in samples.items()}}
        print(
            f"prefix {p}: reused {row['reused']['median']:.0f} tokens (short of the prefix by at most "
            f"{row['short_of_prefix']['max']:.0f}; recomputed beyond the longest common prefix: at most "
            f"{row['past_common']['max']:.0f}), warm {row['warm']['median'] * 1000:.0f} ms vs cold "
            f"{row['cold']['median'] * 1000:.0f} ms ({row['speedup']['median']:.2f}x), bitwise {bitwise}",
            flush=True,
        )
        rows.append(row)
    return rows


def prewarmed(engine: KVBoostEngine, text: str, doc_tokens: int, reps: int) -> dict:
    prefix = "Use the context below to answer.\n\nContext:\n"
    samples: dict[str, list[float]] = {"prewarm_s": [], "warm": [], "cold": [], "read_share": []}
    bitwise = True
    for r in range(reps):
        doc = text_of_tokens(engine.tokenizer, text, doc_tokens, offset_tokens=50_000 + doc_tokens * r)
        t0 = time.perf_counter()
        engine.prewarm([doc], prefix=prefix)
        samples["prewarm_s"].append(time.perf_counter() - t0)
        warm, cold, same = against_fresh(engine, prefix + doc + "\n\nQuestion:" + question(r))
        bitwise &= same
        samples["warm"].append(warm.timings.ttft_s)
        samples["cold"].append(cold.timings.ttft_s)
        samples["read_share"].append(warm.usage.cached_tokens / warm.usage.prompt_tokens)
    row = {"doc_tokens": doc_tokens, "bitwise": bitwise, **{k: summary(v) for k, v in samples.items()}}
    print(
        f"pre-warmed {doc_tokens}-token document: "
        f"{100 * row['read_share']['median']:.1f} % of the prompt read, "
        f"warm {row['warm']['median'] * 1000:.0f} ms vs cold {row['cold']['median'] * 1000:.0f} ms, "
        f"bitwise {bitwise}",
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", default="300,700,1500")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quick", action="store_true", help="one repetition")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="an alias or a local model folder")
    args = parser.parse_args()
    reps = 1 if args.quick else args.reps
    out = args.out or RESULTS_DIR / ("prefix_reuse-quick.json" if args.quick else "prefix_reuse.json")
    t0 = time.perf_counter()
    model, tok = load_model(args.model, dtype=args.dtype)
    engine = KVBoostEngine(model, tok)
    engine.generate("Hello", max_new_tokens=1)  # start-up and the load-time probe, outside the measurements
    text = essay_text()
    lengths = [int(x) for x in args.lengths.split(",")]
    rows = flat_prefixes(engine, text, lengths, reps)
    prewarm_row = prewarmed(engine, text, 1000, reps)
    settings = {
        "model": args.model,
        "dtype": str(next(model.parameters()).dtype),
        "reps": reps,
        "reuse": engine.stats()["reuse"],
    }
    engine.close()
    seconds = time.perf_counter() - t0
    write_results(out, settings=settings, seconds=seconds, flat_prefixes=rows, prewarmed=prewarm_row)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
