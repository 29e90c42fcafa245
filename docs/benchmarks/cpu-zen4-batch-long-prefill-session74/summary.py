"""prefill.sh's runs as a table: tokens/s before -> after per prompt set, and whether the first tokens agree.

python summary.py OUT"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    out = Path(sys.argv[1])
    for after in sorted(out.glob("*-after.jsonl")):
        before = after.with_name(after.name.replace("-after", "-before"))
        if not before.exists():
            continue
        rows = {r["set"]: r for r in map(json.loads, before.read_text().splitlines())}
        print(f"\n{after.name.removesuffix('-after.jsonl')}: tokens/s before -> after (first tokens alike?)")
        for new in map(json.loads, after.read_text().splitlines()):
            old = rows[new["set"]]
            ratio = new["tokens_per_s"] / old["tokens_per_s"]
            alike = "same" if new["first_tokens"] == old["first_tokens"] else "DIFFER"
            print(f"| {new['set']} | {old['tokens_per_s']:.0f} | {new['tokens_per_s']:.0f} | {ratio:.2f}x | {alike} |")


if __name__ == "__main__":
    main()
