# the int4 no-AMX suspect (q162 token 27): the int4 target's own logits (eager, bf16 activations) for both tokens,
# and the float32 arbiter's, at the shared context; and the same with the plain engine's context one step further
import json, sys
from pathlib import Path
import torch
sys.path.insert(0, "scripts")
import divergence as dv
from medusa.loading import load_base
from medusa.precision import load_target
from medusa.questions import load_questions
from medusa.runtime import dequantize_target, quantize_target
run = Path("/tmp/bench45/int4-noamx")
settings = json.loads((run / "settings.json").read_text())
records = [json.loads(l) for l in (run / "raw.jsonl").read_text().splitlines() if l.strip()]
questions = {q["question_id"]: q for q in load_questions(settings["questions"])}
exact, tok = load_base(settings["base"], dtype=torch.float32)
dequantize_target(quantize_target(exact, "int4"))
half, _ = load_target(settings["base"], dtype="int4", tokenizer=tok)
for case in dv.divergences(records, questions, "baseline_compiled"):
    if case["question_id"] != 162 or case["method"] != "planned":
        continue
    ids = dv.context_ids(tok, case)
    b, m = case["baseline_token"], case["method_token"]
    for name, model in (("float32 arbiter", exact), ("int4 eager (bf16 activations)", half)):
        logits = dv.last_logits(model, ids)
        top = torch.topk(logits, 3)
        print(f"{name}: {tok.decode([b])!r} {logits[b]:.3f}  {tok.decode([m])!r} {logits[m]:.3f}  gap {logits[b]-logits[m]:.3f}; top3 {[tok.decode([i]) for i in top.indices.tolist()]} {[round(v,3) for v in top.values.tolist()]}")
