"""Store codecs side by side: bytes per token, TTFT from the disk and Redis tiers, and what the lossy
ones cost in answers.

Per model and codec (``kvboost_rag.store.codecs``):

- size: bytes per prompt token of the stored entries (files on disk, strings in Redis);
- TTFT: a document of each length is stored through the codec in a tier (a disk store; a local
  ``redis-server`` this script starts, where one is installed), then a new engine over it (memory
  tier emptied before each request, page cache warm) asks new questions about it; every repetition
  asks each codec and tier the same question, then times the cold path (an empty store) on it, so
  the ratios are of times measured side by side. Next to them the floor of each row: the bytes of
  the chunks laid (as decoded) at the tier's read bandwidth measured on its entries, plus the
  prefill of the new tokens, whose logits give the first token;
- quality, lossy codecs: the blend benchmark's passages (one planted fact among 3-6 essay
  passages) are stored through the codec under another question, then the real questions are
  asked over them from disk (their first token computed over the decoded KV); reported against exact mode
  (the same prompts, bitwise reuse): answer agreement, first-token KL(exact || codec). The
  model's own agreement across document orders (``exact_reordered``, same questions) is the
  noise level those figures sit on; the target is int8 agreement >= it.

    python benchmarks/store_codecs.py [--models smollm2-135m-instruct qwen2.5-coder-0.5b-instruct]
        [--lengths 2048 8000] [--questions 24] [--reps 5] [--tiers disk redis] [--quick]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack, closing
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
from blend_quality import against, answer_of, make_questions, messages, reordered  # noqa: E402
from common import RESULTS_DIR, essay_text, local_redis, machine, summary, text_of_tokens  # noqa: E402
from disk_ttft import QUESTION, read_bandwidth  # noqa: E402

from kvboost_rag import EngineConfig, KVBoostEngine, Segment  # noqa: E402
from kvboost_rag.models import load_model  # noqa: E402
from kvboost_rag.store.codecs import CODECS  # noqa: E402

MAX_NEW_TOKENS = 20
WARM_QUESTION = "Which of these passages is the longest?"
"""Asked once about each question's passages, to store them through the codec."""


class Reader:
    """An engine reading one document's entries of one codec back from one tier (memory tier emptied
    before each timed request), and what it measured."""

    def __init__(self, model: Any, tok: Any, codec: str, tier: str, where: str, prefix: str) -> None:
        self.codec, self.tier, self.where, self.prefix = codec, tier, where, prefix
        if tier == "disk":
            self.config, self.store_dir = EngineConfig(store_codec=codec), where
        else:
            self.config = EngineConfig(store_codec=codec, redis_url=where, redis_key_prefix=prefix)
            self.store_dir = None
        self.stored_bytes = sum(self.payload_sizes().values())
        self.engine = self.open(model, tok)
        self.engine.generate("Hello", max_new_tokens=1)  # touches no stored document
        self.warm_s: list[float] = []
        self.bandwidth: list[float] = []
        self.compute_s: list[float] = []

    def open(self, model: Any, tok: Any) -> KVBoostEngine:
        return KVBoostEngine(model, tok, config=self.config, store_dir=self.store_dir)

    def payload_sizes(self) -> dict[Any, int]:
        """Stored entries (files, or Redis strings) and their sizes in bytes."""
        if self.tier == "disk":
            return {f: f.stat().st_size for f in (Path(self.where) / "kv").rglob("*.val")}
        client = redis.Redis.from_url(self.where)
        keys = [
            k for k in client.scan_iter(match=f"{self.prefix}:*", count=1000) if client.type(k) == b"string"
        ]
        return {k: client.strlen(k) for k in keys}

    def ask(self, prompt: list[Segment], *, record: bool) -> Any:
        self.engine.store.tiers[0].clear()
        reply = self.engine.generate(prompt, max_new_tokens=1)
        assert reply.usage.cached_tokens_by_tier.get(self.tier, 0) + reply.usage.approx_tokens > 0, (
            reply.usage
        )
        self.engine.flush()  # its queued access-time updates would otherwise run beside the next timing
        if record:
            self.warm_s.append(reply.timings.ttft_s)
            self.bandwidth.append(self.read_bandwidth())
            seconds, self.laid_bytes = _new_tokens_s(self.engine, prompt)
            self.compute_s.append(seconds)
        return reply

    def read_bandwidth(self) -> float:
        """Bytes per second reading every stored entry of this tier (page cache as it is)."""
        if self.tier == "disk":
            return read_bandwidth(Path(self.where))
        client = redis.Redis.from_url(self.where)
        sizes = self.payload_sizes()
        t0 = time.perf_counter()
        for key in sizes:
            client.get(key)
        return sum(sizes.values()) / (time.perf_counter() - t0)

    def row(self, reply: Any, cold_s: list[float]) -> dict[str, Any]:
        floors = [self.laid_bytes / bw + c for bw, c in zip(self.bandwidth, self.compute_s, strict=True)]
        reused = reply.usage.cached_tokens_by_tier.get(self.tier, 0) + reply.usage.approx_tokens
        return {
            "codec": self.codec,
            "tier": self.tier,
            "prompt_tokens": reply.usage.prompt_tokens,
            "reused_tokens": reused,
            "approximate": reply.usage.approx_tokens > 0,
            "stored_bytes": self.stored_bytes,
            "bytes_per_token": self.stored_bytes / reply.usage.prompt_tokens,
            "warm_s": summary(self.warm_s),
            "cold_s": summary(cold_s),
            "floor_s": summary(floors),
            "floor_laid_bytes": self.laid_bytes,
            "read_bandwidth_bytes_s": summary(self.bandwidth),
            "floor_read_s": summary([self.laid_bytes / bw for bw in self.bandwidth]),
            "floor_compute_s": summary(self.compute_s),
            "computed_tokens": reply.usage.prompt_tokens - reused,
            "cold_over_warm": summary([c / w for c, w in zip(cold_s, self.warm_s, strict=True)]),
            "warm_over_floor": summary([w / f for w, f in zip(self.warm_s, floors, strict=True)]),
        }

    def close(self) -> None:
        self.engine.close()


