"""Prefix-affinity routing against Ray Serve's power-of-two choices: the same workload, the same run.

A local Ray cluster, ``--replicas`` engine replicas of SmolLM2 (one torch thread and one CPU each)
behind the OpenAI ingress (``kvboost_rag.ray``), each replica's memory tier sized to hold about
half of the workload's KV (``--memory-mb``; with a shared disk tier every prompt token is computed
once: ~6,400 tokens, ~150 MB of bfloat16 KV and stored last logits): the case routing is for,
where N replicas' memories together hold what one cannot. Two set-ups (``--shared-tiers``): the
replicas share a disk tier (what a replica lacks in memory it reads from disk), or nothing
(``kvboost-rag serve``'s default: memory only, what a replica lacks it computes). ``--clients``
threads stream chat requests over HTTP:

- D documents x Q questions (system message, the document, a question), in a shuffled order;
- C multi-turn chats of T turns (each turn after the previous answer: the conversation grows).

Per routing (``prefix``: Ray's ``PrefixCacheAffinityRouter`` with the queue-imbalance bound;
``pow2``: Ray's default), each on a fresh store and fresh replicas, rounds alternating which goes
first: the share of prompt tokens read from a replica's memory (its memory tier, or the held
context of a request it served: ``--held-context-tokens`` each, the last request's by default),
the disk tier and computed; TTFT (first content delta at the client) p50/p95; requests per second;
failures.
Before each measured run every replica answers a few unrelated warm-up requests.

Target (issue): affinity routing's memory share >= 1.5x pow2's, TTFT p50 lower, req/s not lower.

    python benchmarks/ray_routing.py [--quick] [--rounds 2] [--clients 4] [--replicas 2]
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import socket
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_MODEL, RESULTS_DIR, essay_text, text_of_tokens, write_results  # noqa: E402

SYSTEM = "Answer from the document in one or two sentences."
QUESTIONS = [
    "What is the main point?",
    "Which example stands out?",
    "Who is the intended reader?",
    "What would the author do first?",
    "Name one claim you could test.",
    "What is the tone?",
]
APP = "kvboost-bench"


@dataclass
class Sample:
    kind: str
    status: int
    ttft_s: float = 0.0
    prompt_tokens: int = 0
    tiers: dict[str, int] = field(default_factory=dict)
    reply: str = ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ask(client: httpx.Client, messages: list[dict[str, str]], max_tokens: int, kind: str) -> Sample:
    body = {
        "model": "bench",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft, reply, report, usage = 0.0, [], None, None
    try:
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                return Sample(kind, response.status_code)
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return Sample(kind, 500)
                for choice in event.get("choices", []):
                    text = choice["delta"].get("content") or ""
                    if text and not ttft:
                        ttft = time.perf_counter() - t0
                    reply.append(text)
                report = event.get("kvboost", report)
                usage = event.get("usage") or usage
    except httpx.HTTPError:
        return Sample(kind, 0)
    if report is None or usage is None:
        return Sample(kind, 500)
    ttft = ttft or time.perf_counter() - t0  # an answer whose first delta was empty
    return Sample(kind, 200, ttft, usage["prompt_tokens"], report["cached_tokens_by_tier"], "".join(reply))


def workload(tokenizer: Any, args: argparse.Namespace) -> tuple[list[str], list[list[str]]]:
    """Documents (``--doc-tokens`` each) and chats (``--turns`` user messages each) from the essays."""
    text = essay_text()
    documents = [
        text_of_tokens(tokenizer, text, args.doc_tokens, offset_tokens=k * args.doc_tokens)
        for k in range(args.documents)
    ]
    base = args.documents * args.doc_tokens
    chats = [
        [
            text_of_tokens(tokenizer, text, 120, offset_tokens=base + (c * args.turns + t) * 120)
            + "\nWhat do you make of this?"
            for t in range(args.turns)
        ]
        for c in range(args.chats)
    ]
    return documents, chats


def run_routing(
    routing: str, shared: str, args: argparse.Namespace, documents: list[str], chats: list[list[str]]
) -> dict:
    from ray import serve

    from kvboost_rag.ray import IngressOptions, ReplicaSpec, build_app

    store = tempfile.mkdtemp(prefix=f"kvboost-ray-{routing}-") if shared == "disk" else None
    spec = ReplicaSpec(
        args.model,
        store_dir=store,
        engine={"max_memory_bytes": args.memory_mb * 2**20, "held_context_tokens": args.held_context_tokens},
        torch_threads=1,
    )
    app = build_app(
        spec,
        replicas=args.replicas,
        routing=routing,  # type: ignore[arg-type]
        imbalanced_queue=args.imbalanced_queue,
        options=IngressOptions(model_name="bench", max_queue=256, request_timeout_s=600),
        replica_cpus=1.0,
    )
    serve.run(app, name=APP, route_prefix="/")
    base_url = f"http://127.0.0.1:{args.port}"
    with httpx.Client(base_url=base_url, timeout=600) as client:  # warm-up, unrecorded
        for k in range(2 * args.replicas):
            ask(client, [{"role": "user", "content": f"Warm-up {k}: say hello."}], 4, "warmup")

    tasks: list[tuple[str, Any]] = [
        ("document", (d, q)) for d in range(len(documents)) for q in range(args.questions)
    ]
    tasks += [("chat", c) for c in range(len(chats))]
    random.Random(args.seed).shuffle(tasks)
    pending: queue.Queue[tuple[str, Any]] = queue.Queue()
    for task in tasks:
        pending.put(task)
    samples: list[Sample] = []
    lock = threading.Lock()

    def client_loop() -> None:
        with httpx.Client(base_url=base_url, timeout=600) as client:
            while True:
                try:
                    kind, what = pending.get_nowait()
                except queue.Empty:
                    return
                if kind == "document":
                    d, q = what
                    content = f"{documents[d]}\n\n{QUESTIONS[q % len(QUESTIONS)]}"
                    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}]
                    got = [ask(client, messages, args.max_tokens, "document")]
                else:
                    messages, got = [{"role": "system", "content": "You are a helpful assistant."}], []
                    for turn in chats[what]:
                        messages.append({"role": "user", "content": turn})
                        sample = ask(client, messages, args.max_tokens, "chat")
                        got.append(sample)
                        if sample.status != 200:
                            break
                        messages.append({"role": "assistant", "content": sample.reply})
                with lock:
                    samples.extend(got)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client_loop) for _ in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    serve.delete(APP)
    return summarize(routing, samples, elapsed) | {"shared_tier": shared}


def in_memory(tiers: dict[str, int]) -> int:
    """Prompt tokens a replica read from its memory: its memory tier and its held contexts."""
    return tiers.get("memory", 0) + tiers.get("context", 0)


def summarize(routing: str, samples: list[Sample], elapsed_s: float) -> dict[str, Any]:
    ok = [s for s in samples if s.status == 200]
    prompt = sum(s.prompt_tokens for s in ok) or 1
    tiers: dict[str, int] = {}
    for s in ok:
        for tier, n in s.tiers.items():
            tiers[tier] = tiers.get(tier, 0) + n
    ttfts = sorted(s.ttft_s for s in ok)
    by_kind = {}
    for kind in ("document", "chat"):
        mine = [s for s in ok if s.kind == kind]
        if mine:
            by_kind[kind] = {
                "requests": len(mine),
                "memory_share": sum(in_memory(s.tiers) for s in mine) / sum(s.prompt_tokens for s in mine),
                "ttft_p50_s": statistics.median(s.ttft_s for s in mine),
            }
    return {
        "routing": routing,
        "requests": len(samples),
        "failures": len(samples) - len(ok),
        "elapsed_s": elapsed_s,
        "req_per_s": len(ok) / elapsed_s,
        "prompt_tokens": prompt,
        "memory_share": in_memory(tiers) / prompt,
        "context_share": tiers.get("context", 0) / prompt,
        "disk_share": tiers.get("disk", 0) / prompt,
        "computed_share": 1 - sum(tiers.values()) / prompt,
        "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
        "ttft_p95_s": ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))] if ttfts else None,
        "by_kind": by_kind,
    }


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    setups = [(shared, routing) for shared in ("disk", "none") for routing in ("prefix", "pow2")]
    setups = [(t, r) for t, r in setups if any(x["shared_tier"] == t and x["routing"] == r for x in runs)]
    for ax, key, label in (
        (axes[0], "memory_share", "prompt tokens from memory"),
        (axes[1], "ttft_p50_s", "TTFT p50 (s)"),
        (axes[2], "req_per_s", "requests / s"),
    ):
        for i, (shared, routing) in enumerate(setups):
            values = [r[key] for r in runs if r["routing"] == routing and r["shared_tier"] == shared]
            color = "C0" if routing == "prefix" else "C1"
            ax.scatter([i] * len(values), values, color=color)
            ax.bar(i, statistics.median(values), alpha=0.3, color=color)
        ax.set_xticks(
            range(len(setups)),
            [f"{r}\n{'shared disk' if t == 'disk' else 'no shared tier'}" for t, r in setups],
        )
        ax.set_title(label)
    fig.suptitle("Ray Serve, 2 replicas: prefix-affinity routing vs power of two (each dot a run)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--documents", type=int, default=6)
    parser.add_argument("--doc-tokens", type=int, default=600)
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--chats", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--memory-mb", type=int, default=74, help="each replica's memory tier (MiB)")
    parser.add_argument(
        "--held-context-tokens",
        type=int,
        default=1024,
        help="each replica's held contexts (the last request's)",
    )
    parser.add_argument("--rounds", type=int, default=2, help="each routing once per round")
    parser.add_argument("--routings", nargs="+", default=["prefix", "pow2"], choices=["prefix", "pow2"])
    parser.add_argument("--shared-tiers", nargs="+", default=["disk", "none"], choices=["disk", "none"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--imbalanced-queue", type=int, default=3, help="prefix routing goes by load past this queue gap"
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.quick:
        args.documents, args.questions, args.chats, args.turns, args.rounds = 4, 3, 2, 3, 1
    out = args.out or RESULTS_DIR / ("ray_routing-quick.json" if args.quick else "ray_routing.json")

    import ray
    from ray import serve
    from transformers import AutoTokenizer

    from kvboost_rag.models import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model))
    documents, chats = workload(tokenizer, args)
    ray.init(num_cpus=args.replicas, include_dashboard=False, log_to_driver=False)
    args.port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    runs = []
    try:
        for shared in args.shared_tiers:
            for r in range(args.rounds):
                shift = r % len(args.routings)  # each round starts with another routing
                for routing in args.routings[shift:] + args.routings[:shift]:
                    run = run_routing(routing, shared, args, documents, chats) | {"round": r}
                    runs.append(run)
                    print(
                        f"shared {shared:>4} round {r} {routing:>6}: memory {run['memory_share']:.0%} "
                        f"disk {run['disk_share']:.0%} "
                        f"computed {run['computed_share']:.0%}; TTFT p50 {run['ttft_p50_s'] * 1000:.0f} ms "
                        f"p95 {run['ttft_p95_s'] * 1000:.0f} ms; {run['req_per_s']:.2f} req/s; "
                        f"{run['failures']} failures",
                        flush=True,
                    )
    finally:
        serve.shutdown()
        ray.shutdown()
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "port")}
    write_results(out, settings=settings, runs=runs)
    plot(runs, out.with_suffix(".png"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
