"""TTFT vs prompt length on SmolLM2: cold path, warm path (memory tier), plain HF prefill and
transformers' own prompt reuse (a prefilled DynamicCache copied per request), side by side.

Every repetition runs all variants back to back on the same prompt, so ratios are
measured under the same machine noise. Writes JSON and a PNG under docs/benchmarks/.

    python benchmarks/ttft.py                 # bf16 and fp32, 512..4096 tokens
    python benchmarks/ttft.py --quick         # bf16 only, 512 and 2048, fewer repetitions
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, essay_text, machine, summary, text_of_tokens, timed  # noqa: E402

from kvboost_rag import EngineConfig, KVBoostEngine, Segment  # noqa: E402
from kvboost_rag.models import load_model  # noqa: E402

QUESTIONS = [
    "What is the main point of the text above? Answer briefly.",
    "Which example in the text above is the most surprising?",
    "Who is the intended reader of the text above, in a few words?",
    "What would the author say is the biggest mistake here?",
    "Name one claim from the text above that you could test.",
    "Summarize the text above for a busy reader in one line.",
    "What does the author recommend doing first, in short?",
    "Which word best describes the tone of the text above?",
]


def plain_prefill(model, tokenizer, text: str) -> int:
    """What a user does without reuse: tokenize, one forward over the prompt, pick the first token."""
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.inference_mode():
        logits = model(input_ids=ids, logits_to_keep=1).logits
    return int(logits[0, -1].argmax())


def hf_prefix_reuse(model, tokenizer, prefix_cache, prefix_len: int, question: str) -> int:
    """transformers' documented pattern: copy a prefilled DynamicCache, run only the new tokens."""
    ids = tokenizer(question, return_tensors="pt", add_special_tokens=False).input_ids
    cache = copy.deepcopy(prefix_cache)
    positions = torch.arange(prefix_len, prefix_len + ids.shape[1]).unsqueeze(0)
    with torch.inference_mode():
        logits = model(input_ids=ids, cache=cache, position_ids=positions, logits_to_keep=1).logits
    return int(logits[0, -1].argmax())


def bench_dtype(dtype: str, lengths: list[int], reps: int, text: str, chunk_size: int) -> list[dict]:
    from transformers import DynamicCache

    model, tok = load_model("smollm2-135m-instruct", dtype=dtype)
    rows = []
    for n in lengths:
        doc = text_of_tokens(tok, text, n - 16, offset_tokens=n)  # a different passage per length
        times: dict[str, list[float]] = {"plain_prefill": [], "cold": [], "warm_memory": [], "full_hit": [],
                                         "hf_prefix_reuse": []}
        prompt_tokens = None
        engine = KVBoostEngine(model, tok, config=EngineConfig(chunk_size=chunk_size))
        # One untimed round for allocator and kernel warm-up.
        engine.generate([Segment(doc, "document"), Segment(QUESTIONS[0])], max_new_tokens=1)
        plain_prefill(model, tok, doc + QUESTIONS[0])
        doc_ids = tok(doc, return_tensors="pt", add_special_tokens=False).input_ids
        prefix_cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(input_ids=doc_ids, cache=prefix_cache, logits_to_keep=1)
        for r in range(reps):
            q = QUESTIONS[(r + 1) % len(QUESTIONS)] + f" ({r})"
            prompt = [Segment(doc, "document"), Segment(q)]
            times["plain_prefill"].append(timed(lambda: plain_prefill(model, tok, doc + q)))
            engine.store.clear()
            cold = engine.generate(prompt, max_new_tokens=1)
            times["cold"].append(cold.timings.ttft_s)
            prompt_tokens = cold.usage.prompt_tokens
            warm_prompt = [Segment(doc, "document"), Segment(q + " Again.")]
            warm = engine.generate(warm_prompt, max_new_tokens=1)
            assert warm.usage.cached_tokens > 0
            times["warm_memory"].append(warm.timings.ttft_s)
            full = engine.generate(warm_prompt, max_new_tokens=1)
            assert full.usage.cached_tokens == full.usage.prompt_tokens
            times["full_hit"].append(full.timings.ttft_s)
            times["hf_prefix_reuse"].append(timed(lambda: hf_prefix_reuse(model, tok, prefix_cache, doc_ids.shape[1], q)))
        row = {"dtype": dtype, "prompt_tokens": prompt_tokens, "reps": reps, "chunk_size": chunk_size}
        row |= {k: summary(v) for k, v in times.items()}
        med = {k: row[k]["median"] for k in times}
        # ratios per repetition (same noise), then their median
        row["ratios"] = {
            "cold_over_warm": summary([c / w for c, w in zip(times["cold"], times["warm_memory"])]),
            "plain_over_cold": summary([p / c for p, c in zip(times["plain_prefill"], times["cold"])]),
            "warm_over_hf_prefix_reuse": summary([w / h for w, h in zip(times["warm_memory"], times["hf_prefix_reuse"])]),
        }
        print(
            f"{dtype} {prompt_tokens:5d} tok | plain {med['plain_prefill']:.3f}s cold {med['cold']:.3f}s "
            f"warm {med['warm_memory'] * 1000:.0f}ms full-hit {med['full_hit'] * 1000:.0f}ms "
            f"hf-reuse {med['hf_prefix_reuse'] * 1000:.0f}ms | cold/warm {row['ratios']['cold_over_warm']['median']:.1f}x "
            f"cold speed vs plain {row['ratios']['plain_over_cold']['median']:.3f}x "
            f"warm/hf-reuse {row['ratios']['warm_over_hf_prefix_reuse']['median']:.2f}x",
            flush=True,
        )
        rows.append(row)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = sorted({r["dtype"] for r in rows})
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4.5), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes):
        sel = [r for r in rows if r["dtype"] == dtype]
        x = [r["prompt_tokens"] for r in sel]
        for key, label in [("plain_prefill", "plain HF prefill"), ("cold", "kvboost cold (writes included)"),
                           ("hf_prefix_reuse", "HF DynamicCache copy"), ("warm_memory", "kvboost warm (memory)"),
                           ("full_hit", "kvboost full hit")]:
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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dtypes", default=None, help="comma list (default bfloat16,float32)")
    parser.add_argument("--lengths", default=None, help="comma list of prompt tokens (default 512,1024,2048,4096)")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--chunk-size", type=int, default=EngineConfig().chunk_size)
    args = parser.parse_args()
    dtypes = (args.dtypes or ("bfloat16" if args.quick else "bfloat16,float32")).split(",")
    lengths = [int(x) for x in (args.lengths or ("512,2048" if args.quick else "512,1024,2048,4096")).split(",")]
    reps = args.reps or (3 if args.quick else 7)
    text = essay_text()
    rows = [row for dtype in dtypes for row in bench_dtype(dtype, lengths, reps, text, args.chunk_size)]
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    name = "ttft-quick" if args.quick else "ttft"
    (RESULTS_DIR / f"{name}.json").write_text(json.dumps({"machine": machine(), "rows": rows}, indent=2))
    plot(rows, RESULTS_DIR / f"{name}.png")
    print(f"wrote {RESULTS_DIR / name}.json and .png")


if __name__ == "__main__":
    main()
