"""Warm TTFT from the disk tier in a fresh process, next to the cold path and the floor.

For each prompt length, a document (real essay text) is stored by this process;
then a *fresh* process opens the store and asks a new question about it. That
process first makes one small unrelated call (torch start-up), then measures,
for each repetition, the disk-tier path (memory tier emptied before each), the
cold path (an empty store) and the parts of the floor:

    floor = bytes read / measured read bandwidth + prefill of the new tokens + one decode step

Read bandwidth is measured on the same store files in the same process, with the
OS page cache as it is (warm after the first read), the state of a serving box.
Also reports pre-warm throughput (tokens/s) next to plain prefill of the same documents.

    python benchmarks/disk_ttft.py            # 2K and 8K tokens
    python benchmarks/disk_ttft.py --quick    # 2K only, fewer repetitions
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, essay_text, machine, summary, text_of_tokens  # noqa: E402

from kvboost_rag import KVBoostEngine, Segment  # noqa: E402
from kvboost_rag.models import load_model  # noqa: E402

MODEL = "smollm2-135m-instruct"
QUESTION = "Question: what is the main point of the text above? Answer briefly."


def read_bandwidth(store_dir: Path) -> float:
    """Bytes per second reading every payload file of the store (page cache as it is)."""
    files = sorted((store_dir / "kv").rglob("*.val"))
    sizes = [f.stat().st_size for f in files]
    buffer = bytearray(max(sizes))
    t0 = time.perf_counter()
    for f, size in zip(files, sizes, strict=True):
        with open(f, "rb", buffering=0) as fh:
            fh.readinto(memoryview(buffer)[:size])
    return sum(sizes) / (time.perf_counter() - t0)


def worker(store_dir: str, doc: str, reps: int, dtype: str) -> dict:
    """Runs in a fresh process: disk-tier TTFT, cold TTFT and the floor's parts."""
    model, tok = load_model(MODEL, dtype=dtype)
    engine = KVBoostEngine(model, tok, store_dir=store_dir)
    memory = engine.store.tiers[0]
    engine.generate("Hello", max_new_tokens=1)  # torch start-up, touches no stored document
    out: dict[str, list[float]] = {
        "disk": [],
        "cold": [],
        "bandwidth_bytes_s": [],
        "new_prefill_s": [],
        "decode_s": [],
    }
    for r in range(reps):
        memory.clear()
        prompt = [Segment(doc, "document"), Segment(f"\n\n{QUESTION} ({r})")]
        warm = engine.generate(prompt, max_new_tokens=1)
        assert warm.usage.cached_tokens_by_tier.get("disk", 0) > 0, warm.usage
        out["disk"].append(warm.timings.ttft_s)
        disk_tokens = warm.usage.cached_tokens_by_tier["disk"]
        new_tokens = warm.usage.recomputed_tokens
        with tempfile.TemporaryDirectory() as empty:
            cold_engine = KVBoostEngine(model, tok, store_dir=empty)
            cold = cold_engine.generate(prompt, max_new_tokens=1)
            cold_engine.close()
        out["cold"].append(cold.timings.ttft_s)
        out["bandwidth_bytes_s"].append(read_bandwidth(Path(store_dir)))
        # prefill of the new tokens over an assembled cache, then one decode step
        canonical = engine.canonicalize(prompt)
        chunks = engine.core.chunks(canonical)
        cache = engine.assembler.new_cache(len(canonical) + 2)
        bytes_read = 0
        for chunk in chunks[:-1]:
            stored = engine.store.get(chunk.key).chunk
            bytes_read += stored.nbytes
            engine.assembler.append(cache, stored.kv)
        ids = canonical.token_ids
        engine.flush()  # the reads' queued access-time updates would otherwise run beside the timings
        t0 = time.perf_counter()
        engine.assembler.forward(cache, ids[chunks[-1].start :], chunks[-1].start)
        t1 = time.perf_counter()
        engine.assembler.forward(cache, [ids[-1]], len(ids), exact_rows=False)  # as decode runs it
        out["decode_s"].append(time.perf_counter() - t1)
        out["new_prefill_s"].append(t1 - t0)
    engine.close()
    return {
        "times": out,
        "bytes_read": bytes_read,
        "disk_tokens": disk_tokens,
        "new_tokens": new_tokens,
        "prompt_tokens": warm.usage.prompt_tokens,
    }


