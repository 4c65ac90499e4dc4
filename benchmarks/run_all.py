"""The benchmark suite: every workload, its peers side by side, JSON + PNG under docs/benchmarks/.

    python benchmarks/run_all.py            # full run: the figures in the README (about an hour on 2 cores)
    python benchmarks/run_all.py --quick    # minutes; writes *-quick.json, leaves the README alone
    python benchmarks/run_all.py --only ttft chat_replay

Each workload runs as its own process (a clean allocator and page cache state per script,
and one crash does not take the others down). ``suite.json`` (``suite-quick.json``) records
the machine, package versions, and per workload its command, exit code, wall time and
the commit it ran. A full run ends by rewriting the README's results section (``report.py``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, machine  # noqa: E402

HERE = Path(__file__).resolve().parent

GEMMA3 = ["--model", "gemma3-270m"]

# name -> (script and full-run arguments, quick-run arguments)
WORKLOADS: dict[str, tuple[list[str], list[str]]] = {
    # TTFT vs prompt length: cold, warm memory, warm disk; plain HF, DynamicCache copy, llama.cpp;
    # bytes per token
    "ttft": (["ttft.py"], ["ttft.py", "--quick"]),
    # a fresh process reading the disk tier at 2K and 8K tokens, the floor, pre-warm throughput
    "disk_ttft": (["disk_ttft.py"], ["disk_ttft.py", "--quick"]),
    # disk-tier TTFT with and without a store secret (signed entries), side by side
    "signed_store": (["signed_store.py"], ["signed_store.py", "--quick"]),
    # flat prompts sharing a prefix of 300/700/1500 tokens; a pre-warmed document in a flat prompt
    "prefix_reuse": (["prefix_reuse.py"], ["prefix_reuse.py", "--quick"]),
    # ShareGPT conversations, turns 1-8
    "chat_replay": (["chat_replay.py"], ["chat_replay.py", "--quick"]),
    # the same three on Gemma 3 270M (sliding-window layers of 512 around global ones), HF peers only
    "ttft_gemma3": (
        ["ttft.py", *GEMMA3, "--name", "ttft_gemma3", "--reps", "3"],
        ["ttft.py", *GEMMA3, "--name", "ttft_gemma3-quick", "--quick"],
    ),
    "prefix_reuse_gemma3": (
        [
            "prefix_reuse.py",
            *GEMMA3,
            "--lengths",
            "300,1500,4000",
            "--out",
            str(RESULTS_DIR / "prefix_reuse_gemma3.json"),
        ],
        ["prefix_reuse.py", *GEMMA3, "--quick", "--out", str(RESULTS_DIR / "prefix_reuse_gemma3-quick.json")],
    ),
    "chat_replay_gemma3": (
        ["chat_replay.py", *GEMMA3, "--out", str(RESULTS_DIR / "chat_replay_gemma3.json")],
        ["chat_replay.py", *GEMMA3, "--quick", "--out", str(RESULTS_DIR / "chat_replay_gemma3-quick.json")],
    ),
    "blend_quality_gemma3": (
        [
            "blend_quality.py",
            "--models",
            "gemma3-270m",
            "--questions",
            "12",
            "--out",
            str(RESULTS_DIR / "blend_quality_gemma3.json"),
        ],
        [
            "blend_quality.py",
            "--models",
            "gemma3-270m",
            "--quick",
            "--out",
            str(RESULTS_DIR / "blend_quality_gemma3-quick.json"),
        ],
    ),
    # RAG with 3-6 retrieved passages in shuffled orders: exact and blend reuse
    "blend_quality": (
        ["blend_quality.py"],
        ["blend_quality.py", "--quick", "--out", str(RESULTS_DIR / "blend_quality-quick.json")],
    ),
    # 8 and 32 concurrent requests sharing a 1K-token prefix
    "concurrency": (
        ["concurrency.py", "--reps", "3"],
        [
            "concurrency.py",
            "--clients",
            "8",
            "--reps",
            "1",
            "--max-new-tokens",
            "8",
            "--out",
            str(RESULTS_DIR / "concurrency-quick.json"),
        ],
    ),
    # LlamaIndex's default query engine and LangChain's retrieval chain over pre-warmed nodes
    "rag_pipelines": (["rag_pipelines.py"], ["rag_pipelines.py", "--quick"]),
    # store codecs: entry size, disk-tier TTFT, and answers from lossy entries against exact mode
    "store_codecs": (["store_codecs.py"], ["store_codecs.py", "--quick"]),
    # one stream's decode: ms/token vs the weight-read floor, HF generate (+ prompt lookup), llama.cpp
    "decode": (["decode.py"], ["decode.py", "--quick"]),
    # `kvboost-rag serve` on loopback: 8 clients for 30 s per request mix, no failures allowed
    # Ray Serve, 2 replicas: prefix-affinity routing against power of two, the same workload
    "ray_routing": (["ray_routing.py"], ["ray_routing.py", "--quick"]),
    "server_load": (
        ["server_load.py"],
        ["server_load.py", "--quick", "--out", str(RESULTS_DIR / "server_load-quick.json")],
    ),
}


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for dist in (
        "kvboost-rag",
        "torch",
        "transformers",
        "llama_cpp_python",
        "diskcache",
        "langchain-core",
        "llama-index-core",
    ):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def commit() -> str | None:
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=HERE, capture_output=True, text=True
    ).stdout.strip()
    return done.stdout.strip() + ("+changes" if dirty else "") if done.returncode == 0 else None


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small sizes and few repetitions")
    parser.add_argument("--only", nargs="+", choices=list(WORKLOADS), help="run these workloads only")
    parser.add_argument(
        "--no-report", action="store_true", help="leave the README's results section as it is"
    )
    args = parser.parse_args()
    names = args.only or list(WORKLOADS)
    revision = commit()
    runs = []
    for name in names:
        cmd = [
            sys.executable,
            str(HERE / WORKLOADS[name][1 if args.quick else 0][0]),
            *WORKLOADS[name][1 if args.quick else 0][1:],
        ]
        print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        code = subprocess.run(cmd, cwd=HERE.parent).returncode
        runs.append(
            {
                "workload": name,
                "command": " ".join(["python", *(Path(c).name if c.endswith(".py") else c for c in cmd[1:])]),
                "exit_code": code,
                "seconds": time.perf_counter() - t0,
                "commit": revision,
            }
        )
        print(f"== {name}: exit {code} in {runs[-1]['seconds']:.0f} s", flush=True)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    suite = RESULTS_DIR / ("suite-quick.json" if args.quick else "suite.json")
    record = {"machine": machine(), "versions": versions(), "quick": args.quick, "runs": runs}
    if suite.exists() and args.only:  # a partial run updates its workloads, keeps the others' records
        earlier = json.loads(suite.read_text())
        record["runs"] = [r for r in earlier.get("runs", []) if r["workload"] not in names] + runs
    suite.write_text(json.dumps(record, indent=2))
    print(f"wrote {suite}")
    failed = [r["workload"] for r in runs if r["exit_code"] != 0]
    if not args.quick and not args.no_report and not failed:
        subprocess.run([sys.executable, str(HERE / "report.py")], check=True)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
