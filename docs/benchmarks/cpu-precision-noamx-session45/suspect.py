"""The int4 suspect of `int4-noamx/` (q162, token 27): the int4 target's own logits (eager, bf16 activations) for the
two tokens at the context both runs shared, beside the float32 arbiter's (the same int4 weights, dequantised):

    ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 \
        python docs/benchmarks/cpu-precision-noamx-session45/suspect.py /tmp/bench45/int4-noamx
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
import divergence  # noqa: E402

from medusa.loading import load_base  # noqa: E402
from medusa.precision import load_target  # noqa: E402
from medusa.questions import load_questions  # noqa: E402
from medusa.runtime import dequantize_target, quantize_target  # noqa: E402

run = Path(sys.argv[1])
settings = json.loads((run / "settings.json").read_text())
records = [json.loads(line) for line in (run / "raw.jsonl").read_text().splitlines() if line.strip()]
questions = {q["question_id"]: q for q in load_questions(settings["questions"])}
exact, tokenizer = load_base(settings["base"], dtype=torch.float32)
dequantize_target(quantize_target(exact, "int4"))
half, _ = load_target(settings["base"], dtype="int4", tokenizer=tokenizer)
for case in divergence.divergences(records, questions, "baseline_compiled"):
    if case["question_id"] != 162 or case["method"] != "planned":
        continue
    ids = divergence.context_ids(tokenizer, case)
    for name, model in (("float32 arbiter", exact), ("int4 eager (bf16 activations)", half)):
        logits = divergence.last_logits(model, ids)
        top = torch.topk(logits, 3)
        words = [tokenizer.decode([i]) for i in top.indices.tolist()]
        print(f"{name}: top 3 {words} at {[round(v, 3) for v in top.values.tolist()]}")
