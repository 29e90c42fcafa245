"""Long prompts in Spec-Bench's format, made from Spec-Bench's own summarization and RAG turns (read from
../shared/bench_data at run time, never copied into the repository): each question joins consecutive turns until it
holds about TOKENS tokens of SmolLM2's tokenizer, then asks for a summary of the last one. Writes the jsonl to OUT.

    python docs/benchmarks/cpu-zen4-long-context-session71/long_questions.py OUT.jsonl [--tokens 3500] [--count 4]
"""

import argparse
import json

from transformers import AutoTokenizer

from medusa.loading import resolve_base_path

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--tokens", type=int, default=3500)
parser.add_argument("--count", type=int, default=4)
parser.add_argument("--questions", default="../shared/bench_data/spec_bench_question.jsonl")
args = parser.parse_args()

tokenizer = AutoTokenizer.from_pretrained(resolve_base_path(None))  # the embedded SmolLM2's
turns = [
    row["turns"][0] for row in map(json.loads, open(args.questions)) if row["category"] in ("summarization", "rag")
]
questions, parts = [], []
for text in turns:
    parts.append(text)
    if len(tokenizer("\n\n".join(parts)).input_ids) >= args.tokens:
        prompt = "\n\n".join(parts) + "\n\nSummarise the last text above in three sentences."
        questions.append({"question_id": 9000 + len(questions), "category": "long_context", "turns": [prompt]})
        parts = []
    if len(questions) == args.count:
        break
with open(args.out, "w") as f:
    for q in questions:
        f.write(json.dumps(q) + "\n")
print(f"{len(questions)} questions of {[len(tokenizer(q['turns'][0]).input_ids) for q in questions]} tokens")
