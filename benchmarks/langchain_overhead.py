"""What the LangChain layer adds to TTFT: ChatKVBoost.stream vs the engine's own stream, same
messages, warm path (the shared prefix is cached, so overhead is not hidden by prefill),
alternating in each repetition. Target: <= 5 %.

    python benchmarks/langchain_overhead.py [--reps 15]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, essay_text, machine, summary, text_of_tokens  # noqa: E402
from langchain_core.messages import HumanMessage, SystemMessage  # noqa: E402

from langchain_kvboost import ChatKVBoost  # noqa: E402
from langchain_kvboost.messages import to_chat_messages  # noqa: E402


def first_item_s(iterator) -> float:
    t0 = time.perf_counter()
    for _ in iterator:
        return time.perf_counter() - t0
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    llm = ChatKVBoost(model="smollm2-135m-instruct", max_tokens=8)
    engine = llm.engine
    context = text_of_tokens(engine.tokenizer, essay_text(), 2000, offset_tokens=5000)
    engine_ttft, langchain_ttft = [], []

    def messages(tag: str) -> list:
        # a new question each call: the shared context is cached, the question is not
        return [
            SystemMessage("Answer from the text.\n\n" + context),
            HumanMessage(f"Question {tag}: what is it about?"),
        ]

    for r in range(args.reps + 1):
        e = first_item_s(engine.stream(to_chat_messages(messages(f"{r:03d}e")), max_new_tokens=8))
        lc = first_item_s(llm.stream(messages(f"{r:03d}l")))
        if r:  # the first round fills the cache
            engine_ttft.append(e)
            langchain_ttft.append(lc)
    ratio = summary([lc / e for lc, e in zip(langchain_ttft, engine_ttft, strict=True)])
    row = {
        "engine_ttft": summary(engine_ttft),
        "langchain_ttft": summary(langchain_ttft),
        "langchain_over_engine": ratio,
    }
    print(
        f"engine {row['engine_ttft']['median'] * 1000:.1f} ms, "
        f"LangChain {row['langchain_ttft']['median'] * 1000:.1f} ms:"
        f" LangChain/engine {ratio['median']:.3f}x (IQR {ratio['q1']:.3f}-{ratio['q3']:.3f})"
    )
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "langchain_overhead.json").write_text(json.dumps({"machine": machine(), **row}, indent=2))


if __name__ == "__main__":
    main()
