"""The KV a request holds on a sliding-window model, with and without dropping what no step attends.

One prompt of ``--prompt-tokens`` essay tokens, then ``--new-tokens`` greedy decode steps on the
engine's exact path, twice on one engine: once as a request decodes (its sliding layers drop the
key blocks behind the window) and once keeping every position (``keep_from=0``, what a request
whose reply is stored for the next turn keeps from its prompt's end on). Reported: slots per
sliding and per full-attention layer, all KV bytes, ms per decode step.

    python benchmarks/window_memory.py [--model gemma3-270m] [--prompt-tokens 4000] [--new-tokens 600]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, essay_text, text_of_tokens, write_results  # noqa: E402

from kvboost_rag import KVBoostEngine  # noqa: E402
from kvboost_rag.assembler.buffered_cache import buffered_layers  # noqa: E402
from kvboost_rag.decoding import DecodeStepper  # noqa: E402
from kvboost_rag.models import load_model  # noqa: E402


def held(engine: KVBoostEngine, ids: list[int], new_tokens: int, keep_from: int | None) -> dict[str, Any]:
    assembler = engine.core.assembler
    cache = assembler.new_cache(len(ids) + new_tokens)
    logits = assembler.forward(cache, ids, 0)
    assert logits is not None
    stepper = DecodeStepper(
        assembler, cache, ids, end=len(ids) + new_tokens + 1, max_draft_tokens=0, keep_from=keep_from
    )
    t0 = time.perf_counter()
    for _ in range(new_tokens):
        logits = stepper.next_logits(int(logits.argmax()))
    step_ms = (time.perf_counter() - t0) / new_tokens * 1000
    layers = buffered_layers(cache)
    return {
        "sliding_layer_slots": max((lay._k.shape[2] for lay in layers if lay.window), default=0),
        "full_layer_slots": max((lay._k.shape[2] for lay in layers if not lay.window), default=0),
        "kv_bytes": sum(2 * lay._k.numel() * lay._k.element_size() for lay in layers),
        "ms_per_step": step_ms,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    parser.add_argument("--new-tokens", type=int, default=600)
    args = parser.parse_args()
    model, tokenizer = load_model(args.model, dtype=torch.bfloat16)
    engine = KVBoostEngine(model, tokenizer)
    prompt = text_of_tokens(tokenizer, essay_text(), args.prompt_tokens)
    ids = engine.canonicalize(prompt).token_ids
    dropping = held(engine, ids, args.new_tokens, None)
    keeping = held(engine, ids, args.new_tokens, 0)
    for name, row in (("dropping", dropping), ("keeping all", keeping)):
        print(
            f"{name:>12}: {len(ids)} prompt + {args.new_tokens} new tokens: "
            f"{row['sliding_layer_slots']} slots per sliding layer, {row['full_layer_slots']} per full one, "
            f"KV {row['kv_bytes'] / 2**20:.1f} MiB, {row['ms_per_step']:.1f} ms/step"
        )
    out = RESULTS_DIR / f"window_memory_{args.model}.json"
    write_results(
        out,
        model=args.model,
        prompt_tokens=len(ids),
        new_tokens=args.new_tokens,
        dropping=dropping,
        keeping=keeping,
    )


if __name__ == "__main__":
    main()
