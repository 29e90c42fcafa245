"""Decoding alone from `medusa bench` runs' raw.jsonl: per method, the verify and propose seconds per generated token
(what the prompt's prefill leaves out), target forwards and the steps that guessed nothing (plain steps, the guard's
included).

    python docs/benchmarks/cpu-zen4-long-context-session71/decode_ms.py RUN_DIR PRECISION [PRECISION ...]
"""

import json
import sys


def main() -> None:
    run, precisions = sys.argv[1], sys.argv[2:]
    for precision in precisions:
        totals: dict[str, list[float]] = {}
        for line in open(f"{run}/{precision}/raw.jsonl"):
            row = json.loads(line)
            turn = row["turns"][0]
            total = totals.setdefault(row["method"], [0.0, 0, 0.0, 0, 0])
            total[0] += turn["time_s"]
            total[1] += turn["new_tokens"]
            total[2] += turn["verify_s"] + (turn.get("propose_s") or 0.0)
            total[3] += turn["forwards"]
            total[4] += sum(1 for depth in turn.get("proposed_lengths") or [] if depth == 0)
        for method, (seconds, tokens, decoding, forwards, plain) in totals.items():
            per_token = f"{decoding / tokens * 1000:.1f}" if decoding else "-"
            print(
                f"{precision} {method}: {seconds:.1f} s in all, {tokens} tokens, decoding {per_token} ms a token, "
                f"{forwards} forwards, {plain} steps guessing nothing"
            )


if __name__ == "__main__":
    main()
