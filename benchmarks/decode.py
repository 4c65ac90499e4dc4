"""Decode speed of one stream: ms/token against the weight-read floor, HF ``generate`` and llama.cpp.

Three workloads, each at ~1K and ~4K tokens of context:
- ``rag``: the blend benchmark's passages and planted facts, a question whose answer quotes them;
- ``chat``: ShareGPT conversations up to a user turn;
- ``free``: an essay passage, then a request for new text (a story) that quotes nothing.

Per prompt, side by side in one process (methods in rotating order), every method produces
exactly ``--new-tokens`` greedy tokens from the same prompt ids, EOS ignored on every side:
- kvboost, speculation off (``max_draft_tokens=0``) and on (the default), the prompt stored
  first (a warm request: its TTFT is the warm TTFT);
- HF ``generate`` (SDPA, dynamic cache) after transformers' prompt reuse (a prefilled
  ``DynamicCache`` copied per request), and the same with ``prompt_lookup_num_tokens``;
- llama-cpp-python on the Q4_1 GGUF of the same model, its context kept (when installed).

Decode ms/token is (end - first token) / (new tokens - 1); end to end is TTFT + all tokens.
The floor is the weight-read floor of DESIGN.md: bytes of weights one step reads (the LM head
counted once when tied to the embeddings; an untied input embedding is not read whole)
divided by the read bandwidth of a one-row product over an 8192x8192 weight of the model's
dtype (``F.linear``), measured again beside each prompt's methods (the bandwidth this machine
gives drifts with the process's memory footprint); the bandwidth of the same product with a
oneDNN-packed weight (what the engine runs) is recorded beside it.

    python benchmarks/decode.py                     # 3 prompts per workload and length
    python benchmarks/decode.py --quick             # 1 prompt, 1K only
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from blend_quality import make_questions  # noqa: E402
from chat_replay import sharegpt_records  # noqa: E402
from common import (  # noqa: E402
    RESULTS_DIR,
    essay_text,
    median_time_s,
    summary,
    text_of_tokens,
    weight_read_floor,
    write_results,
)
from peers import LlamaCppPeer, llama_cpp_available, prefill_cache  # noqa: E402

from kvboost_rag import EngineConfig, KVBoostEngine, block_attention  # noqa: E402
from kvboost_rag.assembler.lean_forward import lean_forward_of  # noqa: E402
from kvboost_rag.models import load_model  # noqa: E402

MODEL = "smollm2-135m-instruct"
SYSTEM = "You are a helpful assistant."
STORY = "Now write a short story about a lighthouse keeper who finds a message in a bottle."
METHODS = ["kvboost", "kvboost_speculative", "hf_generate", "hf_prompt_lookup", "llama_cpp"]


# -- the prompts ---------------------------------------------------------------------------------


def prompt_tokens(tok: Any, messages: list[dict[str, str]]) -> int:
    """Tokens of ``messages`` as the chat template renders them, with the generation prompt."""
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(tok.encode(text, add_special_tokens=False))


def rag_prompts(tok: Any, tokens: int, n: int) -> list[list[dict[str, str]]]:
    """The blend benchmark's questions over its passages (the answering one first), as many passages
    as fit in ``tokens``; the question asks for the answer with its sentence quoted."""
    passages, questions = make_questions(tok, max(n, tokens // 250 + 2), passage_tokens=250, seed=7)
    out = []
    for q_index, q in enumerate(questions[:n]):
        question = f"{q['question']} Quote the sentence of the documents that gives it, then explain."
        chosen: list[str] = []
        for k in [q_index, *[k for k in range(len(passages)) if k != q_index]]:
            user = "Documents:\n\n" + "\n\n".join([*chosen, passages[k]]) + f"\n\nQuestion: {question}"
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
            if prompt_tokens(tok, messages) > tokens:
                break
            chosen.append(passages[k])
        user = "Documents:\n\n" + "\n\n".join(chosen) + f"\n\nQuestion: {question}"
        out.append([{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}])
    return out


def chat_prompts(tok: Any, tokens: int, n: int) -> list[list[dict[str, str]]]:
    """ShareGPT conversations (mostly ASCII, alternating turns) up to a user turn, 70-100 % of
    ``tokens`` long; the message that reaches ``tokens`` is cut there (long ones are pasted
    documents and code, as chats over a long paste have them)."""
    out = []
    for record in sharegpt_records():
        turns = record.get("conversations", [])
        if not turns or any(t.get("from") != ("human" if k % 2 == 0 else "gpt") for k, t in enumerate(turns)):
            continue
        if any(
            not t["value"].strip() or sum(c.isascii() for c in t["value"]) < 0.95 * len(t["value"])
            for t in turns
        ):
            continue
        messages = [{"role": "system", "content": SYSTEM}]
        for k, turn in enumerate(turns):
            role = "user" if k % 2 == 0 else "assistant"
            ids = tok.encode(turn["value"], add_special_tokens=False)
            room = tokens - prompt_tokens(tok, [*messages, {"role": role, "content": ""}])
            if room <= 0:
                break
            messages = [*messages, {"role": role, "content": tok.decode(ids[:room])}]
            if len(ids) > room:  # the last message is cut to fit
                break
        while len(messages) > 1 and messages[-1]["role"] != "user":
            messages.pop()
        if len(messages) > 1 and prompt_tokens(tok, messages) >= 0.7 * tokens:
            out.append(messages)
            if len(out) == n:
                return out
    raise SystemExit(f"only {len(out)} ShareGPT conversations reach {tokens} tokens")


def free_prompts(tok: Any, tokens: int, n: int) -> list[list[dict[str, str]]]:
    text = essay_text()
    return [
        [
            {"role": "system", "content": SYSTEM},
            {
                "role": "user",
                "content": text_of_tokens(tok, text, tokens - 60, 20000 + k * tokens) + "\n\n" + STORY,
            },
        ]
        for k in range(n)
    ]


WORKLOADS: dict[str, Callable[[Any, int, int], list[list[dict[str, str]]]]] = {
    "rag": rag_prompts,
    "chat": chat_prompts,
    "free": free_prompts,
}


# -- the methods ---------------------------------------------------------------------------------


class _Clock:
    """A transformers streamer that notes when each batch of tokens arrives (the prompt first)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_generate(model: Any, ids: list[int], cache: Any, new_tokens: int, **options: Any) -> dict[str, float]:
    """HF ``generate`` over a copy of the prompt's cache (all but the last token), EOS masked."""
    clock = _Clock()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            past_key_values=copy.deepcopy(cache),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            streamer=clock,
            pad_token_id=0,
            **options,
        )
    end = time.perf_counter()
    assert out.shape[1] - len(ids) == new_tokens
    first = clock.times[1]
    return {"ttft_s": first - t0, "decode_ms": 1000 * (end - first) / (new_tokens - 1), "total_s": end - t0}


