"""TTFT vs prompt length on SmolLM2, kvboost-rag next to what a user would run instead.

A document of N tokens and a question; per repetition, back to back on the same tokens:
- kvboost cold (empty store, writes included); extended (the prompt just answered with a few words
  added to its question, as llama.cpp's context holds it: the engine goes on from that request's
  held context and computes the few new tokens); full hit (the extended prompt again); then
  through the store tiers alone (held contexts dropped first): warm from memory (the document
  stored, a new ~20-token question computed), extended from the store (a stored prompt, not the
  last one, with words added: the tokens it shares with a stored chunk are laid, the new ones
  computed), warm from disk (memory tier emptied: the document is read from the disk tier,
  another new question computed);
- plain HF prefill, and transformers' prompt reuse (a prefilled DynamicCache copied per request);
- llama.cpp on the Q4_1 GGUF of the same model (when llama-cpp-python is installed): cold,
  warm from its context (in-memory prefix reuse), warm from its ``LlamaDiskCache``.

Ratios are taken per repetition (same machine noise), then their median. Writes JSON and a
PNG under docs/benchmarks/.

    python benchmarks/ttft.py                 # 512..4096 tokens, 5 repetitions
    python benchmarks/ttft.py --quick         # 512 and 2048, 3 repetitions
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    DEFAULT_MODEL,
    QUESTIONS,
    RESULTS_DIR,
    essay_text,
    machine,
    summary,
    text_of_tokens,
    timed,
    weight_read_floor,
)
from peers import LlamaCppPeer, copied_cache_prefill, llama_cpp_available, plain_prefill, prefill_cache  # noqa: E402

from kvboost_rag import EngineConfig, KVBoostEngine, Segment  # noqa: E402
from kvboost_rag.models import load_model  # noqa: E402


def question(rep: int, k: int) -> str:
    """The ``k``-th question of repetition ``rep`` (marked with it, so no repetition reuses another's)."""
    return QUESTIONS[(rep + k) % len(QUESTIONS)] + f" ({rep})"


def through_the_store(engine: KVBoostEngine) -> None:
    """Drop the engine's held contexts: its next request reads what it shares through the store tiers."""
    engine.core.held.clear()


def lay_seconds(engine: KVBoostEngine, prompt: list[Segment]) -> float:
    """Seconds to lay ``prompt``'s stored chunks into a fresh cache (what a warm request reads)."""
    core = engine.core
    canonical = core.canonicalize(prompt)
    hits = [engine.store.get(chunk.key) for chunk in core.chunks(canonical)]
    cache = core.assembler.new_cache(len(canonical))
    t0 = time.perf_counter()
    core.assembler.append(cache, [hit.chunk.kv for hit in hits if hit is not None])
    return time.perf_counter() - t0


def bench_dtype(
    model_name: str,
    dtype: str,
    lengths: list[int],
    reps: int,
    text: str,
    chunk_size: int | None,
    use_llama: bool,
) -> list[dict]:
    model, tok = load_model(model_name, dtype=dtype)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    floor_s = weight_read_floor(model)["ms_per_token"] / 1000
    rows = []
    for n in lengths:
        doc = text_of_tokens(tok, text, n - 16, offset_tokens=n)  # a different passage per length
        keys = [
            "plain_prefill",
            "cold",
            "warm_memory",
            "warm_extend",
            "warm_extend_store",
            "warm_disk",
            "full_hit",
            "hf_prefix_reuse",
            "lay",
        ]
        if use_llama:
            keys += ["llama_cpp_cold", "llama_cpp_memory", "llama_cpp_same_new", "llama_cpp_disk"]
        times: dict[str, list[float]] = {k: [] for k in keys}
        prompt_tokens = None
        with tempfile.TemporaryDirectory() as store_dir, tempfile.TemporaryDirectory() as llama_dir:
            engine = KVBoostEngine(
                model, tok, config=EngineConfig(chunk_size=chunk_size), store_dir=store_dir
            )
            memory, disk = engine.store.tiers

            def ids_of(prompt: list[Segment], engine: KVBoostEngine = engine) -> list[int]:
                return engine.canonicalize(prompt).token_ids

            # One untimed round for allocator and kernel warm-up.
            first = [Segment(doc, "document"), Segment(QUESTIONS[0])]
            engine.generate(first, max_new_tokens=1)
            plain_prefill(model, ids_of(first))
            doc_ids = ids_of([Segment(doc, "document")])
            prefix_cache = prefill_cache(model, doc_ids)
            llama = LlamaCppPeer(n_ctx=n + 256, cache_dir=llama_dir) if use_llama else None
            llama_bytes_per_token = None
            if llama is not None:
                llama.store(ids_of(first))  # what an earlier request leaves in its disk cache
                llama_bytes_per_token = llama.disk_bytes() / (len(ids_of(first)) + 1)
            for r in range(reps):
                q = question(r, 1)
                prompt = [Segment(doc, "document"), Segment(q)]
                ids = ids_of(prompt)
                times["plain_prefill"].append(timed(plain_prefill, model, ids))
                memory.clear()
                disk.clear()
                through_the_store(engine)
                cold = engine.generate(prompt, max_new_tokens=1)
                times["cold"].append(cold.timings.ttft_s)
                prompt_tokens = cold.usage.prompt_tokens
                engine.store.flush()
                # the prompt just answered with words added (llama.cpp's context holds it too): the
                # engine goes on from that request's cache, only the tokens after it computed
                extend_prompt = [Segment(doc, "document"), Segment(q + " Again.")]
                extended = engine.generate(extend_prompt, max_new_tokens=1)
                assert extended.usage.recomputed_tokens < 8, extended.usage
                assert extended.usage.cached_tokens_by_tier.get("context", 0) > 0, extended.usage
                times["warm_extend"].append(extended.timings.ttft_s)
                full = engine.generate(extend_prompt, max_new_tokens=1)
                assert full.usage.cached_tokens == full.usage.prompt_tokens
                times["full_hit"].append(full.timings.ttft_s)
                # through the store alone: a new question over the stored document, its ~20 tokens computed
                through_the_store(engine)
                warm_prompt = [Segment(doc, "document"), Segment(question(r, 2))]
                warm = engine.generate(warm_prompt, max_new_tokens=1)
                assert warm.usage.cached_tokens_by_tier.get("memory", 0) > 0, warm.usage
                times["warm_memory"].append(warm.timings.ttft_s)
                times["lay"].append(lay_seconds(engine, warm_prompt))
                # a stored prompt (not the last one) with words added: the shared tokens laid from the store
                through_the_store(engine)
                extended = engine.generate(
                    [Segment(doc, "document"), Segment(q + " Once more.")], max_new_tokens=1
                )
                assert extended.usage.recomputed_tokens < 8, extended.usage
                assert "context" not in extended.usage.cached_tokens_by_tier, extended.usage
                times["warm_extend_store"].append(extended.timings.ttft_s)
                through_the_store(engine)
                memory.clear()
                from_disk = engine.generate(  # another new question: the document read from the disk tier
                    [Segment(doc, "document"), Segment(question(r, 3))],
                    max_new_tokens=1,
                )
                assert from_disk.usage.cached_tokens_by_tier.get("disk", 0) > 0, from_disk.usage
                times["warm_disk"].append(from_disk.timings.ttft_s)
                # bytes on disk per stored token (payloads with their headers, last logits included)
                stored_bytes_per_token = disk.stats()["disk"].bytes / sum(
                    disk.get(k).chunk.num_tokens for k in disk.keys()
                )
                times["hf_prefix_reuse"].append(
                    timed(copied_cache_prefill, model, prefix_cache, len(doc_ids), ids[len(doc_ids) :])
                )
                if llama is not None:
                    times["llama_cpp_cold"].append(llama.ttft(ids))
                    # its context holds the stored prompt: the words added are evaluated, as kvboost extended
                    times["llama_cpp_memory"].append(llama.ttft(ids_of(extend_prompt), keep_context=True))
                    # the document kept, the new question evaluated: the same new tokens as kvboost warm
                    times["llama_cpp_same_new"].append(
                        llama.ttft(ids_of(warm_prompt), keep_context=True, keep_tokens=len(doc_ids))
                    )
                    times["llama_cpp_disk"].append(llama.ttft(ids_of(warm_prompt), use_disk=True))
            reuse = engine.stats()["reuse"]
            engine.close()
        row = {
            "model": model_name,
            "dtype": dtype,
            "prompt_tokens": prompt_tokens,
            "reps": reps,
            "chunk_size": reuse["chunk_tokens"],
            "schedule": reuse["schedule"],
            "stored_bytes_per_token": stored_bytes_per_token,
            "llama_cpp_state_bytes_per_token": llama_bytes_per_token,
        }
        row |= {k: summary(v) for k, v in times.items()}
        # DESIGN.md: warm TTFT from memory <= 3x the weight-read floor plus the time to lay the stored chunks
        row["weight_read_floor_s"] = floor_s
        row["warm_memory_over_bound"] = summary(
            [w / (3 * floor_s + lay) for w, lay in zip(times["warm_memory"], times["lay"], strict=True)]
        )
        med = {k: row[k]["median"] for k in times}
        # ratios per repetition (same noise), then their median
        pairs = {
            "cold_over_warm": ("cold", "warm_memory"),
            "plain_over_cold": ("plain_prefill", "cold"),
            "plain_over_warm_disk": ("plain_prefill", "warm_disk"),
            "warm_over_hf_prefix_reuse": ("warm_memory", "hf_prefix_reuse"),
        }
        if use_llama:
            pairs |= {
                "llama_cpp_memory_over_extend": ("llama_cpp_memory", "warm_extend"),
                "llama_cpp_same_new_over_warm": ("llama_cpp_same_new", "warm_memory"),
                "llama_cpp_disk_over_warm_disk": ("llama_cpp_disk", "warm_disk"),
                "llama_cpp_cold_over_cold": ("llama_cpp_cold", "cold"),
            }
        row["ratios"] = {
            name: summary([x / y for x, y in zip(times[a], times[b], strict=True)])
            for name, (a, b) in pairs.items()
        }
        print(
            f"{dtype} {prompt_tokens:5d} tok | "
            + " ".join(f"{k} {med[k] * 1000:.0f}ms" for k in keys)
            + " | "
            + " ".join(f"{name} {v['median']:.2f}x" for name, v in row["ratios"].items()),
            flush=True,
        )
        rows.append(row)
    return rows


PLOT_LABELS = [
    ("plain_prefill", "plain HF prefill"),
    ("cold", "kvboost cold (writes included)"),
    ("llama_cpp_cold", "llama.cpp cold (Q4_1)"),
    ("hf_prefix_reuse", "HF DynamicCache copy"),
    ("llama_cpp_memory", "llama.cpp context reuse"),
    ("llama_cpp_disk", "llama.cpp LlamaDiskCache"),
    ("warm_memory", "kvboost warm (memory)"),
    ("warm_extend", "kvboost extended prompt (held context)"),
    ("warm_extend_store", "kvboost extended prompt (store)"),
    ("warm_disk", "kvboost warm (disk)"),
    ("full_hit", "kvboost full hit"),
]


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = sorted({r["dtype"] for r in rows})
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4.5), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes, strict=True):
        sel = [r for r in rows if r["dtype"] == dtype]
        x = [r["prompt_tokens"] for r in sel]
        for key, label in PLOT_LABELS:
            if key not in sel[0]:
                continue
            med = [r[key]["median"] for r in sel]
            lo = [r[key]["median"] - r[key]["q1"] for r in sel]
            hi = [r[key]["q3"] - r[key]["median"] for r in sel]
            ax.errorbar(x, med, yerr=[lo, hi], marker="o", capsize=3, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("TTFT (s), median, IQR bars")
        ax.set_title(f"SmolLM2-135M {dtype}, CPU")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--dtypes", default="auto", help="comma list (default: auto, the engine's choice here)"
    )
    parser.add_argument("--no-llama-cpp", action="store_true", help="leave out the llama.cpp peer")
    parser.add_argument(
        "--lengths", default=None, help="comma list of prompt tokens (default 512,1024,2048,4096)"
    )
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--chunk-size", type=int, default=None, help="default: the engine's")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="an alias or a local model folder")
    parser.add_argument("--name", default=None, help="results file stem (default: ttft, ttft-quick)")
    args = parser.parse_args()
    dtypes = args.dtypes.split(",")
    use_llama = not args.no_llama_cpp and llama_cpp_available() and args.model == DEFAULT_MODEL
    lengths = [
        int(x) for x in (args.lengths or ("512,2048" if args.quick else "512,1024,2048,4096")).split(",")
    ]
    reps = args.reps or (3 if args.quick else 5)
    text = essay_text()
    rows = [
        row
        for dtype in dtypes
        for row in bench_dtype(args.model, dtype, lengths, reps, text, args.chunk_size, use_llama)
    ]
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    name = args.name or ("ttft-quick" if args.quick else "ttft")
    (RESULTS_DIR / f"{name}.json").write_text(json.dumps({"machine": machine(), "rows": rows}, indent=2))
    plot(rows, RESULTS_DIR / f"{name}.png")
    print(f"wrote {RESULTS_DIR / name}.json and .png")


if __name__ == "__main__":
    main()
