"""``kvboost-rag`` command line.

Exit codes: 0 success, 2 bad input or usage, 3 model not found or unsupported, 1 anything else.
"""

from __future__ import annotations

import argparse
import json
import sys

from .errors import InvalidRequestError, ModelNotFoundError, UnsupportedModelError
from .models import ALIASES

EXIT_OK, EXIT_ERROR, EXIT_BAD_INPUT, EXIT_MODEL = 0, 1, 2, 3


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvboost-rag", description="KV-cache reuse for local LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion (as a chat user message unless --raw)")
    gen.add_argument("prompt", help="the user message (or raw prompt with --raw); '-' reads standard input")
    gen.add_argument("--model", default="smollm2-135m-instruct", help="alias, HF id or local path")
    gen.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    gen.add_argument("--system", default=None, help="system prompt")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    gen.add_argument("--json", action="store_true", help="print the result with usage and timings as JSON")

    sub.add_parser("models", help="list the offline model aliases")
    return parser


def _generate(args: argparse.Namespace) -> int:
    from .engine import KVBoostEngine

    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.raw:
        prompt = text
    else:
        prompt = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": text}
        ]
    engine = KVBoostEngine.from_pretrained(args.model, dtype=args.dtype)
    kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed, stop=args.stop)
    if args.json:
        r = engine.generate(prompt, **kwargs)
        out = {"text": r.text, "finish_reason": r.finish_reason, "usage": vars(r.usage), "timings": vars(r.timings)}
        print(json.dumps(out, indent=2))
        return EXIT_OK
    for chunk in engine.stream(prompt, **kwargs):
        print(chunk.text, end="", flush=True)
        if chunk.result is not None:
            print(f"\n[{chunk.result.usage.prompt_tokens} prompt tokens, TTFT {chunk.result.timings.ttft_s:.3f} s]",
                  file=sys.stderr)
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "models":
            for name, spec in ALIASES.items():
                print(f"{name}\t(from PyPI: {', '.join(spec.packages)})")
            return EXIT_OK
        return _generate(args)
    except (ModelNotFoundError, UnsupportedModelError) as e:
        print(f"kvboost-rag: {e}", file=sys.stderr)
        return EXIT_MODEL
    except (InvalidRequestError, ValueError) as e:
        print(f"kvboost-rag: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