def kvboost(engine: KVBoostEngine, messages: list[dict[str, str]], new_tokens: int) -> dict[str, float]:
    result = engine.generate(messages, max_new_tokens=new_tokens)
    assert result.usage.completion_tokens == new_tokens
    t = result.timings
    row = {
        "ttft_s": t.ttft_s,
        "decode_ms": 1000 * (t.total_s - t.ttft_s) / (new_tokens - 1),
        "total_s": t.total_s,
    }
    if result.usage.drafted_tokens:
        row["drafted"] = result.usage.drafted_tokens
        row["accepted"] = result.usage.accepted_tokens
    return row


def llama_cpp(peer: LlamaCppPeer, ids: list[int], new_tokens: int, eos: int) -> dict[str, float]:
    """Its context kept from the untimed run before (prefix reuse), EOS masked by a logit bias."""
    t0 = time.perf_counter()
    stream = peer.llm.create_completion(
        ids, max_tokens=new_tokens, temperature=0.0, stream=True, logit_bias={eos: -1e9}
    )
    times = [time.perf_counter() for _ in stream]
    first, end = times[0], times[-1]
    return {"ttft_s": first - t0, "decode_ms": 1000 * (end - first) / (len(times) - 1), "total_s": end - t0}


# -- what an exact step cannot go below -------------------------------------------------------


def exact_step_bound(model: Any, context_tokens: int, reps: int = 15) -> dict[str, float]:
    """The two parts of one exact decode step that no work around them can remove, each timed alone
    (median ms of ``reps``): the lean forward's products for the step's ``ROW_MULTIPLE`` rows (every
    layer, then the LM head) and the split-invariant attention of every layer at ``context_tokens``
    (the flash calls prefill makes too, so a step cannot use cheaper ones and keep its bits).

    Both run back to back on warm caches, with no norm, RoPE, cache write or Python between them:
    a lower bound of the step, not an estimate."""
    lean = lean_forward_of(model)
    layers = lean._layers  # the packed products the engine runs
    dtype = next(model.parameters()).dtype
    rows = block_attention.ROW_MULTIPLE
    first = layers[0]
    hidden = torch.randn(1, rows, first.heads * first.head_dim, dtype=dtype)
    inner = torch.randn(1, rows, first.down.weights[0].shape[1], dtype=dtype)
    keys = block_attention.round_up(context_tokens + 1, block_attention.KEY_BLOCK)
    kv = [
        (
            torch.randn(1, L.kv_heads, keys, L.head_dim, dtype=dtype),
            torch.randn(1, L.kv_heads, keys, L.head_dim, dtype=dtype),
        )
        for L in layers
    ]
    query = torch.randn(1, first.heads, rows, first.head_dim, dtype=dtype)

    def products() -> None:
        for L in layers:
            L.qkv.fused(hidden), L.o_proj.fused(hidden), L.gate_up.fused(hidden), L.down.fused(inner)
        lean._head.fused(hidden)

    def attention() -> None:
        with block_attention.queries_at(
            context_tokens, rows, first.heads // first.kv_heads, dtype, query.device, real=1
        ):
            for L, (k, v) in zip(layers, kv, strict=True):
                block_attention.block_causal_attention(
                    L.attention_module, query, k, v, None, dropout=0.0, scaling=L.scaling
                )

    with torch.inference_mode():
        parts = {
            "products_ms": 1000 * median_time_s(products, reps),
            "attention_ms": 1000 * median_time_s(attention, reps),
        }
    return {**parts, "ms": parts["products_ms"] + parts["attention_ms"]}