def prewarm_throughput(dtype: str, n_docs: int) -> dict:
    """Pre-warm tokens/s next to plain prefill of the same documents, alternating per document."""
    model, tok = load_model(MODEL, dtype=dtype)
    text = essay_text()
    docs = [text_of_tokens(tok, text, 600, offset_tokens=40_000 + 600 * i) for i in range(n_docs)]
    prewarm_s = plain_s = 0.0
    prewarm_tokens = plain_tokens = 0
    with tempfile.TemporaryDirectory() as store:
        engine = KVBoostEngine(model, tok, store_dir=store)
        engine.generate("Hello", max_new_tokens=1)
        for doc in docs:
            report = engine.prewarm([doc])
            prewarm_s, prewarm_tokens = prewarm_s + report.seconds, prewarm_tokens + report.computed_tokens
            t0 = time.perf_counter()
            ids = tok(doc, return_tensors="pt", add_special_tokens=False).input_ids
            with torch.inference_mode():
                model(input_ids=ids, logits_to_keep=1)
            plain_s, plain_tokens = plain_s + time.perf_counter() - t0, plain_tokens + ids.shape[1]
        engine.close()
    return {
        "documents": n_docs,
        "prewarm_tokens_per_s": prewarm_tokens / prewarm_s,
        "plain_prefill_tokens_per_s": plain_tokens / plain_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--worker", nargs=3, metavar=("STORE", "DOC_FILE", "REPS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        store, doc_file, reps = args.worker
        print(json.dumps(worker(store, Path(doc_file).read_text(), int(reps), args.dtype)))
        return
    lengths = [2048] if args.quick else [2048, 8000]
    reps = args.reps or (3 if args.quick else 5)
    _, tok = load_model(MODEL, dtype=args.dtype)
    text = essay_text()
    rows = []
    for n in lengths:
        doc = text_of_tokens(tok, text, n - 24, offset_tokens=10_000)
        with (
            tempfile.TemporaryDirectory() as store,
            tempfile.NamedTemporaryFile("w", suffix=".txt") as doc_file,
        ):
            doc_file.write(doc)
            doc_file.flush()
            with KVBoostEngine.from_pretrained(MODEL, dtype=args.dtype, store_dir=store) as writer:
                writer.generate([Segment(doc, "document"), Segment(f"\n\n{QUESTION}")], max_new_tokens=1)
            cmd = [
                sys.executable,
                __file__,
                "--dtype",
                args.dtype,
                "--worker",
                store,
                doc_file.name,
                str(reps),
            ]
            done = subprocess.run(
                cmd, capture_output=True, text=True, check=True, env=os.environ | {"PYTHONPATH": "."}
            )
            res = json.loads(done.stdout.strip().splitlines()[-1])
        t = res["times"]
        floors = [
            res["bytes_read"] / bw + p + d
            for bw, p, d in zip(t["bandwidth_bytes_s"], t["new_prefill_s"], t["decode_s"], strict=True)
        ]
        row = {
            "dtype": args.dtype,
            "prompt_tokens": res["prompt_tokens"],
            "disk_tokens": res["disk_tokens"],
            "new_tokens": res["new_tokens"],
            "bytes_read": res["bytes_read"],
            "read_bandwidth_gb_s": summary([b / 1e9 for b in t["bandwidth_bytes_s"]]),
            "floor_parts_s": {k: summary(t[k]) for k in ("new_prefill_s", "decode_s")},
            "disk": summary(t["disk"]),
            "cold": summary(t["cold"]),
            "floor": summary(floors),
            "cold_over_disk": summary([c / d for c, d in zip(t["cold"], t["disk"], strict=True)]),
            "disk_over_floor": summary([d / f for d, f in zip(t["disk"], floors, strict=True)]),
        }
        rows.append(row)
        print(
            f"{args.dtype} {row['prompt_tokens']} tok ({row['bytes_read'] / 2**20:.0f} MiB from disk): "
            f"cold {row['cold']['median']:.3f}s disk {row['disk']['median'] * 1000:.0f}ms "
            f"floor {row['floor']['median'] * 1000:.0f}ms | cold/disk {row['cold_over_disk']['median']:.1f}x "
            f"disk/floor {row['disk_over_floor']['median']:.2f}x "
            f"(read {row['read_bandwidth_gb_s']['median']:.1f} GB/s)",
            flush=True,
        )
    throughput = prewarm_throughput(args.dtype, 8 if args.quick else 20)
    print(
        f"prewarm {throughput['prewarm_tokens_per_s']:.0f} tok/s vs plain prefill "
        f"{throughput['plain_prefill_tokens_per_s']:.0f} tok/s"
    )
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    name = "disk_ttft-quick" if args.quick else "disk_ttft"
    (RESULTS_DIR / f"{name}.json").write_text(
        json.dumps({"machine": machine(), "rows": rows, "prewarm": throughput}, indent=2)
    )
    plot(rows, RESULTS_DIR / f"{name}.png")
    print(f"wrote {RESULTS_DIR / name}.json and .png")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    keys = [("cold", "cold path"), ("disk", "warm from disk (fresh process)"), ("floor", "floor")]
    width = 0.8 / len(keys)
    for k, (key, label) in enumerate(keys):
        x = [i + k * width for i in range(len(rows))]
        med = [r[key]["median"] for r in rows]
        err = [
            [r[key]["median"] - r[key]["q1"] for r in rows],
            [r[key]["q3"] - r[key]["median"] for r in rows],
        ]
        ax.bar(x, med, width, yerr=err, capsize=3, label=label)
    ax.set_xticks([i + width for i in range(len(rows))], [f"{r['prompt_tokens']} tokens" for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("TTFT (s), median, IQR bars")
    ax.set_title(f"SmolLM2-135M {rows[0]['dtype']}: disk tier in a fresh process")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
