"""Store codecs side by side: bytes per token, TTFT from the disk tier, and what the lossy ones cost
in answers.

Per model and codec (``kvboost_rag.store.codecs``):

- size: bytes per prompt token of the stored entries (files on disk), and the ratio to ``raw``;
- TTFT: a document of each length is stored through the codec, then a new engine over that store
  (empty memory tier, page cache warm) asks new questions about it; next to it the cold path
  (an empty store) and the floor of the ``raw`` codec (the bytes of the chunks laid, at the
  measured read bandwidth, plus the prefill of the new tokens, whose logits give the first token);
- quality, lossy codecs: the blend benchmark's passages (one planted fact among 3-6 essay
  passages) are stored through the codec under another question, then the real questions are
  asked over them from disk (their first token computed over the decoded KV); reported against exact mode
  (the same prompts, bitwise reuse): answer agreement, first-token KL(exact || codec). The
  model's own agreement across document orders (``exact_reordered``, same questions) is the
  noise level those figures sit on; the target is int8 agreement >= it.

    python benchmarks/store_codecs.py [--models smollm2-135m-instruct qwen2.5-coder-0.5b-instruct]
        [--lengths 2048 8000] [--questions 30] [--quick]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from blend_quality import against, answer_of, make_questions, messages, reordered  # noqa: E402
from common import RESULTS_DIR, essay_text, machine, summary, text_of_tokens  # noqa: E402
from disk_ttft import QUESTION, read_bandwidth  # noqa: E402

from kvboost_rag import EngineConfig, KVBoostEngine, Segment  # noqa: E402
from kvboost_rag.models import load_model  # noqa: E402
from kvboost_rag.store.codecs import CODECS  # noqa: E402

MAX_NEW_TOKENS = 20
WARM_QUESTION = "Which of these passages is the longest?"
"""Asked once about each question's passages, to store them through the codec."""


def store_bytes(store_dir: Path) -> int:
    return sum(f.stat().st_size for f in (store_dir / "kv").rglob("*.val"))


def engine_for(model: Any, tok: Any, store_dir: str | Path, codec: str) -> KVBoostEngine:
    return KVBoostEngine(model, tok, config=EngineConfig(store_codec=codec), store_dir=store_dir)


def ttft_row(model: Any, tok: Any, doc: str, codec: str, reps: int) -> dict[str, Any]:
    """Disk-tier and cold TTFT of new questions about ``doc`` stored through ``codec``."""
    with tempfile.TemporaryDirectory() as store:
        with engine_for(model, tok, store, codec) as writer:
            writer.generate([Segment(doc, "document"), Segment(f"\n\n{QUESTION}")], max_new_tokens=1)
            writer.flush()
        nbytes = store_bytes(Path(store))
        disk, cold, bandwidth, floor_compute = [], [], [], []
        with engine_for(model, tok, store, codec) as reader:
            memory = reader.store.tiers[0]
            reader.generate("Hello", max_new_tokens=1)  # touches no stored document
            for r in range(reps):
                memory.clear()
                # new from its first token, so the question's chunk is computed whole, as the floor's is
                prompt = [Segment(doc, "document"), Segment(f"\n\n({r}) {QUESTION}")]
                warm = reader.generate(prompt, max_new_tokens=1)
                reused = warm.usage.cached_tokens_by_tier.get("disk", 0) + warm.usage.approx_tokens
                assert reused > 0, warm.usage
                disk.append(warm.timings.ttft_s)
                with (
                    tempfile.TemporaryDirectory() as empty,
                    engine_for(model, tok, empty, "raw") as cold_engine,
                ):
                    cold.append(cold_engine.generate(prompt, max_new_tokens=1).timings.ttft_s)
                bandwidth.append(read_bandwidth(Path(store)))
                seconds, read_bytes = _new_tokens_s(reader, prompt)
                floor_compute.append(seconds)
        prompt_tokens = warm.usage.prompt_tokens
    floors = [read_bytes / bw + c for bw, c in zip(bandwidth, floor_compute, strict=True)]
    return {
        "codec": codec,
        "prompt_tokens": prompt_tokens,
        "reused_tokens": reused,
        "approximate": warm.usage.approx_tokens > 0,
        "stored_bytes": nbytes,
        "bytes_per_token": nbytes / prompt_tokens,
        "disk_s": summary(disk),
        "cold_s": summary(cold),
        "floor_s": summary(floors),
        "floor_laid_bytes": read_bytes,
        "floor_read_s": summary([read_bytes / bw for bw in bandwidth]),
        "floor_compute_s": summary(floor_compute),
        "computed_tokens": prompt_tokens - reused,
        "cold_over_disk": summary([c / d for c, d in zip(cold, disk, strict=True)]),
        "disk_over_floor": summary([d / f for d, f in zip(disk, floors, strict=True)]),
    }


def _new_tokens_s(engine: KVBoostEngine, prompt: list[Segment]) -> tuple[float, int]:
    """Prefill of the prompt's last chunk over its stored prefix (the compute part of the floor: the
    first token comes from these logits), and the bytes of the stored chunks it lays as decoded (for
    the raw codec, their payloads)."""
    canonical = engine.canonicalize(prompt)
    chunks = engine.core.chunks(canonical)
    cache = engine.assembler.new_cache(len(canonical) + 2)
    read_bytes = 0
    for chunk in chunks[:-1]:
        hit = engine.store.get(chunk.key)
        assert hit is not None
        read_bytes += hit.chunk.nbytes
        engine.assembler.append(cache, hit.chunk.kv)
    ids = canonical.token_ids
    engine.flush()  # the reads' queued access-time updates would otherwise run beside the timed forward
    t0 = time.perf_counter()
    engine.assembler.forward(cache, ids[chunks[-1].start :], chunks[-1].start)
    return time.perf_counter() - t0, read_bytes