# -- the run -------------------------------------------------------------------------------------


def ignore_eos(engine: KVBoostEngine) -> None:
    """Every method produces the same number of tokens: the engine never stops at EOS here."""
    engine.core.eos_ids = frozenset()


def run(args: argparse.Namespace) -> dict[str, Any]:
    model, tok = load_model(MODEL, dtype=args.dtype)
    dtype = next(model.parameters()).dtype
    engines = {
        "kvboost": KVBoostEngine(model, tok, config=EngineConfig(max_draft_tokens=0, store_replies=False)),
        "kvboost_speculative": KVBoostEngine(model, tok, config=EngineConfig(store_replies=False)),
    }
    for engine in engines.values():
        ignore_eos(engine)
    use_llama = llama_cpp_available() and not args.no_llama_cpp
    eos = tok.eos_token_id
    floor = weight_read_floor(model)
    print(
        f"floor: {floor['weight_bytes'] / 1e6:.0f} MB a step at {floor['read_bytes_per_s'] / 1e9:.1f} GB/s "
        f"= {floor['ms_per_token']:.1f} ms/token (packed product: {floor['packed_ms_per_token']:.1f} ms)",
        flush=True,
    )
    cells = []
    for length in args.lengths:
        peer = LlamaCppPeer(n_ctx=length + args.new_tokens + 256) if use_llama else None
        for workload in args.workloads:
            prompts = WORKLOADS[workload](tok, length, args.prompts)
            rows = []
            for k, messages in enumerate(prompts):
                ids = engines["kvboost"].canonicalize(messages).token_ids
                for engine in engines.values():  # the prompt stored: warm requests
                    engine.generate(messages, max_new_tokens=1)
                cache = prefill_cache(model, ids[:-1])
                if peer is not None:
                    peer.llm.reset()
                    peer.ttft(ids)  # the context now holds the prompt
                methods = {
                    "kvboost": lambda m=messages: kvboost(engines["kvboost"], m, args.new_tokens),
                    "kvboost_speculative": lambda m=messages: kvboost(
                        engines["kvboost_speculative"], m, args.new_tokens
                    ),
                    "hf_generate": lambda i=ids, c=cache: hf_generate(model, i, c, args.new_tokens),
                    "hf_prompt_lookup": lambda i=ids, c=cache: hf_generate(
                        model, i, c, args.new_tokens, prompt_lookup_num_tokens=10
                    ),
                }
                if peer is not None:
                    methods["llama_cpp"] = lambda i=ids, p=peer: llama_cpp(p, i, args.new_tokens, eos)
                order = list(methods)
                order = order[k % len(order) :] + order[: k % len(order)]
                # the floor measured again beside each prompt's methods: the same memory state and noise
                row: dict[str, Any] = {
                    "prompt_tokens": len(ids),
                    "floor": weight_read_floor(model),
                    "step_bound": exact_step_bound(model, len(ids)),
                }
                for name in order:
                    row[name] = methods[name]()
                rows.append(row)
                print(
                    f"{workload} {length}: prompt {k + 1} ({len(ids)} tokens): "
                    + ", ".join(f"{n} {row[n]['decode_ms']:.1f}" for n in methods)
                    + f" ms/token; exact step's products + attention alone {row['step_bound']['ms']:.1f} ms"
                    + f" (floor {row['floor']['ms_per_token']:.1f})",
                    flush=True,
                )
            cells.append(summarize(workload, length, rows))
    for engine in engines.values():
        engine.close()
    return {"floor": floor, "cells": cells, "dtype": str(dtype).removeprefix("torch.")}


