"""Where a bench run's time went, per method: target forwards (verify), proposals, and the rest (prefill, masks,
acceptance, commit), from its raw.jsonl.
    python phases.py RUN [RUN ...]"""

import json
import sys

for run in sys.argv[1:]:
    records = [json.loads(line) for line in open(f"{run}/raw.jsonl")]
    for method in ("baseline_compiled", "planned"):
        turns = [turn for r in records if r["method"] == method for turn in r["turns"]]
        total, verify = sum(t["time_s"] for t in turns), sum(t["verify_s"] for t in turns)
        forwards, tokens = sum(t["forwards"] for t in turns), sum(t["new_tokens"] for t in turns)
        propose = sum(t.get("propose_s", 0.0) for t in turns)
        rest = total - verify - propose
        print(
            f"{run:9s} {method:18s} {tokens / total:6.1f} tok/s, {forwards} forwards, verify {verify:5.2f} s "
            f"({1000 * verify / forwards:5.2f} ms a forward), propose {propose:4.2f} s, rest {rest:4.2f} s"
        )