def ttft_rows(
    model: Any, tok: Any, doc: str, codecs: list[str], tiers: dict[str, str | None], reps: int
) -> list[dict[str, Any]]:
    """Warm TTFT of new questions about ``doc`` from each tier through each codec, and the cold path.

    Each repetition asks every reader the same new question, then the cold path: every row's ratios
    are of times measured side by side. Repetition 0 is not recorded: a process's first long request
    pays the page faults of fresh buffers (~0.3 s at 8K tokens), which a serving process pays once.
    """
    with ExitStack() as stack:
        readers = []
        for codec in codecs:
            store_dir = stack.enter_context(tempfile.TemporaryDirectory())
            # its own key prefix: the same chunk keys hold another codec's entries under another
            prefix = f"kvboost-codecs-{codec}-{uuid.uuid4().hex[:8]}"
            config = EngineConfig(store_codec=codec, redis_url=tiers.get("redis"), redis_key_prefix=prefix)
            with KVBoostEngine(model, tok, config=config, store_dir=store_dir) as writer:
                writer.generate([Segment(doc, "document"), Segment(f"\n\n{QUESTION}")], max_new_tokens=1)
                writer.flush()
            for tier, url in tiers.items():
                where = store_dir if tier == "disk" else url
                assert where is not None
                readers.append(stack.enter_context(closing(Reader(model, tok, codec, tier, where, prefix))))
        cold: list[float] = []
        for r in range(reps + 1):
            # new from its first token, so the question's chunk is computed whole, as the floor's is
            prompt = [Segment(doc, "document"), Segment(f"\n\n({r}) {QUESTION}")]
            replies = [reader.ask(prompt, record=r > 0) for reader in readers]
            with tempfile.TemporaryDirectory() as empty, KVBoostEngine(model, tok, store_dir=empty) as engine:
                seconds = engine.generate(prompt, max_new_tokens=1).timings.ttft_s
            if r > 0:
                cold.append(seconds)
        return [reader.row(reply, cold) for reader, reply in zip(readers, replies, strict=True)]


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
        with KVBoostEngine(model, tok, config=EngineConfig(store_codec=codec), store_dir=store) as engine:
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
    parser.add_argument(
        "--models", nargs="+", default=["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"]
    )
    parser.add_argument("--lengths", nargs="+", type=int, default=[2048, 8000])
    parser.add_argument("--questions", type=int, default=24)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--tiers",
        nargs="+",
        choices=["disk", "redis"],
        default=["disk", "redis"],
        help="Redis rows run against a local redis-server started here",
    )
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quick", action="store_true", help="2K only, 3 repetitions, 8 questions")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.quick:
        args.lengths, args.reps, args.questions = [2048], 3, 8
    lossy = [name for name, codec in CODECS.items() if codec.approximate]
    results = []
    with local_redis() as redis_url:
        if "redis" in args.tiers and redis_url is None:
            print("redis-server is not installed: no Redis rows (apt-get install redis-server)", flush=True)
        tiers = {t: redis_url for t in args.tiers if t == "disk" or redis_url is not None}
        for name in args.models:
            model, tok = load_model(name, dtype=args.dtype)
            ttft = []
            for n in args.lengths:
                doc = text_of_tokens(tok, essay_text(), n - 24, offset_tokens=10_000)
                for row in ttft_rows(model, tok, doc, list(CODECS), tiers, args.reps):
                    ttft.append(row)
                    print(
                        f"{name} {row['prompt_tokens']} tok {row['codec']:>4} {row['tier']:>5}: "
                        f"{row['bytes_per_token'] / 1024:.1f} KiB/token, "
                        f"warm {row['warm_s']['median'] * 1000:.0f} ms, cold {row['cold_s']['median']:.2f} s "
                        f"(cold/warm {row['cold_over_warm']['median']:.1f}x, warm/floor "
                        f"{row['warm_over_floor']['median']:.2f}x)",
                        flush=True,
                    )
                if redis_url is not None:
                    redis.Redis.from_url(redis_url).flushdb()
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
        first = result["ttft"][0]
        rows = [
            r for r in result["ttft"] if r["prompt_tokens"] == first["prompt_tokens"] and r["tier"] == "disk"
        ]
        size_ax.bar(
            [i + 0.4 * k for i in range(len(rows))],
            [r["bytes_per_token"] / 1024 for r in rows],
            0.4,
            label=result["model"],
        )
        for length, tier in sorted({(r["prompt_tokens"], r["tier"]) for r in result["ttft"]}):
            at = [r for r in result["ttft"] if r["prompt_tokens"] == length and r["tier"] == tier]
            ttft_ax.plot(
                codecs,
                [r["cold_over_warm"]["median"] for r in at],
                marker="o" if tier == "disk" else "s",
                linestyle="-" if tier == "disk" else "--",
                label=f"{result['model']}, {length} tokens, {tier}",
            )
    size_ax.set_xticks([i + 0.2 * (len(results) - 1) for i in range(len(codecs))], codecs)
    size_ax.set_ylabel("stored KiB per prompt token")
    size_ax.legend(fontsize=8)
    ttft_ax.set_ylabel("cold TTFT / warm TTFT from the tier (median)")
    ttft_ax.set_yscale("log")
    ttft_ax.legend(fontsize=7)
    fig.suptitle("Store codecs: entry size and TTFT from disk and Redis")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
