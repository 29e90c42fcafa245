"""Our EAGLE-3 draft in OpenVINO GenAI against OpenVINO's own plain greedy decoding: identical output? tokens per
main-model step, tokens/s with and without the draft. Prints a JSON summary.

Run it with the python of an OpenVINO venv (openvino-genai 2026.4.1, optimum-intel 2.2.0; see
shared/peers/openvino.md); it needs neither torch nor medusa. Export first (TARGET: the target's HF directory, e.g.
the converted SmolLM2 under ~/.cache/medusa/gguf/; OV: the OpenVINO venv):

    .venv/bin/python -m medusa export runs/eagle3-smollm2 /tmp/ov/draft-eagle3 --format eagle3
    cp $TARGET/tokenizer.json $TARGET/tokenizer_config.json $TARGET/chat_template.jinja /tmp/ov/draft-eagle3/
    export HF_HUB_OFFLINE=1
    $OV/bin/optimum-cli export openvino -m $TARGET --task text-generation-with-past --weight-format fp32 \\
        /tmp/ov/target-ov
    $OV/bin/optimum-cli export openvino -m /tmp/ov/draft-eagle3 --task text-generation-with-past \\
        --trust-remote-code --weight-format fp32 /tmp/ov/draft-ov
    $OV/bin/python scripts/openvino_eagle3.py /tmp/ov/target-ov /tmp/ov/draft-ov \\
        --questions shared/bench_data/spec_bench_question.jsonl --limit 1

GenAI taps the target's layers at the residual add that ends decoder layer i, i.e. transformers' hidden_states[i + 1],
while EAGLE-3 (and this library) number a layer by the residual stream entering it, hidden_states[i]. This script
therefore tells GenAI the draft's `eagle_aux_hidden_state_layer_ids` minus one (rewriting the draft IR's runtime info
`hidden_layers_list` in a temporary copy when it differs); --layer-shift 0 keeps GenAI's own numbering. Figures:
docs/benchmarks/cpu-eagle3-limit2-avx512/README.md.

Precision: INFERENCE_PRECISION_HINT=f32 alone leaves the paged KV cache in f16; with it a tree (--tree-depth,
--branching-factor > 1) changed the greedy output in GenAI 2026.4.1 (a chain did not), so KV_CACHE_PRECISION=f32 too.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import openvino as ov
import openvino_genai as og

MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
IR = "openvino_model.xml"


def load_prompts(path: str, limit: int | None) -> list[dict]:
    """Spec-Bench JSONL -> first turns, `limit` per group (MT-bench's categories form one group, round-robin)."""
    groups: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for line in Path(path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            category = row.get("category") or "all"
            groups["mt_bench" if category in MT_BENCH else category][category].append(row)
    chosen = []
    for by_category in groups.values():
        mixed = [
            qs[r] for r in range(max(map(len, by_category.values()))) for qs in by_category.values() if r < len(qs)
        ]
        chosen += mixed[:limit] if limit else mixed
    return [{"id": q.get("question_id"), "category": q.get("category"), "text": q["turns"][0]} for q in chosen]


def draft_with_layers(draft_dir: Path, shift: int, work: Path) -> tuple[Path, list[int]]:
    """The draft IR directory with GenAI's `hidden_layers_list` set to the draft's target layers + `shift`."""
    config = json.loads((draft_dir / "config.json").read_text())
    layers = [int(i) + shift for i in config.get("eagle_aux_hidden_state_layer_ids") or []]
    if not layers:
        return draft_dir, []  # GenAI's default: [2, L // 2, L - 3]
    model = ov.Core().read_model(draft_dir / IR)
    current = model.get_rt_info("hidden_layers_list").astype(str) if model.has_rt_info("hidden_layers_list") else ""
    if current.split() == [str(i) for i in layers]:
        return draft_dir, layers
    out = work / "draft"
    shutil.copytree(draft_dir, out, ignore=shutil.ignore_patterns("openvino_model.*"))
    model.set_rt_info(" ".join(map(str, layers)), "hidden_layers_list")
    ov.save_model(model, out / IR, compress_to_fp16=False)
    return out, layers


def run(pipe, ids: list[int], config) -> dict:
    start = time.perf_counter()
    result = pipe.generate(ov.Tensor(np.array([ids], dtype=np.int64)), config)
    seconds = time.perf_counter() - start
    tokens = list(result.tokens[0])
    return {"tokens": tokens, "seconds": seconds, "tok_s": len(tokens) / seconds, "result": result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", type=Path, help="the target's OpenVINO IR directory (optimum-cli export)")
    parser.add_argument("draft", type=Path, help="the EAGLE-3 draft's OpenVINO IR directory")
    parser.add_argument("--questions", required=True, help="Spec-Bench style JSONL (first turns are used)")
    parser.add_argument("--limit", type=int, default=1, help="questions per group (0: all)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-assistant-tokens", type=int, default=5, help="draft tokens per main-model step")
    parser.add_argument("--tree-depth", type=int, default=0, help="EAGLE-3 tree depth (0: a chain)")
    parser.add_argument("--branching-factor", type=int, default=1)
    parser.add_argument("--precision", default="f32", help="INFERENCE_PRECISION_HINT (f32 matches transformers)")
    parser.add_argument("--kv-cache-precision", default="f32", help="KV_CACHE_PRECISION (f16 breaks trees: see above)")
    parser.add_argument("--layer-shift", type=int, default=-1, help="added to the draft's target layers for GenAI")
    args = parser.parse_args()

    props = {
        "INFERENCE_NUM_THREADS": args.threads,
        "INFERENCE_PRECISION_HINT": args.precision,
        "KV_CACHE_PRECISION": args.kv_cache_precision,
    }
    plain = og.LLMPipeline(args.target, "CPU", **props)
    with tempfile.TemporaryDirectory() as work:  # GenAI reads the draft IR when the pipeline is built
        draft_dir, layers = draft_with_layers(args.draft, args.layer_shift, Path(work))
        eagle = og.LLMPipeline(args.target, "CPU", draft_model=og.draft_model(draft_dir, "CPU", **props), **props)

    tokenizer = plain.get_tokenizer()
    greedy = og.GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False, apply_chat_template=False)
    drafted = og.GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False, apply_chat_template=False)
    drafted.num_assistant_tokens = args.num_assistant_tokens
    if args.tree_depth:
        drafted.tree_depth, drafted.branching_factor = args.tree_depth, args.branching_factor

    prompts = load_prompts(args.questions, args.limit or None)
    for prompt in prompts:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt["text"]}], add_generation_prompt=True)
        prompt["ids"] = [int(i) for i in tokenizer.encode(text, add_special_tokens=False).input_ids.data[0]]
    for pipe, config in ((plain, greedy), (eagle, drafted)):  # warm-up: first inferences pay for compilation
        pipe.generate(ov.Tensor(np.array([prompts[0]["ids"]], dtype=np.int64)), config)

    rows, totals = [], defaultdict(float)
    for prompt in prompts:
        base, spec = run(plain, prompt["ids"], greedy), run(eagle, prompt["ids"], drafted)
        sd = spec.pop("result").extended_perf_metrics
        main_steps = len(sd.main_model_metrics.raw_metrics.m_durations)  # main-model infer calls, prefill included
        rows.append(
            {
                "id": prompt["id"],
                "category": prompt["category"],
                "identical": base["tokens"] == spec["tokens"],
                "new_tokens": len(spec["tokens"]),
                "main_steps": main_steps,
                "accepted": sd.get_num_accepted_tokens(),
                "tokens_per_step": round(len(spec["tokens"]) / main_steps, 3),
                "tok_s_plain": round(base["tok_s"], 2),
                "tok_s_eagle3": round(spec["tok_s"], 2),
                "ratio": round(spec["tok_s"] / base["tok_s"], 3),
            }
        )
        totals["plain_tokens"] += len(base["tokens"])
        totals["plain_s"] += base["seconds"]
        totals["tokens"] += len(spec["tokens"])
        totals["eagle3_s"] += spec["seconds"]
        totals["steps"] += main_steps

    summary = {
        "openvino_genai": og.get_version(),
        "precision": args.precision,
        "kv_cache_precision": args.kv_cache_precision,
        "threads": args.threads,
        "num_assistant_tokens": args.num_assistant_tokens,
        "tree": [args.tree_depth, args.branching_factor] if args.tree_depth else None,
        "hidden_layers_list": layers or "GenAI default",
        "prompts": rows,
        "overall": {
            "identical": all(r["identical"] for r in rows),
            "tokens_per_step": round(totals["tokens"] / totals["steps"], 3),
            "tok_s_plain": round(totals["plain_tokens"] / totals["plain_s"], 2),
            "tok_s_eagle3": round(totals["tokens"] / totals["eagle3_s"], 2),
            "ratio": round((totals["tokens"] / totals["eagle3_s"]) / (totals["plain_tokens"] / totals["plain_s"]), 3),
        },
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
