"""Blend reuse quality and speed: RAG questions over real essays, documents in shuffled orders.

Each question plants one fact ("The access code of the amber vault is 4817.") into one
essay passage; a prompt holds that passage and 2-5 other passages in random order, then
asks for the fact. All passages are pre-warmed once (after the prompt's own prefix, as
an indexing step would), so exact mode reuses the first passage only, and blend reuses
every passage wherever it lands.

Per model, the same prompts run in exact mode and in blend mode at each recompute ratio,
side by side. Reported per mode: answer agreement with exact mode (the code a reader takes
from each greedy reply is the same; full-text agreement is reported too),
first-token top-1 agreement, KL(exact || blend) of the first-token distributions,
exact-match accuracy against the planted fact, TTFT (median and quartiles), and the TTFT
speedup over exact mode measured on the same prompt. Target: >= 98 % agreement at
>= 4x TTFT over exact mode.

For scale, each model also answers every question in exact mode with the same passages
in another order (``exact_reordered``): how often a model agrees with itself when only the
retrieval order changes is the noise level that any agreement figure sits on.

    python benchmarks/blend_quality.py [--models smollm2-135m-instruct qwen2.5-coder-0.5b-instruct]
        [--questions 30 24] [--ratios 0 0.05 0.15 0.3] [--passage-tokens 250] [--quick]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, essay_text, machine, summary, text_of_tokens  # noqa: E402

from kvboost_rag import EngineConfig, KVBoostEngine  # noqa: E402
from kvboost_rag.canonical import segments_before  # noqa: E402

COLORS = ["amber", "cobalt", "crimson", "emerald", "ivory", "jade", "scarlet", "silver", "teal", "violet"]
THINGS = ["vault", "locker", "gate", "archive", "cabinet", "hangar"]
SYSTEM = "You answer questions using only the documents given."
MARKER = "\x00DOCS\x00"
STOPS = ["\n", "."]  # the first sentence is the answer


def user_message(docs: str, question: str) -> str:
    return f"Documents:\n\n{docs}\n\nQuestion: {question} Answer with the code only."


def plant(passage: str, fact: str, rng: random.Random) -> str:
    """Insert ``fact`` as its own sentence at a random sentence boundary of ``passage``."""
    cuts = [i + 2 for i in range(len(passage) - 2) if passage[i] == "." and passage[i + 1] == " "]
    at = rng.choice(cuts) if cuts else len(passage)
    return f"{passage[:at]}{fact} {passage[at:]}"


def make_questions(
    tokenizer: Any, n_questions: int, passage_tokens: int, seed: int
) -> tuple[list[str], list[dict]]:
    """Passages and questions: passage ``q`` holds question ``q``'s fact; the others come from a pool
    of passages without facts, so exactly one passage in a prompt answers its question."""
    rng = random.Random(seed)
    text = essay_text()
    n_passages = n_questions + max(12, n_questions // 2)
    passages = [
        text_of_tokens(tokenizer, text, passage_tokens, 4000 + k * passage_tokens * 3).strip()
        for k in range(n_passages)
    ]
    questions = []
    for q in range(n_questions):
        color, thing = COLORS[q % len(COLORS)], THINGS[(q // len(COLORS)) % len(THINGS)]
        code = str(rng.randrange(1000, 10000))
        passages[q] = plant(passages[q], f"The access code of the {color} {thing} is {code}.", rng)
        order = [q, *rng.sample(range(n_questions, n_passages), rng.randint(2, 5))]
        rng.shuffle(order)
        questions.append(
            {"docs": order, "question": f"What is the access code of the {color} {thing}?", "answer": code}
        )
    return passages, questions


def answer_of(text: str) -> str:
    """The answer a reader takes from a reply: its first 4-digit number, else its first line."""
    found = re.search(r"\b\d{4}\b", text)
    return found.group(0) if found else text.strip().split("\n")[0]


def messages(passages: list[str], q: dict) -> list[dict[str, str]]:
    docs = "\n\n".join(passages[k] for k in q["docs"])
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": user_message(docs, q["question"])},
    ]


def reordered(q: dict, rng: random.Random) -> dict:
    """``q`` with the same passages in another order."""
    order = list(q["docs"])
    while order == q["docs"]:
        rng.shuffle(order)
    return {**q, "docs": order}


def against(r: Any, exact: Any, answer: str) -> dict[str, Any]:
    """How reply ``r`` compares with the exact-mode reply to the same question."""
    return {
        "agree": answer_of(r.text) == answer_of(exact.text),
        "same_text": r.text == exact.text,
        "top1": int(r.first_logits.argmax()) == int(exact.first_logits.argmax()),
        "kl": kl(exact.first_logits, r.first_logits),
        "correct": answer_of(r.text) == answer,
    }


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p = torch.log_softmax(p_logits.double(), -1)
    q = torch.log_softmax(q_logits.double(), -1)
    return float((p.exp() * (p - q)).sum())


def run_model(name: str, n_questions: int, args: argparse.Namespace) -> dict[str, Any]:
    engine = KVBoostEngine.from_pretrained(
        name,
        dtype=args.dtype,
        max_memory_bytes=8 * 1024**3,
        blend_boundary_tokens=args.boundary_tokens,
        blend_select_layer=args.select_layer,
    )
    passages, questions = make_questions(engine.tokenizer, n_questions, args.passage_tokens, args.seed)
    # Pre-warm every passage after the exact text that precedes the documents in the prompt.
    rendered = engine.canonicalizer.render_messages(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user_message(MARKER, "")}]
    )
    report = engine.prewarm(passages, prefix=segments_before(rendered, MARKER))
    print(
        f"{name}: pre-warmed {report.documents} passages, {report.tokens} tokens in {report.seconds:.1f} s",
        flush=True,
    )
    modes = [f"blend_{int(r * 100)}" for r in args.ratios]
    per_mode: dict[str, dict[str, list]] = {
        m: {
            k: []
            for k in ("ttft", "speedup", "agree", "same_text", "top1", "kl", "correct", "approx", "select_s")
        }
        for m in [*modes, "exact"]
    }
    reference: dict[str, list] = {k: [] for k in ("agree", "same_text", "top1", "kl", "correct")}
    order_rng = random.Random(args.seed + 1)
    records: list[dict[str, Any]] = []
    for n, q in enumerate(questions):
        prompt = messages(passages, q)
        # Blend first: exact mode stores the whole prompt, after which blend would hit it exactly.
        blends = {}
        for ratio, mode in zip(args.ratios, modes, strict=True):
            blends[mode] = engine.generate(
                prompt,
                reuse="blend",
                blend_recompute_ratio=ratio,
                max_new_tokens=args.max_new_tokens,
                stop=STOPS,
                return_logits=True,
            )
        exact = engine.generate(
            prompt, reuse="exact", max_new_tokens=args.max_new_tokens, stop=STOPS, return_logits=True
        )
        other = engine.generate(
            messages(passages, reordered(q, order_rng)),
            reuse="exact",
            max_new_tokens=args.max_new_tokens,
            stop=STOPS,
            return_logits=True,
        )
        for key, value in against(other, exact, q["answer"]).items():
            reference[key].append(value)
        records.append(
            {
                "docs": len(q["docs"]),
                "prompt_tokens": exact.usage.prompt_tokens,
                "answer": q["answer"],
                **{
                    mode: {"text": r.text, "ttft_s": r.timings.ttft_s, "approx_tokens": r.usage.approx_tokens}
                    for mode, r in [*blends.items(), ("exact", exact)]
                },
                "exact_reordered": {"text": other.text},
            }
        )
        for mode, r in [*blends.items(), ("exact", exact)]:
            row = per_mode[mode]
            row["ttft"].append(r.timings.ttft_s)
            row["speedup"].append(exact.timings.ttft_s / r.timings.ttft_s)
            for key, value in against(r, exact, q["answer"]).items():
                row[key].append(value)
            row["approx"].append(r.usage.approx_tokens / r.usage.prompt_tokens)
            row["select_s"].append(r.timings.select_s)
        print(
            f"  q{n + 1:>3} docs={len(q['docs'])} tokens={exact.usage.prompt_tokens} "
            f"exact ttft={exact.timings.ttft_s:.2f}s "
            + " ".join(
                f"{m}:{'=' if answer_of(blends[m].text) == answer_of(exact.text) else 'x'}"
                f"{exact.timings.ttft_s / blends[m].timings.ttft_s:.1f}x"
                for m in modes
            ),
            flush=True,
        )
    engine.close()

    def agreement(mode: str, row: dict[str, list]) -> dict[str, Any]:
        return {
            "model": name,
            "mode": mode,
            "questions": len(row["agree"]),
            "answer_agreement": statistics.mean(row["agree"]),
            "text_agreement": statistics.mean(row["same_text"]),
            "top1_agreement": statistics.mean(row["top1"]),
            "kl_first_token": summary(row["kl"]),
            "exact_match_accuracy": statistics.mean(row["correct"]),
        }

    rows = [
        {
            **agreement(mode, row),
            "ttft_s": summary(row["ttft"]),
            "speedup_vs_exact": summary(row["speedup"]),
            "approx_share": statistics.mean(row["approx"]),
            "select_s": summary(row["select_s"]),
            "speedup_by_docs": {
                str(d): summary(
                    [s for s, q in zip(row["speedup"], questions, strict=True) if len(q["docs"]) == d]
                )
                for d in sorted({len(q["docs"]) for q in questions})
            },
        }
        for mode, row in per_mode.items()
    ]
    rows.append(agreement("exact_reordered", reference))
    return {"model": name, "rows": rows, "questions": records}


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_a, ax_s) = plt.subplots(1, 2, figsize=(11, 4))
    for res in results:
        rows = [r for r in res["rows"] if r["mode"].startswith("blend")]
        own = next(r for r in res["rows"] if r["mode"] == "exact_reordered")
        ratios = [int(r["mode"].split("_")[1]) for r in rows]
        (line,) = ax_a.plot(
            ratios, [100 * r["answer_agreement"] for r in rows], marker="o", label=f"{res['model']} answers"
        )
        ax_a.axhline(
            100 * own["answer_agreement"],
            color=line.get_color(),
            linestyle="-.",
            linewidth=0.8,
            label=f"{res['model']} exact, documents reordered",
        )
        ax_a.plot(
            ratios,
            [100 * r["top1_agreement"] for r in rows],
            marker="x",
            linestyle="--",
            label=f"{res['model']} top-1",
        )
        speed = [r["speedup_vs_exact"] for r in rows]
        ax_s.errorbar(
            ratios,
            [s["median"] for s in speed],
            yerr=[[s["median"] - s["q1"] for s in speed], [s["q3"] - s["median"] for s in speed]],
            marker="o",
            capsize=3,
            label=res["model"],
        )
    ax_a.axhline(98, color="grey", linestyle=":", label="target 98 %")
    ax_a.set(xlabel="recompute ratio (%)", ylabel="agreement with exact mode (%)", title="Quality")
    ax_s.axhline(4, color="grey", linestyle=":", label="target 4x")
    ax_s.set(xlabel="recompute ratio (%)", ylabel="TTFT speedup over exact (median, IQR)", title="Speed")
    ax_a.legend(fontsize=7)
    ax_s.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models", nargs="+", default=["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"]
    )
    parser.add_argument(
        "--questions",
        type=int,
        nargs="+",
        default=[30, 24],
        help="questions per model, in --models order (the last count repeats)",
    )
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.0, 0.05, 0.15, 0.3])
    parser.add_argument("--passage-tokens", type=int, default=250)
    parser.add_argument("--max-new-tokens", type=int, default=20)
    parser.add_argument("--boundary-tokens", type=int, default=EngineConfig().blend_boundary_tokens)
    parser.add_argument("--select-layer", type=int, default=EngineConfig().blend_select_layer)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="6 questions, SmolLM2 only")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "blend_quality.json")
    args = parser.parse_args()
    if args.quick:
        args.questions, args.models = [6], args.models[:1]
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    counts = [args.questions[min(i, len(args.questions) - 1)] for i in range(len(args.models))]
    results = [run_model(name, n, args) for name, n in zip(args.models, counts, strict=True)]
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "machine": machine(),
                "settings": settings,
                "seconds": time.perf_counter() - t0,
                "results": results,
            },
            indent=2,
        )
    )
    plot(results, args.out.with_suffix(".png"))
    for res in results:
        for r in res["rows"]:
            if r["mode"] == "exact_reordered":
                print(
                    f"{r['model']:<30} exact, documents reordered: "
                    f"agree {100 * r['answer_agreement']:5.1f}%  "
                    f"top1 {100 * r['top1_agreement']:5.1f}%  KL {r['kl_first_token']['median']:.4f}"
                )
                continue
            print(
                f"{r['model']:<30} {r['mode']:<9} agree {100 * r['answer_agreement']:5.1f}%  "
                f"top1 {100 * r['top1_agreement']:5.1f}%  "
                f"KL {r['kl_first_token']['median']:.4f}  acc {100 * r['exact_match_accuracy']:5.1f}%  "
                f"TTFT {r['ttft_s']['median']:.3f}s  speedup {r['speedup_vs_exact']['median']:.2f}x"
            )
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
