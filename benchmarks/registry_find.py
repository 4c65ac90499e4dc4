"""Finding registered documents in a flat prompt: 100k registered documents, 8K-character prompts.
Target: < 5 ms per prompt.

    python benchmarks/registry_find.py [--documents 100000]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, essay_text, machine, summary  # noqa: E402

from kvboost_rag.registry import DocumentRegistry  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--documents", type=int, default=100_000)
    parser.add_argument("--prompts", type=int, default=50)
    args = parser.parse_args()
    words = essay_text().split()
    rng = random.Random(0)

    def passage(n_words: int) -> str:
        start = rng.randrange(len(words) - n_words)
        return " ".join(words[start : start + n_words])

    docs = [f"[{i}] " + passage(rng.randint(40, 120)) for i in range(args.documents)]
    with tempfile.TemporaryDirectory() as tmp:
        registry = DocumentRegistry(Path(tmp) / "documents.sqlite")
        t0 = time.perf_counter()
        registry.register(docs)
        register_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        reopened = DocumentRegistry(Path(tmp) / "documents.sqlite")  # loads every document's anchor
        load_s = time.perf_counter() - t0
        times, found = [], []
        for _ in range(args.prompts):
            picked = rng.sample(docs, 3)
            # three registered documents, then unregistered text up to 8000 characters
            prompt = ("Answer from the documents.\n\n" + "\n\n".join(picked) + "\n\n" + passage(1500))[:8000]
            t0 = time.perf_counter()
            matches = reopened.find(prompt)
            times.append(time.perf_counter() - t0)
            found.append(sum(prompt[m.start : m.end] in picked for m in matches))
    row = {
        "documents": args.documents,
        "prompt_chars": 8000,
        "find_s": summary(times),
        "register_s": register_s,
        "reopen_load_s": load_s,
        "found_per_prompt": summary(found),
    }
    print(
        f"{args.documents} documents: find {row['find_s']['median'] * 1000:.2f} ms median "
        f"(max {row['find_s']['max'] * 1000:.2f} ms) per 8K-char prompt; register {register_s:.1f} s, "
        f"reopen {load_s:.2f} s; {row['found_per_prompt']['median']:.0f} documents found per prompt"
    )
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "registry_find.json").write_text(json.dumps({"machine": machine(), **row}, indent=2))


if __name__ == "__main__":
    main()
