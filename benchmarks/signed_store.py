"""What signed store entries cost: disk-tier TTFT with and without a store secret, side by side.

One process, one model, two disk stores holding the same document (real essay text): one
unsigned, one with ``EngineConfig(store_secret=...)`` (every entry read is checked with
HMAC-SHA256). Each repetition empties both memory tiers and asks a new question about the
document through each engine in turn; the ratio is taken per repetition.

    python benchmarks/signed_store.py            # 2K and 8K tokens, 7 repetitions
    python benchmarks/signed_store.py --quick    # 2K only, 3 repetitions
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, essay_text, summary, text_of_tokens, write_results  # noqa: E402

from kvboost_rag import EngineConfig, KVBoostEngine, Segment  # noqa: E402
from kvboost_rag.models import load_model  # noqa: E402

MODEL = "smollm2-135m-instruct"
SECRET = "benchmark-secret-" + "x" * 16


def measure(model: object, tokenizer: object, doc: str, reps: int) -> dict:
    with tempfile.TemporaryDirectory() as plain_dir, tempfile.TemporaryDirectory() as signed_dir:
        engines = {
            "unsigned": KVBoostEngine(model, tokenizer, store_dir=plain_dir),
            "signed": KVBoostEngine(
                model, tokenizer, store_dir=signed_dir, config=EngineConfig(store_secret=SECRET)
            ),
        }
        for engine in engines.values():
            engine.generate([Segment(doc, "document"), Segment("\n\nQuestion?")], max_new_tokens=1)
            engine.flush()  # the document's chunks are on disk
        ttft: dict[str, list[float]] = {name: [] for name in engines}
        for r in range(reps):
            for name, engine in engines.items():
                engine.store.tiers[0].clear()  # read from the disk tier
                prompt = [Segment(doc, "document"), Segment(f"\n\nQuestion {r}: what is the main point?")]
                result = engine.generate(prompt, max_new_tokens=1)
                assert result.usage.cached_tokens_by_tier.get("disk", 0) > 0, result.usage
                ttft[name].append(result.timings.ttft_s)
        prompt_tokens = result.usage.prompt_tokens
        for engine in engines.values():
            engine.close()
    return {
        "prompt_tokens": prompt_tokens,
        "unsigned_ttft_s": summary(ttft["unsigned"]),
        "signed_ttft_s": summary(ttft["signed"]),
        "signed_over_unsigned": summary(
            [s / u for s, u in zip(ttft["signed"], ttft["unsigned"], strict=True)]
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    model, tokenizer = load_model(MODEL, dtype=args.dtype)
    text = essay_text()
    rows = []
    for n in [2048] if args.quick else [2048, 8000]:
        row = measure(
            model,
            tokenizer,
            text_of_tokens(tokenizer, text, n - 24, offset_tokens=10_000),
            3 if args.quick else 7,
        )
        rows.append(row)
        ratio = row["signed_over_unsigned"]
        print(
            f"{row['prompt_tokens']} tokens from disk: "
            f"unsigned {row['unsigned_ttft_s']['median'] * 1000:.0f} ms, "
            f"signed {row['signed_ttft_s']['median'] * 1000:.0f} ms (signed/unsigned "
            f"{ratio['median']:.2f}x, quartiles {ratio['q1']:.2f}-{ratio['q3']:.2f}x)",
            flush=True,
        )
    out = RESULTS_DIR / ("signed_store-quick.json" if args.quick else "signed_store.json")
    write_results(out, model=MODEL, dtype=args.dtype, rows=rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