def summarize(workload: str, length: int, rows: list[dict[str, Any]]) -> dict[str, Any]:
    present = [m for m in METHODS if m in rows[0]]
    cell: dict[str, Any] = {
        "workload": workload,
        "context_tokens": length,
        "prompt_tokens": summary([r["prompt_tokens"] for r in rows]),
        "decode_ms": {m: summary([r[m]["decode_ms"] for r in rows]) for m in present},
        "ttft_s": {m: summary([r[m]["ttft_s"] for r in rows]) for m in present},
        "end_to_end_s": {m: summary([r[m]["total_s"] for r in rows]) for m in present},
        "floor_ms": summary([r["floor"]["ms_per_token"] for r in rows]),
        "step_bound_ms": {
            part: summary([r["step_bound"][part] for r in rows])
            for part in ("products_ms", "attention_ms", "ms")
        },
        "step_bound_ratio": summary([r["step_bound"]["ms"] / r["floor"]["ms_per_token"] for r in rows]),
        "floor_ratio": {
            m: summary([r[m]["decode_ms"] / r["floor"]["ms_per_token"] for r in rows]) for m in present
        },
        # tokens/s ratios per prompt (the same machine noise), then their median
        "speedup_over_hf_generate": {
            m: summary([r["hf_generate"]["decode_ms"] / r[m]["decode_ms"] for r in rows]) for m in present
        },
        "speedup_over_hf_prompt_lookup": {
            m: summary([r["hf_prompt_lookup"]["decode_ms"] / r[m]["decode_ms"] for r in rows])
            for m in present
        },
        "rows": rows,
    }
    drafted = [r["kvboost_speculative"].get("drafted", 0) for r in rows]
    accepted = [r["kvboost_speculative"].get("accepted", 0) for r in rows]
    cell["acceptance"] = sum(accepted) / max(sum(drafted), 1)
    return cell


def plot(data: dict[str, Any], path: Path) -> None:
    """ms/token per method for each workload and context length, the floor as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = data["cells"]
    methods = [m for m in METHODS if m in cells[0]["decode_ms"]]
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(cells)), 4.5))
    width = 0.8 / len(methods)
    for j, method in enumerate(methods):
        medians = [c["decode_ms"][method]["median"] for c in cells]
        low = [m - c["decode_ms"][method]["min"] for m, c in zip(medians, cells, strict=True)]
        high = [c["decode_ms"][method]["max"] - m for m, c in zip(medians, cells, strict=True)]
        xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(cells))]
        ax.bar(xs, medians, width, yerr=[low, high], capsize=2, label=method)
    for i, c in enumerate(cells):  # the floor measured beside that cell's prompts
        ax.hlines(c["floor_ms"]["median"], i - 0.45, i + 0.45, colors="black", linestyles="--", linewidth=1)
    ax.plot([], [], color="black", linestyle="--", linewidth=1, label="weight-read floor")
    ax.set_xticks(range(len(cells)), [f"{c['workload']}\n{c['context_tokens']} tokens" for c in cells])
    ax.set_ylabel("decode ms / token (median, min-max)")
    ax.set_title(f"One stream, {data['settings']['new_tokens']} new tokens, {data['settings']['dtype']}")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--quick", action="store_true", help="1 prompt per workload, 1K only")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.quick:
        args.lengths, args.prompts = [1024], 1
    out = args.out or RESULTS_DIR / ("decode-quick.json" if args.quick else "decode.json")
    t0 = time.perf_counter()
    data = run(args)
    settings = {
        "model": MODEL,
        "dtype": data["dtype"],
        "new_tokens": args.new_tokens,
        "prompts_per_cell": args.prompts,
        "llama_cpp_gguf": "SmolLM2-135M-Instruct.Q4_1.gguf"
        if "llama_cpp" in data["cells"][0]["decode_ms"]
        else None,
    }
    data["settings"] = settings
    write_results(
        out, settings=settings, seconds=time.perf_counter() - t0, floor=data["floor"], cells=data["cells"]
    )
    plot(data, out.with_suffix(".png"))
    for cell in data["cells"]:
        ms = cell["decode_ms"]
        over_hf = cell["speedup_over_hf_generate"]["kvboost_speculative"]["median"]
        over_lookup = cell["speedup_over_hf_prompt_lookup"]["kvboost_speculative"]["median"]
        print(
            f"{cell['workload']} {cell['context_tokens']}: "
            + ", ".join(f"{m} {ms[m]['median']:.1f}" for m in ms)
            + f" ms/token; kvboost/floor {cell['floor_ratio']['kvboost']['median']:.2f}x "
            f"(products + attention alone {cell['step_bound_ratio']['median']:.2f}x); "
            f"speculative over HF generate {over_hf:.2f}x, over prompt lookup {over_lookup:.2f}x; "
            f"acceptance {100 * cell['acceptance']:.0f} %"
        )
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
