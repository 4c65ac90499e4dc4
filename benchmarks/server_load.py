"""Load test of ``kvboost-rag serve``: N concurrent clients on loopback for a fixed time.

Starts the server (``kvboost-rag serve`` in a subprocess, bound to 127.0.0.1 on a free
port), then N client threads send chat requests back to back until the time is up
or the request cap is reached. Every request shares one long system prompt (an
essay excerpt) and asks its own question, so the system prompt's KV is computed
once and read from the store afterwards. By default clients alternate streaming and
non-streaming requests (``--stream mixed``; ``always`` and ``never`` too, several modes
run one after another): streams give the time to the first content delta (TTFT as a
client sees it); streamed and non-streamed requests share the engine's batches.

Recorded: requests, failures (anything but a complete 200 answer; must be 0),
latency p50/p95/p99 (all requests, and per kind), TTFT p50/p95/p99 (streams),
throughput (requests/s, generated tokens/s), the share of prompt tokens read from
the cache, and the server's /metrics counters at the end. Before the server starts, a
fresh interpreter measures single-stream decode ms/token against HF ``generate`` and the
TTFT of a stream that joins 7 decoding ones (in-process engine, nothing else running).

    python benchmarks/server_load.py [--model smollm2-135m-instruct] [--clients 8] [--duration-s 30]
                                     [--max-requests 2000] [--max-tokens 32] [--stream mixed never always]
                                     [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

RESULTS_DIR = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
LOOPBACK = "127.0.0.1"

TOPICS = [
    "startups",
    "users",
    "money",
    "programming",
    "investors",
    "ideas",
    "hiring",
    "growth",
    "schools",
    "cities",
    "writing",
    "taste",
    "wealth",
    "design",
    "work",
    "age",
]


@dataclass
class Sample:
    """One request as a client saw it."""

    stream: bool
    ok: bool
    latency_s: float
    ttft_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


@dataclass
class LoadSettings:
    model: str
    system: str
    clients: int = 8
    duration_s: float = 30.0
    max_requests: int = 2000
    max_tokens: int = 32
    stream: str = "mixed"
    """``mixed`` (clients alternate), ``always`` or ``never``."""
    timeout_s: float = 300.0


def question(client: int, k: int) -> str:
    topic = TOPICS[(client * 7 + k) % len(TOPICS)]
    return f"Question {client}.{k}: in one sentence, what does the text say about {topic}?"


def _messages(settings: LoadSettings, client: int, k: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": settings.system}, {"role": "user", "content": question(client, k)}]


def one_request(
    http: httpx.Client, base_url: str, settings: LoadSettings, client: int, k: int, stream: bool
) -> Sample:
    """Send one chat completion and check that a whole answer came back."""
    body: dict[str, Any] = {
        "model": settings.model,
        "messages": _messages(settings, client, k),
        "max_tokens": settings.max_tokens,
        "temperature": 0,
    }
    t0 = time.perf_counter()
    try:
        if not stream:
            r = http.post(f"{base_url}/v1/chat/completions", json=body)
            if r.status_code != 200:
                return Sample(
                    False, False, time.perf_counter() - t0, error=f"{r.status_code}: {r.text[:200]}"
                )
            data = r.json()
            usage = data["usage"]
            ok = data["choices"][0]["finish_reason"] in ("stop", "length")
            return Sample(
                False,
                ok,
                time.perf_counter() - t0,
                None,
                usage["prompt_tokens"],
                usage["prompt_tokens_details"]["cached_tokens"],
                usage["completion_tokens"],
            )
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        ttft = None
        usage = None
        finished = done = False
        with http.stream("POST", f"{base_url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                return Sample(True, False, time.perf_counter() - t0, error=f"{r.status_code}: {r.text[:200]}")
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: ") :]
                if payload == "[DONE]":
                    done = True
                    break
                event = json.loads(payload)
                if "error" in event:
                    return Sample(True, False, time.perf_counter() - t0, error=event["error"]["message"])
                for choice in event.get("choices", []):
                    if ttft is None and choice["delta"].get("content"):
                        ttft = time.perf_counter() - t0
                    finished = finished or choice.get("finish_reason") is not None
                usage = event.get("usage") or usage
        latency = time.perf_counter() - t0
        if not (done and finished and usage):
            return Sample(
                True, False, latency, ttft, error="the stream ended without finish_reason, usage or [DONE]"
            )
        return Sample(
            True,
            True,
            latency,
            ttft,
            usage["prompt_tokens"],
            usage["prompt_tokens_details"]["cached_tokens"],
            usage["completion_tokens"],
        )
    except (httpx.HTTPError, ValueError, KeyError) as e:
        return Sample(stream, False, time.perf_counter() - t0, error=f"{type(e).__name__}: {e}")


def run_load(base_url: str, settings: LoadSettings) -> dict[str, Any]:
    """Run the clients until the time is up or ``max_requests`` have been sent; return the figures."""
    if not base_url.startswith(f"http://{LOOPBACK}:"):
        raise ValueError(f"the load test only talks to {LOOPBACK}; got {base_url}")
    samples: list[Sample] = []
    lock = threading.Lock()
    sent = [0]
    t_start = time.perf_counter()
    deadline = t_start + settings.duration_s

    def take_slot() -> bool:
        with lock:
            if sent[0] >= settings.max_requests or time.perf_counter() >= deadline:
                return False
            sent[0] += 1
            return True

    def client(i: int) -> None:
        with httpx.Client(timeout=settings.timeout_s) as http:
            k = 0
            while take_slot():
                stream = settings.stream == "always" or (settings.stream == "mixed" and (i + k) % 2 == 0)
                sample = one_request(http, base_url, settings, i, k, stream)
                with lock:
                    samples.append(sample)
                k += 1

    threads = [
        threading.Thread(target=client, args=(i,), name=f"load-client-{i}") for i in range(settings.clients)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t_start
    return summarize(samples, elapsed)


def percentiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    s = sorted(values)

    def pick(q: float) -> float:  # nearest rank: an observed value, no interpolation
        return s[min(len(s) - 1, max(0, int(round(q * len(s) + 0.5)) - 1))]

    return {
        "p50": pick(0.50),
        "p95": pick(0.95),
        "p99": pick(0.99),
        "mean": statistics.fmean(s),
        "max": s[-1],
        "n": len(s),
    }


def summarize(samples: list[Sample], elapsed_s: float) -> dict[str, Any]:
    ok = [s for s in samples if s.ok]
    prompt = sum(s.prompt_tokens for s in ok)
    return {
        "requests": len(samples),
        "failures": len(samples) - len(ok),
        "errors": sorted({s.error for s in samples if s.error})[:5],
        "elapsed_s": elapsed_s,
        "requests_per_s": len(ok) / elapsed_s if elapsed_s > 0 else 0.0,
        "completion_tokens_per_s": sum(s.completion_tokens for s in ok) / elapsed_s if elapsed_s > 0 else 0.0,
        "cached_prompt_share": sum(s.cached_tokens for s in ok) / prompt if prompt else 0.0,
        "latency_s": percentiles([s.latency_s for s in ok]),
        "latency_stream_s": percentiles([s.latency_s for s in ok if s.stream]),
        "latency_non_stream_s": percentiles([s.latency_s for s in ok if not s.stream]),
        "ttft_stream_s": percentiles([s.ttft_s for s in ok if s.stream and s.ttft_s is not None]),
    }


# -- the server process ------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def start_server(model: str, port: int, extra: list[str]) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "kvboost_rag.cli",
        "serve",
        model,
        "--host",
        LOOPBACK,
        "--port",
        str(port),
        "--log-level",
        "warning",
        *extra,
    ]
    return subprocess.Popen(cmd, env=os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})


def wait_healthy(base_url: str, server: subprocess.Popen, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with code {server.returncode} before it was ready")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise SystemExit(f"the server was not ready within {timeout_s:.0f} s")


def server_counters(base_url: str) -> dict[str, float]:
    """The unlabelled counters and gauges of /metrics (tokens, in-flight, queue)."""
    out = {}
    for line in httpx.get(f"{base_url}/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.split(" ")
            out[name] = float(value)
    return out


def system_prompt(tokens: int) -> str:
    """An essay excerpt of about ``tokens`` tokens (SmolLM2's tokenizer averages ~4 characters a token)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import essay_text

    text = essay_text()[40_000 : 40_000 + 4 * tokens]
    return "Answer the question from the text below, in one sentence.\n\n" + text


def single_stream_decode(
    model: Any, tokenizer: Any, system: str, new_tokens: int, reps: int
) -> dict[str, Any]:
    """Decode ms/token of one engine stream against HF ``generate`` on the same model and prompt.

    Both decode ``new_tokens`` greedy tokens after the same chat prompt; a repetition runs both
    side by side. The stream's figure is the time from its first delta to its result over the
    tokens after the first; HF's is (time for ``new_tokens``, minus time for 1) over the same count.
    """
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch
    from common import summary

    from kvboost_rag import EngineConfig, KVBoostEngine

    messages = [{"role": "system", "content": system}, {"role": "user", "content": question(0, 0)}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
    never_stop = {"eos_token_id": None, "pad_token_id": tokenizer.eos_token_id or 0}

    def hf_seconds(n: int) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **never_stop)
        return time.perf_counter() - t0

    engine = KVBoostEngine(model, tokenizer, config=EngineConfig())
    engine.eos_ids = frozenset()  # decode every token, as HF does with min_new_tokens
    stream_ms, hf_ms = [], []
    hf_seconds(2)  # warm-up
    for _ in range(reps + 1):
        t_first, done = None, None
        for piece in engine.stream(messages, max_new_tokens=new_tokens, reuse="off"):
            t_first = t_first or time.perf_counter()
            done = piece.result
        assert done is not None and done.usage.completion_tokens == new_tokens, done
        stream_ms.append((time.perf_counter() - t_first) * 1000 / (new_tokens - 1))
        hf_ms.append((hf_seconds(new_tokens) - hf_seconds(1)) * 1000 / (new_tokens - 1))
    engine.close()
    stream_ms, hf_ms = stream_ms[1:], hf_ms[1:]  # the first repetition warms both up
    return {
        "new_tokens": new_tokens,
        "prompt_tokens": int(ids.shape[1]),
        "stream_decode_ms_per_token": summary(stream_ms),
        "hf_generate_decode_ms_per_token": summary(hf_ms),
        "stream_over_hf": summary([a / b for a, b in zip(stream_ms, hf_ms, strict=True)]),
    }


def joiner_ttft(model: Any, tokenizer: Any, system: str, reps: int, running: int = 7) -> dict[str, Any]:
    """TTFT of a stream that arrives while ``running`` others decode, against the bound
    ``1.5 x lone TTFT + one decode step`` of those rows (in-process engine, no HTTP).

    Every request shares the system prompt (stored by a warm-up request) and asks its own question.
    A repetition times a lone stream's first delta, starts ``running`` long streams, waits until
    they decode steadily, takes one step as the median gap between the first row's last deltas,
    then times the first delta of one more stream, and cancels the long ones.
    """
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from concurrent.futures import CancelledError

    from common import summary

    from kvboost_rag import EngineConfig, KVBoostEngine

    engine = KVBoostEngine(model, tokenizer, config=EngineConfig())
    engine.eos_ids = frozenset()  # the long rows decode until cancelled
    asked = iter(range(1_000_000))

    def messages() -> list[dict[str, str]]:
        k = next(asked)
        return [{"role": "system", "content": system}, {"role": "user", "content": question(k, k)}]

    def first_delta_s(max_new_tokens: int = 4) -> float:
        t0 = time.perf_counter()
        stream = engine.stream(messages(), max_new_tokens=max_new_tokens)
        next(piece for piece in stream if piece.text)
        elapsed = time.perf_counter() - t0
        for _ in stream:  # drain
            pass
        return elapsed

    def consume(stream: Any, stamps: list[float]) -> None:
        try:
            for _ in stream:
                stamps.append(time.perf_counter())
        except CancelledError:  # as the repetition ends
            pass

    engine.generate(messages(), max_new_tokens=1)  # stores the shared system prompt
    first_delta_s()  # warm-up
    lone, joiner, step = [], [], []
    for _ in range(reps):
        lone.append(first_delta_s())
        streams = [engine.stream(messages(), max_new_tokens=256) for _ in range(running)]
        stamps: list[list[float]] = [[] for _ in streams]
        threads = [threading.Thread(target=consume, args=a) for a in zip(streams, stamps, strict=True)]
        for t in threads:
            t.start()
        while min(len(s) for s in stamps) < 12:  # every row decoding, for a few steps
            time.sleep(0.01)
        recent = stamps[0][-8:]
        step.append(statistics.median(b - a for a, b in zip(recent[:-1], recent[1:], strict=True)))
        joiner.append(first_delta_s())
        for s in streams:
            s.cancel()
        for t in threads:
            t.join()
    engine.close()
    bound = [1.5 * a + b for a, b in zip(lone, step, strict=True)]
    return {
        "running_rows": running,
        "lone_ttft_s": summary(lone),
        "step_s": summary(step),
        "joiner_ttft_s": summary(joiner),
        "bound_s": summary(bound),
        "joiner_over_bound": summary([a / b for a, b in zip(joiner, bound, strict=True)]),
    }


def measure_in_process(args: argparse.Namespace, out: Path) -> None:
    """Single-stream decode against HF ``generate`` and a joiner's TTFT, written to ``out`` as JSON."""
    from kvboost_rag.models import load_model

    model, tokenizer = load_model(args.model, dtype=args.dtype)
    system = system_prompt(args.system_tokens)
    decode = single_stream_decode(model, tokenizer, system, 64, 3 if args.quick else 7)
    print(
        f"single-stream decode: {decode['stream_decode_ms_per_token']['median']:.1f} ms/token, HF generate "
        f"{decode['hf_generate_decode_ms_per_token']['median']:.1f} ms/token "
        f"(stream/HF {decode['stream_over_hf']['median']:.2f}x)",
        flush=True,
    )
    joining = joiner_ttft(model, tokenizer, system, 2 if args.quick else 5)
    print(
        f"a stream joining {joining['running_rows']} decoding ones: first delta after "
        f"{joining['joiner_ttft_s']['median']:.2f} s (lone {joining['lone_ttft_s']['median']:.2f} s, "
        f"step {joining['step_s']['median']:.2f} s; over 1.5 x lone + step: "
        f"{joining['joiner_over_bound']['median']:.2f})",
        flush=True,
    )
    out.write_text(json.dumps({"single_stream_decode": decode, "joiner_ttft": joining}))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--duration-s", type=float, default=30.0)
    parser.add_argument("--max-requests", type=int, default=2000, help="hard cap on requests sent")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--system-tokens", type=int, default=1000, help="length of the shared system prompt")
    parser.add_argument(
        "--stream",
        nargs="+",
        default=["mixed"],
        choices=["mixed", "always", "never"],
        help="streaming mix; several run one after another against the same server",
    )
    parser.add_argument("--batch-window-ms", type=float, default=None)
    parser.add_argument("--quick", action="store_true", help="a short system prompt, 2 clients, 10 s")
    parser.add_argument("--out", default=str(RESULTS_DIR / "server_load.json"))
    parser.add_argument("--in-process-only", type=Path, help=argparse.SUPPRESS)  # the child run by main
    args = parser.parse_args()
    if args.quick:
        args.system_tokens, args.clients, args.duration_s, args.max_tokens = 100, 2, 10.0, 16
    if args.in_process_only:
        measure_in_process(args, args.in_process_only)
        return

    # in a fresh interpreter, before the server starts, so that nothing else runs beside it
    # and no state left by the load runs (allocator, page cache) skews the per-token figures
    with tempfile.TemporaryDirectory() as scratch:
        micro_out = Path(scratch) / "in_process.json"
        command = [sys.executable, __file__, "--model", args.model, "--dtype", args.dtype]
        command += ["--system-tokens", str(args.system_tokens), "--in-process-only", str(micro_out)]
        subprocess.run(command + (["--quick"] if args.quick else []), check=True)
        in_process = json.loads(micro_out.read_text())

    port = free_port()
    base_url = f"http://{LOOPBACK}:{port}"
    extra = ["--dtype", args.dtype, "--max-queue", str(max(64, 2 * args.clients))]
    if args.batch_window_ms is not None:
        extra += ["--batch-window-ms", str(args.batch_window_ms)]
    server = start_server(args.model, port, extra)
    runs: list[dict[str, Any]] = []
    try:
        wait_healthy(base_url, server)
        system = system_prompt(args.system_tokens)
        for mode in args.stream:
            settings = LoadSettings(
                model=args.model,
                system=system,
                clients=args.clients,
                duration_s=args.duration_s,
                max_requests=args.max_requests,
                max_tokens=args.max_tokens,
                stream=mode,
            )
            print(
                f"{args.clients} clients for {args.duration_s:.0f} s, streaming {mode}, against {base_url} "
                f"({args.model})",
                flush=True,
            )
            result = run_load(base_url, settings)
            runs.append({"stream": mode, "result": result, "server_metrics": server_counters(base_url)})
            report(result)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            server.kill()

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import machine

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    settings_out = {k: v for k, v in vars(args).items() if k not in ("out", "in_process_only")}
    result = {
        "machine": machine(),
        "settings": settings_out,
        "runs": runs,
        **in_process,
        "server_exit_code": server.returncode,
    }
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and .png")
    if any(run["result"]["failures"] for run in runs):
        sys.exit(1)


def plot(data: dict[str, Any], path: Path) -> None:
    """Requests/s and stream TTFT per mix, and single-stream decode against HF ``generate``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rate_ax, ttft_ax, decode_ax) = plt.subplots(1, 3, figsize=(13, 4))
    mixes = [run["stream"] for run in data["runs"]]
    rate_ax.bar(mixes, [run["result"]["requests_per_s"] for run in data["runs"]], color="tab:blue")
    rate_ax.set_ylabel("requests / s")
    rate_ax.set_title(f"{data['settings']['clients']} clients")
    streamed = [run for run in data["runs"] if (run["result"].get("ttft_stream_s") or {}).get("n")]
    for q, offset in (("p50", -0.2), ("p95", 0.2)):
        ttft_ax.bar(
            [i + offset for i in range(len(streamed))],
            [run["result"]["ttft_stream_s"][q] for run in streamed],
            0.4,
            label=q,
        )
    ttft_ax.set_xticks(range(len(streamed)), [run["stream"] for run in streamed])
    ttft_ax.set_ylabel("stream TTFT (s)")
    ttft_ax.legend(fontsize=8)
    if decode := data.get("single_stream_decode"):
        keys = ("stream_decode_ms_per_token", "hf_generate_decode_ms_per_token")
        medians = [decode[k]["median"] for k in keys]
        spreads = [[m - decode[k]["min"] for m, k in zip(medians, keys, strict=True)]]
        spreads.append([decode[k]["max"] - m for m, k in zip(medians, keys, strict=True)])
        decode_ax.bar(["engine stream", "HF generate"], medians, yerr=spreads, capsize=4, color="tab:green")
        decode_ax.set_ylabel("decode ms / token (median, min-max)")
        decode_ax.set_title(f"one stream, {decode['prompt_tokens']}-token prompt")
    fig.suptitle("kvboost-rag serve under load (loopback)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _quantiles(stats: dict[str, float] | None) -> str:
    return "-" if not stats else f"{stats['p50']:.2f}/{stats['p95']:.2f}/{stats['p99']:.2f} s"


def report(result: dict[str, Any]) -> None:
    print(
        f"  {result['requests']} requests, {result['failures']} failures, "
        f"{result['requests_per_s']:.2f} req/s, {result['completion_tokens_per_s']:.1f} tokens/s; "
        f"latency p50/p95/p99 {_quantiles(result['latency_s'])}; "
        f"stream TTFT p50/p95/p99 {_quantiles(result['ttft_stream_s'])}; "
        f"cached prompt share {result['cached_prompt_share']:.0%}",
        flush=True,
    )
    if result["errors"]:
        print("  errors:", *result["errors"], sep="\n    ")


if __name__ == "__main__":
    main()