def quality_rows(model: Any, tok: Any, n_questions: int, codecs: list[str]) -> list[dict[str, Any]]:
    """Answers from entries of each lossy codec against exact mode, and exact mode in another order."""
    passages, questions = make_questions(tok, n_questions, 250, seed=0)
    rng = random.Random(1)

    def answers(store: str, codec: str, qs: list[dict], max_new_tokens: int = MAX_NEW_TOKENS) -> list[Any]:
        with engine_for(model, tok, store, codec) as engine:
            engine.store.tiers[0].clear()
            return [
                engine.generate(messages(passages, q), max_new_tokens=max_new_tokens, return_logits=True)
                for q in qs
            ]

    with tempfile.TemporaryDirectory() as store:
        exact = answers(store, "raw", questions)
        shuffled = answers(store, "raw", [reordered(q, rng) for q in questions])
    rows = [_compare("exact_reordered", shuffled, exact, questions)]
    for codec in codecs:
        with tempfile.TemporaryDirectory() as store:
            # the passages go through the codec under another question, so the real question is new
            # and its first token is computed over the decoded KV (not read with the stored logits)
            answers(store, codec, [{**q, "question": WARM_QUESTION} for q in questions], max_new_tokens=1)
            from_codec = answers(store, codec, questions)
        assert all(r.usage.approx_tokens > 0 for r in from_codec)
        rows.append(_compare(codec, from_codec, exact, questions))
    return rows


def _compare(mode: str, replies: list[Any], exact: list[Any], questions: list[dict]) -> dict[str, Any]:
    checks = [against(r, e, q["answer"]) for r, e, q in zip(replies, exact, questions, strict=True)]
    n = len(checks)
    return {
        "mode": mode,
        "questions": n,
        "answer_agreement": sum(c["agree"] for c in checks) / n,
        "text_agreement": sum(c["same_text"] for c in checks) / n,
        "top1_agreement": sum(c["top1"] for c in checks) / n,
        "kl_first_token": summary([c["kl"] for c in checks]),
        "accuracy": sum(c["correct"] for c in checks) / n,
        "exact_accuracy": sum(answer_of(e.text) == q["answer"] for e, q in zip(exact, questions, strict=True))
        / n,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["smollm2-135m-instruct"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[2048, 8000])
    parser.add_argument("--questions", type=int, default=30)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quick", action="store_true", help="2K only, 3 repetitions, 8 questions")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.quick:
        args.lengths, args.reps, args.questions = [2048], 3, 8
    lossy = [name for name, codec in CODECS.items() if codec.approximate]
    results = []
    for name in args.models:
        model, tok = load_model(name, dtype=args.dtype)
        ttft = []
        for n in args.lengths:
            doc = text_of_tokens(tok, essay_text(), n - 24, offset_tokens=10_000)
            for codec in CODECS:
                row = ttft_row(model, tok, doc, codec, args.reps)
                ttft.append(row)
                print(
                    f"{name} {row['prompt_tokens']} tok {codec:>4}: "
                    f"{row['bytes_per_token'] / 1024:.1f} KiB/token, "
                    f"disk {row['disk_s']['median'] * 1000:.0f} ms, cold {row['cold_s']['median']:.2f} s "
                    f"(cold/disk {row['cold_over_disk']['median']:.1f}x, disk/floor "
                    f"{row['disk_over_floor']['median']:.2f}x)",
                    flush=True,
                )
        quality = quality_rows(model, tok, args.questions, lossy)
        for q in quality:
            print(
                f"{name} {q['mode']:>15}: answer agreement {q['answer_agreement']:.0%}, "
                f"KL p50 {q['kl_first_token']['median']:.4f}",
                flush=True,
            )
        results.append({"model": name, "ttft": ttft, "quality": quality})
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    out = (
        Path(args.out)
        if args.out
        else RESULTS_DIR / ("store_codecs-quick.json" if args.quick else "store_codecs.json")
    )
    out.write_text(json.dumps({"machine": machine(), "settings": vars(args), "results": results}, indent=2))
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and .png")


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    size_ax, ttft_ax = axes
    codecs = list(CODECS)
    for k, result in enumerate(results):
        rows = [r for r in result["ttft"] if r["prompt_tokens"] == result["ttft"][0]["prompt_tokens"]]
        size_ax.bar(
            [i + 0.4 * k for i in range(len(rows))],
            [r["bytes_per_token"] / 1024 for r in rows],
            0.4,
            label=result["model"],
        )
        for length in sorted({r["prompt_tokens"] for r in result["ttft"]}):
            at = [r for r in result["ttft"] if r["prompt_tokens"] == length]
            ttft_ax.plot(
                codecs,
                [r["cold_over_disk"]["median"] for r in at],
                marker="o",
                label=f"{result['model']}, {length} tokens",
            )
    size_ax.set_xticks([i + 0.2 * (len(results) - 1) for i in range(len(codecs))], codecs)
    size_ax.set_ylabel("stored KiB per prompt token")
    size_ax.legend(fontsize=8)
    ttft_ax.set_ylabel("cold TTFT / disk-tier TTFT (median)")
    ttft_ax.set_yscale("log")
    ttft_ax.legend(fontsize=8)
    fig.suptitle("Store codecs: entry size and TTFT from disk")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
