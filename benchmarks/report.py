"""Write the README's results section from the benchmark JSON under docs/benchmarks/.

    python benchmarks/report.py          # rewrites the block between the results markers in README.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
START, END = "<!-- results:start -->", "<!-- results:end -->"


def ttft_table(data: dict) -> list[str]:
    lines = [
        "| dtype | prompt tokens | plain HF prefill | kvboost cold | cold speed vs plain | warm (memory) "
        "| HF DynamicCache copy | cold / warm |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in data["rows"]:
        ratios = r["ratios"]
        lines.append(
            f"| {r['dtype']} | {r['prompt_tokens']} | {r['plain_prefill']['median']:.2f} s | {r['cold']['median']:.2f} s "
            f"| {ratios['plain_over_cold']['median']:.2f}x | {r['warm_memory']['median'] * 1000:.0f} ms "
            f"| {r['hf_prefix_reuse']['median'] * 1000:.0f} ms | {ratios['cold_over_warm']['median']:.1f}x |"
        )
    return lines


def disk_table(data: dict) -> list[str]:
    lines = [
        "| prompt tokens | read from disk | cold | warm from disk (fresh process) | floor | cold / disk | disk / floor |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in data["rows"]:
        lines.append(
            f"| {r['prompt_tokens']} | {r['bytes_read'] / 2**20:.0f} MiB | {r['cold']['median']:.2f} s "
            f"| {r['disk']['median'] * 1000:.0f} ms | {r['floor']['median'] * 1000:.0f} ms "
            f"| {r['cold_over_disk']['median']:.1f}x | {r['disk_over_floor']['median']:.2f}x |"
        )
    p = data["prewarm"]
    lines.append("")
    lines.append(f"Pre-warming: {p['prewarm_tokens_per_s']:.0f} tokens/s (disk writes included) next to "
                 f"{p['plain_prefill_tokens_per_s']:.0f} tokens/s of plain prefill of the same documents.")
    return lines


def main() -> int:
    bench = ROOT / "docs" / "benchmarks"
    ttft, disk = json.loads((bench / "ttft.json").read_text()), json.loads((bench / "disk_ttft.json").read_text())
    m = ttft["machine"]
    block = [
        START,
        f"Measured on {m['cpu_count']} CPU cores ({m['processor']}), torch {m['torch']}, transformers "
        f"{m['transformers']}, SmolLM2-135M-Instruct; medians of {ttft['rows'][0]['reps']} repetitions, every "
        "variant run side by side in each repetition; ratios are medians of per-repetition ratios (JSON with quartiles in `docs/benchmarks/`).",
        "",
        "Time to first token, memory tier (`python benchmarks/ttft.py`):",
        "",
        *ttft_table(ttft),
        "",
        "![TTFT](docs/benchmarks/ttft.png)",
        "",
        "Disk tier, bfloat16 (`python benchmarks/disk_ttft.py`):",
        "",
        *disk_table(disk),
        END,
    ]
    readme = (ROOT / "README.md").read_text()
    if START not in readme:
        print("README.md has no results markers", file=sys.stderr)
        return 1
    head, rest = readme.split(START, 1)
    tail = rest.split(END, 1)[1]
    (ROOT / "README.md").write_text(head + "\n".join(block) + tail)
    return 0


if __name__ == "__main__":
    sys.exit(main())
