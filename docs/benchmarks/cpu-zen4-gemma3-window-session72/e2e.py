"""End to end and decoding alone from `medusa bench` runs' raw.jsonl, and which answers differ from a reference
method's (same run) or between two runs (the first against the second, method by method).

    python docs/benchmarks/cpu-zen4-gemma3-window-session72/e2e.py REFERENCE RUN [BEFORE_RUN]
"""

import json
import sys

reference, runs = sys.argv[1], sys.argv[2:]
outputs = {}
for run in runs:
    totals: dict[str, list[float]] = {}
    for line in open(f"{run}/raw.jsonl"):
        row = json.loads(line)
        turn = row["turns"][0]
        total = totals.setdefault(row["method"], [0.0, 0, 0.0])
        total[0] += turn["time_s"]
        total[1] += turn["new_tokens"]
        total[2] += turn["verify_s"] + (turn.get("propose_s") or 0.0)
        outputs[(run, row["method"], row["question_id"])] = turn["output_ids"]
    for method, (seconds, tokens, decoding) in totals.items():
        alone = f", decoding {1000 * decoding / tokens:.1f} ms a token" if decoding else ""
        print(f"{run} {method}: {tokens / seconds:.2f} tokens/s end to end{alone}")
for (run, method, question), ids in outputs.items():
    if method not in ("baseline", reference) and ids != outputs[(run, reference, question)]:
        print(f"{run} {method} {question}: differs from {reference}")
    if run == runs[0] and len(runs) == 2 and outputs.get((runs[1], method, question)) != ids:
        print(f"{method} {question}: differs between the runs")
