"""Where two data directories' greedy answers to the same prompts differ (bf16: near-ties, or a bug?), classified as
scripts/divergence.py classifies a benchmark's: the first differing token of each row is scored in float32 (the arbiter)
and in bfloat16 on the shared context; a near-tie when the two tokens' float32 logits lie within
max(NEAR_TIE_LOGITS, twice the bf16 error) of each other.
    python docs/benchmarks/cpu-datagen-engine-session52/divergence.py DATA_A DATA_B"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
from divergence import NEAR_TIE_LOGITS, first_difference, last_logits  # noqa: E402

from medusa.loading import load_base  # noqa: E402
from medusa.train.generate_data import load_shards  # noqa: E402

torch.set_num_threads(2)
answers = []
for directory in sys.argv[1:3]:
    rows = load_shards(directory)
    answers.append({tuple(r["input_ids"][: r["response_start"]]): r["input_ids"][r["response_start"] :] for r in rows})
a, b = answers
exact, _ = load_base(None, dtype="float32")
half, _ = load_base(None, dtype="bfloat16")
cases = []
for prompt, first in a.items():
    at = first_difference(first, b[prompt])
    if at is None:
        continue
    if at >= min(len(first), len(b[prompt])):  # one stopped where the other went on: no token pair to score
        cases.append({"position": at, "kind": "length"})
        continue
    ids = list(prompt) + first[:at]
    reference, rounded = last_logits(exact, ids), last_logits(half, ids)
    x, y = first[at], b[prompt][at]
    gap = float(reference[x] - reference[y])
    error = float(max(abs(rounded[x] - reference[x]), abs(rounded[y] - reference[y])))
    tie = abs(gap) <= max(2 * error, NEAR_TIE_LOGITS)
    cases.append({"position": at, "kind": "near_tie" if tie else "suspect", "float32_gap": gap, "bf16_error": error})
summary = {
    "rows": len(a),
    "identical": len(a) - len(cases),
    "near_ties": sum(c["kind"] == "near_tie" for c in cases),
    "suspects": sum(c["kind"] == "suspect" for c in cases),
    "largest_abs_float32_gap": max((abs(c["float32_gap"]) for c in cases if "float32_gap" in c), default=0.0),
    "cases": cases,
}
print(json.dumps({k: v for k, v in summary.items() if k != "cases"}))
print(json.dumps(summary, indent=1), file=open(Path(sys.argv[2]) / "divergence.json", "w"))
