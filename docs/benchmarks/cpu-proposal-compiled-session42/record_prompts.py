"""The prompts both side-by-side scripts decode: the first turns of 12 Spec-Bench questions, two per category, in the
model's chat template."""

import json


def two_per_category(tokenizer, path: str = "../shared/bench_data/spec_bench_question.jsonl") -> list:
    by_category = {}
    for line in open(path):
        question = json.loads(line)
        by_category.setdefault(question["category"], [])
        if len(by_category[question["category"]]) < 2:
            by_category[question["category"]].append(question)
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q["turns"][0]}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )["input_ids"]
        for questions in by_category.values()
        for q in questions
    ]
