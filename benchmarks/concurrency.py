"""Concurrent requests that share a 1K-token prefix and ask distinct questions, on SmolLM2.

Three ways to serve the same N requests, all arriving at once, measured side by side in
each repetition:
- batched: N threads call ``engine.generate`` together; the scheduler serves them in batches;
- one-by-one: the same engine serves them one after another (the shared prefix is warm);
- plain HF: ``model.generate`` on each full prompt, one after another (no reuse).

Reported per mode: throughput (requests/s and generated tokens/s) and request latency
(arrival to completion) p50/p95. Target: batched >= 3x the throughput of one-by-one.

    python benchmarks/concurrency.py [--clients 8 32] [--reps 3] [--max-new-tokens 24] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, essay_text, machine, summary, text_of_tokens  # noqa: E402

from kvboost_rag import EngineConfig, GenerationResult, KVBoostEngine  # noqa: E402

TOPICS = ["startups", "users", "money", "programming", "investors", "ideas", "hiring", "growth"]
MODES = ("batched", "one_by_one", "plain_hf")


def prompts(context: str, n: int) -> list[list[dict[str, str]]]:
    system = "Answer the question from the text, in one sentence.\n\n" + context
    return [
        [
            {"role": "system", "content": system},
            {
                "role": "user",
                "content": f"Question {k + 1}: what does the text say about {TOPICS[k % len(TOPICS)]}?",
            },
        ]
        for k in range(n)
    ]


def run_batched(engine: KVBoostEngine, requests: list, max_new: int) -> tuple[list[float], int]:
    finished: list[float] = [0.0] * len(requests)
    tokens: list[int] = [0] * len(requests)
    start = threading.Barrier(len(requests) + 1)

    def client(i: int) -> None:
        start.wait()
        result = engine.generate(requests[i], max_new_tokens=max_new)
        finished[i], tokens[i] = time.perf_counter(), result.usage.completion_tokens

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return [f - t0 for f in finished], sum(tokens)


def run_one_by_one(engine: KVBoostEngine, requests: list, max_new: int) -> tuple[list[float], int]:
    t0, latencies, tokens = time.perf_counter(), [], 0
    for request in requests:
        result: GenerationResult = engine.generate(request, max_new_tokens=max_new)
        latencies.append(time.perf_counter() - t0)
        tokens += result.usage.completion_tokens
    return latencies, tokens


@torch.inference_mode()
def run_plain_hf(engine: KVBoostEngine, requests: list, max_new: int) -> tuple[list[float], int]:
    t0, latencies, tokens = time.perf_counter(), [], 0
    for request in requests:
        ids = torch.tensor([engine.canonicalize(request).token_ids])
        out = engine.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new,
            do_sample=False,
            pad_token_id=engine.tokenizer.eos_token_id,
        )
        latencies.append(time.perf_counter() - t0)
        tokens += out.shape[1] - ids.shape[1]
    return latencies, tokens


def measure(latencies: list[float], tokens: int) -> dict[str, float]:
    wall = max(latencies)
    return {
        "requests_per_s": len(latencies) / wall,
        "tokens_per_s": tokens / wall,
        "p50_s": statistics.median(latencies),
        "p95_s": sorted(latencies)[max(0, round(0.95 * len(latencies)) - 1)],
        "wall_s": wall,
        "generated_tokens": tokens,
    }


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_l) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.25
    for m, mode in enumerate(MODES):
        xs = [i + (m - 1) * width for i in range(len(rows))]
        ax_t.bar(xs, [r[mode]["requests_per_s"]["median"] for r in rows], width, label=mode.replace("_", " "))
        p50 = [r[mode]["p50_s"]["median"] for r in rows]
        p95 = [r[mode]["p95_s"]["median"] for r in rows]
        ax_l.bar(xs, p95, width, alpha=0.35, color=f"C{m}")
        ax_l.bar(xs, p50, width, color=f"C{m}", label=f"{mode.replace('_', ' ')} p50 (p95 light)")
    for ax, title in ((ax_t, "throughput (requests/s)"), (ax_l, "latency (s)")):
        ax.set_xticks(range(len(rows)), [f"{r['clients']} clients" for r in rows])
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.suptitle("Requests sharing a 1K-token prefix, SmolLM2-135M (medians over repetitions)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--prefix-tokens", type=int, default=1000)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--window-ms", type=float, default=20.0, help="the scheduler's batch window")
    parser.add_argument("--out", default=str(RESULTS_DIR / "concurrency.json"))
    args = parser.parse_args()

    config = EngineConfig(batch_window_ms=args.window_ms, max_batch_size=max(args.clients))
    engine = KVBoostEngine.from_pretrained("smollm2-135m-instruct", dtype=args.dtype, config=config)
    context = text_of_tokens(engine.tokenizer, essay_text(), args.prefix_tokens, offset_tokens=20000)
    engine.generate(prompts(context, 1)[0], max_new_tokens=1)  # the shared prefix is warm for every mode
    runners = {"batched": run_batched, "one_by_one": run_one_by_one, "plain_hf": run_plain_hf}

    rows = []
    for n in args.clients:
        requests = prompts(context, n)
        samples: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
        ratios: list[float] = []
        for rep in range(args.reps):
            for mode in MODES:
                samples[mode].append(measure(*runners[mode](engine, requests, args.max_new_tokens)))
            ratios.append(
                samples["batched"][-1]["requests_per_s"] / samples["one_by_one"][-1]["requests_per_s"]
            )
            print(
                f"{n} clients, rep {rep + 1}: "
                + ", ".join(
                    f"{mode} {samples[mode][-1]['requests_per_s']:.2f} req/s "
                    f"p50 {samples[mode][-1]['p50_s']:.1f} s"
                    for mode in MODES
                ),
                flush=True,
            )
        row: dict[str, Any] = {"clients": n, "batched_over_one_by_one": summary(ratios)}
        for mode in MODES:
            row[mode] = {key: summary([s[key] for s in samples[mode]]) for key in samples[mode][0]}
        row["batched_over_plain_hf"] = summary(
            [
                b["requests_per_s"] / p["requests_per_s"]
                for b, p in zip(samples["batched"], samples["plain_hf"], strict=True)
            ]
        )
        rows.append(row)
        print(
            f"{n} clients: batched / one-by-one throughput {row['batched_over_one_by_one']['median']:.2f}x, "
            f"batched / plain HF {row['batched_over_plain_hf']['median']:.2f}x",
            flush=True,
        )

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    out.write_text(json.dumps({"machine": machine(), "settings": settings, "rows": rows}, indent=2))
    plot(rows, out.with_suffix(".png"))
    engine.close()
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
