"""ChatKVBoost under LangChain's own retrieval chain (``create_retrieval_chain`` with
``create_stuff_documents_chain``: ``"\\n\\n"`` between documents, ``{page_content}`` each) over
documents pre-warmed with ``prewarm_documents``: exact mode reads the opening and the whole first
document and answers as reuse off does; blend reads every document, its last partial chunk
included, whether the context closes the system message or follows the question."""

from __future__ import annotations

import pytest

pytest.importorskip("langchain_classic")

from helpers import essay_paragraphs  # noqa: E402
from langchain_classic.chains import create_retrieval_chain  # noqa: E402
from langchain_classic.chains.combine_documents import create_stuff_documents_chain  # noqa: E402
from langchain_core.callbacks import BaseCallbackHandler  # noqa: E402
from langchain_core.documents import Document  # noqa: E402
from langchain_core.prompts import ChatPromptTemplate, PromptTemplate  # noqa: E402
from langchain_core.retrievers import BaseRetriever  # noqa: E402

from kvboost_rag.canonical import Segment, segments_before  # noqa: E402
from kvboost_rag.shared import close_shared_engines  # noqa: E402
from langchain_kvboost import ChatKVBoost, prewarm_documents  # noqa: E402
from langchain_kvboost.messages import to_chat_messages  # noqa: E402

pytestmark = pytest.mark.real_model

PROMPTS = {
    "context_last": ChatPromptTemplate.from_messages(
        [("system", "Answer from the context below, briefly.\n\nContext: {context}"), ("human", "{input}")]
    ),
    "question_first": ChatPromptTemplate.from_messages(
        [("human", "Answer the question from the context.\nQuestion: {input}\nContext: {context}\nAnswer:")]
    ),
}
QUESTION = "Which point is made first?"


class Fixed(BaseRetriever):
    """The same documents, in the given order, for every query."""

    documents: list[Document]

    def _get_relevant_documents(self, query: str, *, run_manager=None) -> list[Document]:
        return self.documents


@pytest.fixture(scope="module")
def documents() -> list[Document]:
    return [Document(page_content=p) for p in essay_paragraphs(4, min_chars=500, max_chars=1100)]


@pytest.fixture(autouse=True, scope="module")
def _close():
    yield
    close_shared_engines()


class Capture(BaseCallbackHandler):
    """The chat model's reuse report and token usage, per call."""

    def __init__(self) -> None:
        self.reports: list[dict] = []

    def on_llm_end(self, response, **kwargs) -> None:
        message = response.generations[0][0].message
        self.reports.append(message.response_metadata["kvboost"] | {"prompt": message.usage_metadata})


def ask(model: ChatKVBoost, prompt: ChatPromptTemplate, documents: list[Document], **stuff) -> dict:
    """Answer QUESTION over ``documents`` with LangChain's retrieval chain: the answer and the report."""
    combine = create_stuff_documents_chain(model, prompt, **stuff)
    chain = create_retrieval_chain(Fixed(documents=documents), combine)
    capture = Capture()
    out = chain.invoke({"input": QUESTION}, config={"callbacks": [capture]})
    [report] = capture.reports
    return {"answer": out["answer"], **report}


def llm(store: str, **kw) -> ChatKVBoost:
    return ChatKVBoost(model="smollm2-135m-instruct", dtype="float32", max_tokens=12, store_dir=store, **kw)


def tokens(model: ChatKVBoost, text: str) -> int:
    return len(model.engine.canonicalizer.tokenize(text))


def opening(model: ChatKVBoost, prompt: ChatPromptTemplate) -> list[Segment]:
    """The segments of ``prompt`` before its context (the question empty), as pre-warming renders them."""
    marker = "\x02context\x03"
    messages = to_chat_messages(prompt.format_messages(context=marker, input=""))
    return segments_before(model.engine.canonicalizer.segments_of(messages), marker)


def test_exact_reads_the_opening_and_the_whole_first_document(documents, tmp_path):
    prompt = PROMPTS["context_last"]
    model = llm(str(tmp_path / "kv"))
    prewarm_documents(model, documents, prompt, context_variable="context")
    order = [documents[2], documents[0], documents[3]]
    *before, last = opening(model, prompt)
    with_first = [*before, Segment(last.text + order[0].page_content, last.kind)]
    exact = ask(model, prompt, order)
    # the opening and the first document as the prompt tokenizes them, its last partial chunk included
    assert exact["cached_tokens"] >= len(model.engine.canonicalize(with_first, add_generation_prompt=False))
    assert (
        exact["unused_prewarmed_tokens"] > 0
    )  # the other two: exact reads a document after its opening only
    plain = ask(llm(str(tmp_path / "kv"), reuse="off"), prompt, order)
    assert plain["cached_tokens"] == 0 and plain["answer"] == exact["answer"]


@pytest.mark.parametrize("shape", list(PROMPTS))
def test_blend_reads_every_document_whole(documents, tmp_path, shape):
    prompt = PROMPTS[shape]
    model = llm(str(tmp_path / "kv"), reuse="blend")
    prewarm_documents(model, documents, prompt, context_variable="context")
    order = [documents[3], documents[1], documents[0]]
    blend = ask(model, prompt, order)
    document_tokens = sum(tokens(model, d.page_content) for d in order)
    opening_tokens = len(model.engine.canonicalize(opening(model, prompt), add_generation_prompt=False))
    # every document token is read: exactly (the first, where it follows the opening) or blended; a
    # document's first token may tokenize with the text before it (" The" after "Context: ")
    read = blend["cached_tokens"] - min(blend["cached_tokens"], opening_tokens) + blend["blended_tokens"]
    assert read >= document_tokens - len(order)
    assert blend["unused_prewarmed_tokens"] == 0 and blend["approx_tokens"] > 0


def test_a_document_prompt_is_pre_warmed_as_the_chain_renders_it(documents, tmp_path):
    prompt, document_prompt = (
        PROMPTS["context_last"],
        PromptTemplate.from_template("Source: {source}\n{page_content}"),
    )
    sourced = [
        Document(page_content=d.page_content, metadata={"source": f"essay {i}"})
        for i, d in enumerate(documents)
    ]
    model = llm(str(tmp_path / "kv"))
    prewarm_documents(model, sourced, prompt, context_variable="context", document_prompt=document_prompt)
    exact = ask(model, prompt, [sourced[1], sourced[2]], document_prompt=document_prompt)
    first = tokens(model, f"Source: essay 1\n{sourced[1].page_content}")
    assert exact["cached_tokens"] >= first
