"""Spec-Bench style speed benchmark: speculative methods against plain `generate`, same model, same machine, same run.

    medusa bench --questions ../shared/bench_data/spec_bench_question.jsonl --limit 10 \
        --methods baseline,prompt_lookup,medusa,medusa_dynamic,hybrid --out runs/bench \
        [--heads DIR] [--base PATH] [--tree NAME] [--dtype float32|bfloat16] [--max-new-tokens 128] \
        [--temperature 0] [--draft PATH|early-exit:N] [--gamma 5] [--threads N] [--seed 0] [--no-profile] [--overwrite]

Methods (interleaved per question, after a warm-up):
  baseline        transformers greedy (or sampling, --temperature > 0) `generate` of the base model (eager)
  baseline_compiled  the best plain decoding at hand: this library's one-token-a-step decoding on the fastest plain
                  engine the plan measured (compiled: StaticCache, weights pre-packed on CPU, CUDA graphs on a GPU;
                  inductor: torch.compile's C++ GEMMs on CPU; medusa.runtime), the compiled engine without a plan
  plain           one token a step in this library's loop on --engine (no guesses)
  planned         MedusaModel.generate with nothing named: the engine, proposer and tree of the calibrated plan
                  (medusa.plan; --plan auto), guarded online
  prompt_lookup   transformers `generate(prompt_lookup_num_tokens=10)`
  assisted        transformers `generate(assistant_model=--draft)`
  medusa          MedusaModel.generate, static tree (--tree or the heads' own)
  medusa_dynamic  per-step tree from the heads' probabilities (proposer "dynamic"), as many nodes as the static tree
  hybrid          static Medusa tree plus a prompt-lookup chain in one verify pass (proposer "hybrid")
  lookup          this library's prompt lookup: a tree over every earlier match (proposer "prompt_lookup")
  medusa_typical  Medusa static tree with typical acceptance (lossy; meant for --temperature > 0)
  draft           MedusaModel.from_draft_model(base, --draft): classic speculative decoding in this library's loop
                  (--draft early-exit:N drafts with the target's own first N layers; --gamma tokens per step)
  eagle3          an EAGLE-3 draft (--eagle3; on the embedded SmolLM2 its shipped draft) drafting --gamma tokens a
                  step from the target's hidden states (medusa.eagle3), or a dynamic tree of --eagle3-nodes nodes, in
                  this library's loop on --engine
  eagle3_planned  the same draft with nothing named: the engine and tree size of its own calibrated plan (--plan
                  auto; sizes weighed where the draft's directory keeps decoded taus: medusa accuracy --taus --eagle3),
                  guarded online
  llama_cpp       llama.cpp's plain decoding (`llama-completion`) of the same weights in the GGUF type matching --dtype
                  (F32, BF16; made once from the base's GGUF with llama-quantize), same prompt text, greedy, same
                  threads; timed by llama.cpp's own prompt-eval + eval lines (prefill included, model load not)
  llama_cpp_lookup  llama.cpp's prompt lookup decoding (`llama-lookup`), the same way
  medusa@N, medusa_dynamic@N, hybrid@N  one fixed option the plan weighs: that proposer with the tree of N nodes
                  (root included) the plan grows from the heads' accuracy table, on --engine; beside `planned`,
                  whether the plan chose well
  The llama.cpp methods use the binaries in $LLAMA_CPP_BIN (default ~/.cache/medusa-peers/llama.cpp/bin, what
  ../shared/peers/build_llama_cpp.sh builds) and are skipped, saying why, when they are absent or the base is no GGUF.
  Their output ids are their text tokenized by the base's tokenizer.

Questions are Spec-Bench jsonl (`{question_id, category, turns[]}`); the eight MT-bench categories are reported as
one, `mt_bench`, as Spec-Bench does. `--limit N` keeps N questions per reported category (MT-bench questions taken
round-robin across its categories). Every turn's answer goes back into that method's own conversation (chat
template) before the next turn.

Speedup = (total new tokens / total time) of a method over the same for `baseline`, per category and overall;
speedup_vs_compiled the same over `baseline_compiled`, speedup_vs_llama_cpp over `llama_cpp`. --engine runs this
library's methods on the eager engine (the exact reference), the compiled one or the inductor one (default: the engine
of the plan's fastest plain decoding, else compiled). identical_share / identical_share_vs_compiled: the share of
turns whose output equals baseline's / baseline_compiled's.
tau = new tokens per target forward (counted with a forward hook, so also for transformers' methods; plain
decoding = 1.00). `identical` = every output equals the baseline's (meaningful at temperature 0 only).
The analysis of Leviathan et al. is reported next to it: alpha (acceptance rate per guess, the
maximum-likelihood estimate of DecodeStats.acceptance_rate), gamma (mean guesses per step, i.e. proposal depth),
c (proposal cost per guess over the target's verify forward), predicted speedup
(1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)), and verify_cost (a verify forward over a baseline forward:
the formula takes it as 1, which a CPU does not give), with the prediction divided by it.

Writes <out>/raw.jsonl (one line per question and method: every turn's tokens, time, forwards, accepted lengths;
a rerun with the same settings resumes from it), <out>/summary.json, <out>/summary.md and <out>/speedup.png.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
import transformers
from tqdm import tqdm
from transformers import GenerationConfig

from medusa import MedusaModel, llama_cpp
from medusa.batch import left_padded
from medusa.cli import NO_HEADS, NO_HEADS_HELP, load_model
from medusa.config import CONFIG_NAME
from medusa.decode import DecodeStats
from medusa.eagle3_io import SHIPPED_DRAFT
from medusa.fileio import atomic_write_text
from medusa.hardware import describe
from medusa.loading import DEFAULT_BASE, base_gguf
from medusa.model import DEFAULT_HEADS_DIR
from medusa.precision import PRECISIONS
from medusa.questions import answer_message, encode_conversation, load_questions, per_group
from medusa.runtime import ENGINES, batch_engine, engine_for
from medusa.tree_builder import grow_tree

METHODS = (
    "baseline",
    "baseline_compiled",
    "plain",
    "planned",
    "prompt_lookup",
    "assisted",
    "medusa",
    "medusa_dynamic",
    "hybrid",
    "lookup",
    "medusa_typical",
    "draft",
    "eagle3",
    "eagle3_planned",
    "llama_cpp",
    "llama_cpp_lookup",
)
# our methods that take a tree -> their proposer; "name@N" runs the plan's tree of N nodes (sized_method)
SIZED = {"medusa": "medusa", "medusa_dynamic": "dynamic", "hybrid": "hybrid"}
PEERS = {"llama_cpp": "plain", "llama_cpp_lookup": "lookup"}  # method -> llama_cpp.generate's method
# n-gram proposals made outside our loop (transformers', llama.cpp's): c = 0 (ours are timed by the profiler)
MODEL_FREE = frozenset({"prompt_lookup", "llama_cpp_lookup"})
PLAIN = frozenset({"baseline", "baseline_compiled", "plain", "llama_cpp"})  # one token a step: no guesses to analyse
PROMPT_LOOKUP_TOKENS = 10
WARMUP_TOKENS = 16
PROPOSAL_ROWS = 96  # room past the last token for one proposal's nodes (trees and hybrid chains stay below this)
RESUME_KEYS = (
    "questions",
    "base",
    "heads",
    "tree",
    "dtype",
    "device",
    "max_new_tokens",
    "temperature",
    "draft",
    "eagle3",
    "eagle3_nodes",
    "gamma",
    "threads",
    "seed",
    "profile",
    "engine",
    "batch_size",
)


def sized_method(name: str) -> tuple[str, int] | None:
    """ "medusa_dynamic@8" -> ("dynamic", 8): a SIZED method's proposer and its tree's nodes; None for other names."""
    method, at, nodes = name.partition("@")
    if not at or method not in SIZED or not nodes.isdigit() or int(nodes) < 2:
        return None
    return SIZED[method], int(nodes)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="medusa bench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    parser.add_argument("--questions", required=True, help="Spec-Bench format jsonl")
    parser.add_argument("--limit", type=int, default=None, help="questions per category (default: all)")
    parser.add_argument(
        "--methods",
        default="baseline,prompt_lookup,medusa,medusa_dynamic,hybrid",
        help=f"comma-separated, from {', '.join(METHODS)}",
    )
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument(
        "--heads",
        default=None,
        help=f"heads directory (default: the shipped heads, which fit SmolLM2 only); {NO_HEADS_HELP} (methods that "
        "guess without heads: lookup, draft, llama_cpp_lookup ...; planned: prompt lookup on the plan's engine)",
    )
    parser.add_argument(
        "--base", default=None, help="base model: directory, .gguf or Hub id (default: the heads' base)"
    )
    parser.add_argument(
        "--tree", default=None, help="shipped tree name (medusa/trees/) or JSON path (default: the heads')"
    )
    parser.add_argument(
        "--dtype",
        default=None,
        choices=[p for p in PRECISIONS if p != "auto"],  # a benchmark names the precision it measures
        help="the target's precision (medusa.precision; int8 and int4: weight-only, CPU; w8a8: int8 weights and "
        "activations, x86 CPU; default: bfloat16 on a GPU, "
        "float32 on a CPU); llama.cpp runs the matching GGUF type",
    )
    parser.add_argument(
        "--plan",
        default="auto",
        choices=["auto", "off"],
        help="calibrate (or load the cached) decoding plan for this machine: the 'planned' method",
    )
    parser.add_argument(
        "--engine",
        default=None,
        choices=list(ENGINES),
        help="how this library's methods run the target (medusa.runtime; default: the plan's fastest plain engine, "
        "else compiled)",
    )
    parser.add_argument("--device", default=None, help="e.g. cuda (default: CPU)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sampling variants")
    parser.add_argument(
        "--draft",
        default=None,
        help="draft model for 'assisted' and 'draft' (same tokenizer), "
        "early-exit:N for the target's own first N layers, or int8 for the target with int8 weights (torchao)",
    )
    parser.add_argument(
        "--eagle3",
        default=None,
        help="EAGLE-3 draft for the eagle3 methods: a directory or Hub id (speculators or EAGLE-3 layout) or "
        f"embedded:<name> (default: {SHIPPED_DRAFT} on the embedded SmolLM2)",
    )
    parser.add_argument(
        "--eagle3-nodes",
        type=int,
        default=None,
        help="the eagle3 method drafts a dynamic tree of this many nodes, --gamma deep (default: a chain of --gamma)",
    )
    parser.add_argument(
        "--gamma", type=int, default=5, help="tokens the draft model (or EAGLE-3 draft) proposes per step"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-profile",
        dest="profile",
        action="store_false",
        help="skip per-phase timing (on a GPU it adds synchronisations; the analysis then has no c)",
    )
    parser.add_argument("--overwrite", action="store_true", help="discard earlier results in --out instead of resuming")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=1,
        help="questions decoded together (first turns, left-padded; methods on the batch's engine, baseline as "
        "transformers' batched generate; tokens/s per method counts the whole batch's time; each method warmed up "
        "untimed on a batch of every size the questions come in, the batch package loaded first)",
    )
    args = parser.parse_args(argv)
    if args.batch_size < 1:
        parser.error("--batch-size must be >= 1")
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(m for m in args.methods if m not in METHODS and sized_method(m) is None)
    if unknown:
        parser.error(
            f"unknown methods {unknown}: choose from {', '.join(METHODS)}, or one of {', '.join(SIZED)} with "
            "@N for the plan's tree of N nodes (N >= 2), e.g. medusa_dynamic@8"
        )
    if args.limit is not None and args.limit < 1:
        parser.error("--limit must be >= 1")
    if args.dtype is None:  # where users of a GPU run: bf16 (the serving engines' default there)
        args.dtype = "bfloat16" if str(args.device or "cpu").startswith("cuda") else "float32"
    return args


# ----------------------------------------------------------------------------------------------------- questions
def longest_context(questions: list[dict], tokenizer, max_new_tokens: int) -> int:
    """The most cache rows a question's last turn can need: every turn's prompt and every answer at full length."""
    longest = 0
    for q in questions:
        messages = []
        for text in q["turns"]:
            messages += [{"role": "user", "content": text}, {"role": "assistant", "content": ""}]
        longest = max(longest, len(encode_conversation(tokenizer, messages[:-1])) + len(q["turns"]) * max_new_tokens)
    return longest + PROPOSAL_ROWS


# ------------------------------------------------------------------------------------------------------- timing
class ForwardRecorder:
    """Counts and times a model's forward calls; for each: cache length before it and tokens fed (query length)."""

    def __init__(self, models, sync: bool):
        """models: one module, or several that run the same target (the compiled engine's pre-packed copy)."""
        self.sync, self.calls, self._start = sync, [], 0.0
        for model in models if isinstance(models, (list, tuple)) else [models]:
            model.register_forward_pre_hook(self._before, with_kwargs=True)
            model.register_forward_hook(self._after)

    def _now(self) -> float:
        if self.sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    # dynamo sees hooks on a module it compiled (the inductor engine runs the base itself): they stay uncompiled
    @torch.compiler.disable
    def _before(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs["inputs_embeds"]
        cache = kwargs.get("cache", kwargs.get("past_key_values"))  # transformers' name for it, new or old
        past = cache.get_seq_length() if cache is not None else 0
        self.calls.append([int(past), int(ids.shape[1]), 0.0])
        self._start = self._now()

    @torch.compiler.disable
    def _after(self, module, args, output):
        self.calls[-1][2] = self._now() - self._start

    def take(self) -> list[list]:
        calls, self.calls = self.calls, []
        return calls


def steps_from_calls(calls: list[list]) -> tuple[list[int], list[int]]:
    """A chain method's target calls [past, q, s] -> per verify step (tokens committed incl. bonus, guesses).

    Step i's committed tokens = cache growth until call i+1; the last call has no successor and is left out.
    """
    committed = [calls[i + 1][0] - calls[i][0] for i in range(1, len(calls) - 1)]
    guesses = [calls[i][1] - 1 for i in range(1, len(calls) - 1)]
    return committed, guesses


# ------------------------------------------------------------------------------------------------------ methods
NEEDS_DRAFT = "needs --eagle3 DRAFT (an EAGLE-3 draft trained for this target: train/train.py, eagle3)"


def plan_summary(plan) -> dict:
    """What settings.json records of a plan (medusa.plan.Plan)."""
    keys = ("engine", "proposer", "tree", "expected_speedup", "plain_ms", "reason", "calibration_s")
    return {k: getattr(plan, k) for k in keys}


def build_methods(names: list[str], args, model, stop_ids: list[int]) -> tuple[dict, dict, object, object]:
    """-> ({name: run(input_ids, max_new_tokens, seed) -> dict}, {name: why it is skipped}, the draft LM or None,
    the EAGLE-3 draft's plan or None)."""
    base, tokenizer = model.base, model.tokenizer
    sampling = args.temperature > 0
    pad = base.generation_config.pad_token_id
    pad = pad if pad is not None else (stop_ids[0] if stop_ids else 0)
    runs, skipped = {}, {}
    draft_model = draft_hf = None
    if args.draft and {"assisted", "draft"} & set(names):
        draft_model = MedusaModel.from_draft_model(
            base, args.draft, dtype=args.dtype, tokenizer=tokenizer, num_speculative_tokens=args.gamma
        )
        draft_hf = draft_model.draft
    eagle3_model = eagle3_planned = None
    if args.eagle3 and "eagle3" in names:
        eagle3_model = MedusaModel.from_draft_model(
            base,
            args.eagle3,
            tokenizer=tokenizer,
            num_speculative_tokens=args.gamma,
            num_nodes=args.eagle3_nodes,
            plan="off",
        )
    if args.eagle3 and "eagle3_planned" in names:
        eagle3_planned = MedusaModel.from_draft_model(
            base, args.eagle3, tokenizer=tokenizer, num_speculative_tokens=args.gamma, plan=args.plan
        )

    def hf(assistant_model=None, **options):
        """transformers' generate; `options` go into its GenerationConfig (e.g. prompt_lookup_num_tokens)."""

        def run(input_ids, max_new_tokens, seed, attention_mask=None):
            # A fresh config, so nothing from the model's generation_config.json (e.g. top_k=50) sneaks in.
            config = GenerationConfig(
                max_new_tokens=max_new_tokens,
                do_sample=sampling,
                temperature=args.temperature if sampling else None,
                top_k=0 if sampling else None,
                top_p=1.0 if sampling else None,
                num_beams=1,
                eos_token_id=stop_ids or None,
                pad_token_id=pad,
                **options,
            )
            torch.manual_seed(seed)
            out = base.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids) if attention_mask is None else attention_mask,
                generation_config=config,
                assistant_model=assistant_model,
            )
            return {"output_ids": out[0, input_ids.shape[1] :].tolist(), "rows": out[:, input_ids.shape[1] :].tolist()}

        return run

    def ours(target, engine=args.engine, **kwargs):
        def run(input_ids, max_new_tokens, seed, attention_mask=None):
            generator = torch.Generator(base.device).manual_seed(seed) if sampling else None
            out = target.generate(
                input_ids,
                attention_mask=attention_mask,
                max_new_tokens=max_new_tokens,
                do_sample=sampling,
                temperature=args.temperature or 1.0,
                eos_token_id=stop_ids or None,
                generator=generator,
                profile=args.profile,
                engine=engine if attention_mask is None else None,  # a batch: as the plan lays it out
                return_dict_in_generate=True,
                **kwargs,
            )
            stats = out.stats
            record = {
                "output_ids": out.sequences[0, input_ids.shape[1] :].tolist(),
                "rows": out.sequences[:, input_ids.shape[1] :].tolist(),
                "accepted_lengths": list(stats.accepted_lengths),
                "proposed_lengths": list(stats.proposed_lengths),
                "propose_s": stats.timings.get("propose") if args.profile else None,
                "forwards": stats.steps,  # counted by the loop: forward hooks do not run inside a compiled graph
            }
            if args.profile:
                record["verify_s"] = stats.timings.get("verify", 0.0)
            return record

        return run

    def peer(method):
        def run(input_ids, max_new_tokens, seed):
            prompt = tokenizer.decode(input_ids[0].tolist(), skip_special_tokens=False)
            done = llama_cpp.generate(peer_file, prompt, max_new_tokens, torch.get_num_threads(), method)
            output_ids = tokenizer(done.text, add_special_tokens=False)["input_ids"]
            output_ids = (output_ids + stop_ids[:1] if done.stopped_at_eos else output_ids)[:max_new_tokens]
            accepted = done.n_accepted or 0  # lookup: tokens its target forwards took beyond one each
            return {
                "output_ids": output_ids,
                "new_tokens": done.n_new_tokens,  # llama-lookup may overshoot max_new_tokens by a draft
                "time_s": done.seconds,  # llama.cpp's own prefill + decode: its model load is not a user's wait
                "forwards": 1 + max(done.n_new_tokens - accepted - 1, 0),
                "accepted_lengths": [],
                "proposed_lengths": [],
                "propose_s": None,
                "peer_gguf": done.gguf.name,
            }

        return run

    peer_file, peer_skip = None, None
    if set(PEERS) & set(names):
        source = base_gguf(args.base or model.config.base_model_name_or_path)
        precision = args.dtype if args.dtype in llama_cpp.PRECISIONS else None
        peer_skip = llama_cpp.missing_reason()
        if peer_skip is None and source is None:
            peer_skip = "llama.cpp runs GGUF files: pass --base FILE.gguf (or use the embedded default)"
        elif peer_skip is None and precision is None:
            peer_skip = f"no llama.cpp file type matches --dtype {args.dtype}"
        elif peer_skip is None:
            peer_file = llama_cpp.gguf_for(source, precision)

    tree = args.tree
    for name in names:
        if name in PEERS:
            if peer_skip:
                skipped[name] = peer_skip
            else:
                runs[name] = peer(PEERS[name])
        elif name == "baseline":
            runs[name] = hf()
        elif name == "baseline_compiled":
            runs[name] = ours(model, engine=model.best_plain_engine, proposer="plain")
        elif name == "planned":
            if model.plan is None:
                skipped[name] = "needs --plan auto"
            else:
                runs[name] = ours(model, engine=None)
        elif name == "prompt_lookup":
            runs[name] = hf(prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS)
        elif name == "assisted":
            if draft_hf is None:
                skipped[name] = "needs --draft PATH (a smaller model with the target's tokenizer)"
            else:
                runs[name] = hf(
                    assistant_model=draft_hf, num_assistant_tokens=args.gamma, num_assistant_tokens_schedule="constant"
                )
        elif name == "draft":
            if draft_model is None:
                skipped[name] = "needs --draft PATH (a smaller model with the target's tokenizer)"
            else:
                runs[name] = ours(draft_model)
        elif name == "eagle3":
            if eagle3_model is None:
                skipped[name] = NEEDS_DRAFT
            else:
                runs[name] = ours(eagle3_model)
        elif name == "eagle3_planned":
            if eagle3_planned is None:
                skipped[name] = NEEDS_DRAFT
            elif eagle3_planned.plan is None:
                skipped[name] = "needs --plan auto"
            else:
                runs[name] = ours(eagle3_planned, engine=None)
        elif sized_method(name) is not None:
            proposer, nodes = sized_method(name)
            if model.accuracy is None:
                skipped[name] = "the heads have no accuracy table to grow the plan's trees from (medusa accuracy)"
            else:
                runs[name] = ours(model, proposer=proposer, tree=[list(p) for p in grow_tree(model.accuracy, nodes)])
        elif name == "medusa_typical":
            runs[name] = ours(model, proposer="medusa", tree=tree, acceptance="typical")
        else:
            proposer = {**SIZED, "lookup": "prompt_lookup", "plain": "plain"}[name]
            runs[name] = ours(model, proposer=proposer, tree=tree)
    return runs, skipped, draft_hf, eagle3_planned.plan if eagle3_planned is not None else None


def run_turn(run, recorders: dict, input_ids: torch.Tensor, max_new_tokens: int, seed: int, sync: bool) -> dict:
    """One timed generation -> its raw record (tokens, seconds, target forwards, per-step acceptance, phase times)."""
    for recorder in recorders.values():
        recorder.take()
    if sync:
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = run(input_ids, max_new_tokens, seed)
    if sync:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    result.pop("rows", None)  # a batch's rows: run_batch's
    calls = recorders["target"].take()
    record = {
        "new_tokens": len(result["output_ids"]),
        "time_s": seconds,
        "forwards": len(calls),
        "verify_s": sum(c[2] for c in calls[1:]),
        **result,
    }
    if "accepted_lengths" not in record:  # transformers' methods: read the steps off the cache lengths
        record["accepted_lengths"], record["proposed_lengths"] = steps_from_calls(calls)
        record["propose_s"] = sum(c[2] for c in recorders["draft"].take()) if "draft" in recorders else None
    return record


def run_batch(run, recorders: dict, prompts: list[list[int]], pad_id: int, max_new_tokens: int, seed: int, stop_ids):
    """One timed generation of several prompts together (left-padded) -> one raw record per prompt: its tokens (up to
    its first stop), and its share of the batch's seconds and target forwards by its share of the batch's tokens, so
    that totals over records are the batch's own. The batch's accepted / proposed lengths go with its first row."""
    ids, mask = left_padded(prompts, pad_id)
    for recorder in recorders.values():
        recorder.take()
    start = time.perf_counter()
    result = run(ids, max_new_tokens, seed, attention_mask=mask)
    seconds = time.perf_counter() - start
    calls = recorders["target"].take()
    rows = [row[: next((i + 1 for i, t in enumerate(row) if t in stop_ids), len(row))] for row in result["rows"]]
    tokens = max(sum(map(len, rows)), 1)
    forwards = result.get("forwards", len(calls))
    records = []
    for index, row in enumerate(rows):
        share = len(row) / tokens
        first = index == 0
        records.append(
            {
                "new_tokens": len(row),
                "time_s": seconds * share,
                "forwards": forwards * share,
                "verify_s": 0.0,
                "output_ids": row,
                "accepted_lengths": result.get("accepted_lengths", []) if first else [],
                "proposed_lengths": result.get("proposed_lengths", []) if first else [],
                "propose_s": None,
                "prompt_tokens": len(prompts[index]),
                "batch": len(prompts),
            }
        )
    return records


# ------------------------------------------------------------------------------------------------------ summary
def predicted_speedup(alpha: float, gamma: float, c: float) -> float:
    """Leviathan et al.: expected tokens per step (1 - alpha^(gamma+1)) / (1 - alpha), over the cost gamma c + 1."""
    tokens = gamma + 1 if alpha >= 1.0 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
    return tokens / (gamma * c + 1)


def aggregate(turns: list[dict], method: str, has_profile: bool) -> dict:
    """Pool raw turn records of one method (one category, or all) into totals and the analysis' inputs."""
    new_tokens = sum(t["new_tokens"] for t in turns)
    seconds = sum(t["time_s"] for t in turns)
    forwards = sum(t["forwards"] for t in turns)
    steps = sum(max(t["forwards"] - 1, 0) for t in turns)
    accepted = [n for t in turns for n in t["accepted_lengths"]]
    proposed = [n for t in turns for n in t["proposed_lengths"]]
    out = {
        "new_tokens": new_tokens,
        "time_s": seconds,
        "tokens_per_s": new_tokens / seconds if seconds else 0.0,
        # steps that proposed nothing: the plan's online guard decoding plainly (medusa.guard)
        "plain_step_share": sum(d == 0 for d in proposed) / len(proposed) if proposed else None,
        "tau": new_tokens / forwards if forwards else 0.0,
        "forwards": forwards,
        "verify_ms_per_step": 1000 * sum(t["verify_s"] for t in turns) / steps if steps else None,
    }
    if method in PLAIN:
        out.update(alpha=None, gamma=0.0, c=None)
        return out
    gamma = sum(proposed) / len(proposed) if proposed else 0.0
    reached = sum(min(n, d) for n, d in zip(accepted, proposed))
    alpha = DecodeStats(accepted_lengths=accepted, proposed_lengths=proposed).acceptance_rate if reached else None
    propose_s = [t.get("propose_s") for t in turns]
    verify_s = sum(t["verify_s"] for t in turns)
    if method in MODEL_FREE:
        c = 0.0
    elif has_profile and all(p is not None for p in propose_s) and gamma > 0 and verify_s > 0:
        c = sum(propose_s) / (gamma * verify_s)  # per guess, so gamma * c = proposal time / verify time per step
    else:
        c = None
    out.update(alpha=alpha, gamma=gamma, c=c)
    return out


def summarize(records: dict, questions: list[dict], methods: list[str], settings: dict) -> dict:
    """records: (question_id, method) -> raw record. Speedups against 'baseline' when it was run."""
    groups = sorted({q["group"] for q in questions})
    outputs = {
        reference: {
            (r["question_id"], i): turn["output_ids"]
            for (qid, m), r in records.items()
            if m == reference
            for i, turn in enumerate(r["turns"])
        }
        for reference in ("baseline", "baseline_compiled")
    }
    baseline_ids = outputs["baseline"]
    sampling = settings["temperature"] > 0

    def identical_share(mine: list[dict], reference: str) -> float | None:
        pairs = [
            (outputs[reference].get((r["question_id"], i)), t["output_ids"])
            for r in mine
            for i, t in enumerate(r["turns"])
        ]
        pairs = [(a, b) for a, b in pairs if a is not None]
        return sum(a == b for a, b in pairs) / len(pairs) if pairs and not sampling else None

    def block(selected: list[dict]) -> dict:
        ids = {q["question_id"] for q in selected}
        result = {}
        for method in methods:
            mine = [r for (qid, m), r in records.items() if m == method and qid in ids]
            if not mine:
                continue
            turns = [t for r in mine for t in r["turns"]]
            stats = aggregate(turns, method, settings["profile"])
            if baseline_ids and not sampling:
                stats["identical"] = all(
                    baseline_ids.get((r["question_id"], i)) == t["output_ids"]
                    for r in mine
                    for i, t in enumerate(r["turns"])
                )
            else:
                stats["identical"] = None
            stats["identical_share"] = identical_share(mine, "baseline")
            stats["identical_share_vs_compiled"] = identical_share(mine, "baseline_compiled")
            result[method] = stats
        base, compiled, peer = result.get("baseline"), result.get("baseline_compiled"), result.get("llama_cpp")
        for method, stats in result.items():
            for key, yardstick in (
                ("speedup", base),
                ("speedup_vs_compiled", compiled),
                ("speedup_vs_llama_cpp", peer),
            ):
                rate = yardstick["tokens_per_s"] if yardstick else 0.0
                stats[key] = stats["tokens_per_s"] / rate if rate else None
            if base and base["verify_ms_per_step"] and stats["verify_ms_per_step"]:
                stats["verify_cost"] = stats["verify_ms_per_step"] / base["verify_ms_per_step"]
            else:
                stats["verify_cost"] = None
            if method in PLAIN:
                stats["predicted_speedup"] = stats["predicted_speedup_with_verify_cost"] = 1.0
            elif stats["alpha"] is not None and stats["c"] is not None:
                stats["predicted_speedup"] = predicted_speedup(stats["alpha"], stats["gamma"], stats["c"])
                stats["predicted_speedup_with_verify_cost"] = (
                    stats["predicted_speedup"] / stats["verify_cost"] if stats["verify_cost"] else None
                )
            else:
                stats["predicted_speedup"] = stats["predicted_speedup_with_verify_cost"] = None
        return result

    return {
        "overall": block(questions),
        "per_category": {g: block([q for q in questions if q["group"] == g]) for g in groups},
        "settings": settings,
    }


def _fmt(x, digits=2) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    return f"{x:.{digits}f}"


def write_markdown(summary: dict, path: Path) -> None:
    s = summary["settings"]
    methods = list(summary["overall"])
    lines = [
        f"# Speed benchmark: {Path(s['questions']).name}",
        "",
        f"base `{s['base']}`, heads `{s['heads']}`, tree `{s['tree']}`, {s['dtype']} on {s['device']}, "
        f"{s['threads']} threads, max {s['max_new_tokens']} new tokens, temperature {s['temperature']}, "
        f"{s['num_questions']} questions. Speedup = tokens/s over baseline tokens/s (total tokens / total time).",
        "",
    ]
    hardware, peer = s.get("hardware") or {}, s.get("llama_cpp")
    if hardware.get("gpu"):
        lines += [f"GPU: {hardware['gpu']}.", ""]
    elif hardware.get("isa"):
        lines += [f"CPU: {hardware.get('cpu', '?')}, {' '.join(hardware['isa'])} ({hardware.get('capability')}).", ""]
    if peer:
        crashed = peer.get("without_repacking")
        lines += [
            f"llama.cpp: `{peer['bin']}`, {peer['build'] or 'no BUILD_INFO beside it'}"
            + (f"; run with --no-repack (it crashed with repacked weights): {', '.join(crashed)}" if crashed else "")
            + ".",
            "",
        ]
    if s.get("skipped"):
        lines += ["Skipped: " + "; ".join(f"`{m}`: {why}" for m, why in s["skipped"].items()), ""]
    lines += [
        "## Overall",
        "",
        "| method | speedup | vs compiled | vs llama.cpp | tokens/s | tau | identical | same as baseline / "
        "compiled | alpha | gamma | c | predicted | verify cost | predicted / verify cost |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m, st in summary["overall"].items():
        lines.append(
            f"| {m} | {_fmt(st['speedup'])} | {_fmt(st.get('speedup_vs_compiled'))} | "
            f"{_fmt(st.get('speedup_vs_llama_cpp'))} | "
            f"{_fmt(st['tokens_per_s'])} | {_fmt(st['tau'])} | {_fmt(st['identical'])} | "
            f"{_fmt(st.get('identical_share'))} / {_fmt(st.get('identical_share_vs_compiled'))} | "
            f"{_fmt(st['alpha'])} | {_fmt(st['gamma'])} | {_fmt(st['c'], 3)} | "
            f"{_fmt(st['predicted_speedup'])} | {_fmt(st['verify_cost'])} | "
            f"{_fmt(st['predicted_speedup_with_verify_cost'])} |"
        )
    for title, key in (
        ("Speedup per category", "speedup"),
        ("Speedup over baseline_compiled per category", "speedup_vs_compiled"),
        ("tau (tokens per target forward) per category", "tau"),
    ):
        lines += ["", f"## {title}", "", "| category | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
        for group, block in summary["per_category"].items():
            lines.append(f"| {group} | " + " | ".join(_fmt(block.get(m, {}).get(key)) for m in methods) + " |")
    lines += [
        "",
        "## Analysis per category (Leviathan et al.)",
        "",
        "alpha: accepted guesses / guesses reached; gamma: mean guesses per step; c: proposal time per guess / "
        "verify forward time; predicted = (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)); verify cost: a "
        "verify forward / a baseline forward (the formula assumes 1).",
        "",
        "| category | method | alpha | gamma | c | tau | predicted | predicted / verify cost | measured |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for group, block in summary["per_category"].items():
        for m, st in block.items():
            if m in PLAIN:
                continue
            lines.append(
                f"| {group} | {m} | {_fmt(st['alpha'])} | {_fmt(st['gamma'])} | {_fmt(st['c'], 3)} | "
                f"{_fmt(st['tau'])} | {_fmt(st['predicted_speedup'])} | "
                f"{_fmt(st['predicted_speedup_with_verify_cost'])} | {_fmt(st['speedup'])} |"
            )
    atomic_write_text(path, "\n".join(lines) + "\n")


def plot_speedups(summary: dict, path: Path) -> None:
    """The speedup chart at `path`; without matplotlib (an extra: medusa[bench]) a note instead, the tables kept."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no {path.name} (pip install 'medusa[bench]'); the tables are written")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(summary["per_category"]) + ["overall"]
    blocks = [summary["per_category"][g] for g in groups[:-1]] + [summary["overall"]]
    methods = [m for m in summary["overall"] if m != "baseline"]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(groups) * max(len(methods), 1) / 2), 4))
    width = 0.8 / max(len(methods), 1)
    for i, m in enumerate(methods):
        values = [(b.get(m) or {}).get("speedup") or 0.0 for b in blocks]
        ax.bar([g + (i - (len(methods) - 1) / 2) * width for g in range(len(groups))], values, width, label=m)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)), groups, rotation=20)
    ax.set_ylabel("speedup over baseline")
    s = summary["settings"]
    ax.set_title(f"{Path(str(s['base'])).name}, {s['dtype']}, T={s['temperature']}", fontsize=9)
    if methods:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------------- main
def heads_label(heads: str | None) -> str:
    """What --heads resolved to, for the record: a results table of untrained heads must say so."""
    if heads == NO_HEADS:
        return "untrained (--heads none): planned guesses with prompt lookup; methods that read heads guess nothing"
    if heads:
        return str(heads)
    if (DEFAULT_HEADS_DIR / CONFIG_NAME).is_file():
        return str(DEFAULT_HEADS_DIR)
    return "untrained (no shipped heads found)"


def load_raw(path: Path) -> dict:
    records = {}
    if path.is_file():
        for line_no, line in enumerate(path.read_text().splitlines(), 1):
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                print(
                    f"warning: {path}:{line_no} is not valid JSON (an interrupted write?); that result is rerun",
                    file=sys.stderr,
                )
                continue
            records[(r["question_id"], r["method"])] = r
    return records


def batch_pad(tokenizer, stop_ids) -> int:
    """The id a batch's prompts are left-padded with (masked: any id does)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stop_ids[0] if stop_ids else 0)


def question_batches(questions: list[dict], size: int) -> list[list[dict]]:
    """--batch-size N: the questions, N at a time (the last batch holds what is left)."""
    return [questions[i : i + size] for i in range(0, len(questions), size)]


def first_turn_ids(batch: list[dict], prompt_ids) -> list[list[int]]:
    """Each question's first turn as prompt token ids (a batch decodes first turns only)."""
    return [prompt_ids([{"role": "user", "content": q["turns"][0]}])[0].tolist() for q in batch]


def run_batches(args, todo, methods, runs, recorders, records, raw_path, tokenizer, stop_ids, prompt_ids) -> None:
    """--batch-size N: the questions' first turns, N at a time, every method on each batch (the first method of a
    batch rotates), one raw record per question and method."""
    pad = batch_pad(tokenizer, stop_ids)
    with raw_path.open("a") as raw:
        batches = question_batches(todo, args.batch_size)
        for b_index, batch in enumerate(tqdm(batches, desc="batches", unit="batch")):
            prompts = first_turn_ids(batch, prompt_ids)
            shift = b_index % len(methods)
            for m in methods[shift:] + methods[:shift]:
                seed = args.seed + 1000 * batch[0]["question_id"]
                rows = run_batch(runs[m], recorders, prompts, pad, args.max_new_tokens, seed, set(stop_ids))
                for q, row in zip(batch, rows):
                    r = {
                        "question_id": q["question_id"],
                        "category": q["category"],
                        "group": q["group"],
                        "method": m,
                        "turns": [row],
                    }
                    raw.write(json.dumps(r) + "\n")
                    raw.flush()
                    records[(q["question_id"], m)] = r


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    questions = per_group(load_questions(args.questions), args.limit)
    if not questions:
        raise ValueError(f"{args.questions} holds no questions")

    model = load_model(args.heads, base=args.base, dtype=args.dtype, device=args.device, plan=args.plan)
    args.engine = args.engine or model.best_plain_engine
    if args.eagle3 is None and str(args.base or model.config.base_model_name_or_path) == DEFAULT_BASE:
        args.eagle3 = SHIPPED_DRAFT  # the embedded SmolLM2's draft, for the eagle3 methods
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise ValueError("the benchmark needs the base model's tokenizer (chat template): load a base that has one")
    eos = model.base.generation_config.eos_token_id
    eos = tokenizer.eos_token_id if eos is None else eos
    stop_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    sync = args.profile and model.device.type == "cuda"

    settings = {
        "questions": str(args.questions),
        "limit": args.limit,
        "methods": args.methods,
        "base": str(args.base or model.config.base_model_name_or_path),
        "heads": heads_label(args.heads),
        # the fixed methods' tree: --tree, else the plan's (as generate takes it), else the heads' own
        "tree": args.tree or ("the plan's" if model.plan is not None and model.plan.tree else "heads' default"),
        "tree_paths": model.tree_paths(args.tree),
        "dtype": args.dtype,
        "device": str(model.device),
        "engine": args.engine,
        "baseline_compiled": "this library's batched plain decoding (proposer 'plain'), "
        + (
            "laid out as the plan lays out plain batches (medusa.plan.batch_choice: together, or one row at a time)"
            if model.plan is not None
            else f"together on the {batch_engine(model.base)} engine"
        )
        if args.batch_size > 1
        else "this library's plain decoding (proposer 'plain') on the "
        f"{model.best_plain_engine} engine: "
        + {
            "eager": "transformers' forward and DynamicCache",
            "compiled": "StaticCache, "
            + (
                "torch.compile with CUDA graphs"
                if model.device.type == "cuda"
                else "linear weights pre-packed for oneDNN"
            ),
            "inductor": "StaticCache, torch.compile (inductor: frozen weights, C++ GEMM templates on CPU)",
            "inductor_onednn": "StaticCache, torch.compile (inductor: frozen weights, C++ GEMM templates on CPU; "
            "trees on oneDNN)",
        }[model.best_plain_engine],
        "hardware": describe(model.device),
        "llama_cpp": llama_cpp.build_info() if set(PEERS) & set(args.methods) else None,
        "plan": None if model.plan is None else plan_summary(model.plan),
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "draft": args.draft,
        "eagle3": args.eagle3,
        "eagle3_nodes": args.eagle3_nodes,
        "gamma": args.gamma,
        "threads": torch.get_num_threads(),
        "seed": args.seed,
        "profile": args.profile,
        "num_questions": len(questions),
        "batch_size": args.batch_size,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": platform.machine(),
        "processor": platform.processor(),
    }
    settings_path, raw_path = out / "settings.json", out / "raw.jsonl"
    earlier_without_repacking = []  # a resumed run's records that llama.cpp ran with --no-repack in an earlier process
    if args.overwrite:
        raw_path.unlink(missing_ok=True)
    elif settings_path.is_file() and raw_path.is_file():
        old = json.loads(settings_path.read_text())
        earlier_without_repacking = (old.get("llama_cpp") or {}).get("without_repacking", [])
        changed = {k: (old.get(k), settings[k]) for k in RESUME_KEYS if old.get(k) != settings[k]}
        if changed:
            raise ValueError(
                f"{out} holds results made with other settings {changed}: resume with the same settings, "
                "or pass --overwrite, or choose another --out"
            )
    atomic_write_text(settings_path, json.dumps(settings, indent=2))
    records = load_raw(raw_path)

    runs, skipped, draft_lm, eagle3_plan = build_methods(args.methods, args, model, stop_ids)
    if eagle3_plan is not None:
        settings["eagle3_plan"] = plan_summary(eagle3_plan)
        atomic_write_text(settings_path, json.dumps(settings, indent=2))
    if args.batch_size > 1:  # these take one sequence: transformers' assisted / prompt lookup, llama.cpp's CLI
        for name in [m for m in runs if m in PEERS or m in ("prompt_lookup", "assisted")]:
            del runs[name]
            skipped[name] = "takes one sequence (drop --batch-size to run it)"
    for name, why in skipped.items():
        print(f"skipping method {name!r}: {why}", file=sys.stderr)
    settings["skipped"] = skipped
    methods = [m for m in args.methods if m in runs]
    targets = [model.base]
    # every engine a method runs on is built and compiled, for every cache size the questions need, before the hooks
    # below exist (compiled graphs do not run hooks added later, and would trace hooks added before; the loop counts
    # those forwards itself) and before any timing: a size compiled inside a timed turn would cost that turn minutes
    todo = [q for q in questions if any((q["question_id"], m) not in records for m in methods)]
    planned = {model.plan.engine} if "planned" in methods and model.plan is not None else set()
    if "eagle3_planned" in methods:  # the draft's plan runs the same target on the engine it chose
        planned.add(eagle3_plan.engine)
    engines = {args.engine, model.best_plain_engine} | planned
    longest = longest_context(todo, tokenizer, args.max_new_tokens)
    for name in sorted(engines):
        model.engine(name).warm_up(max_length=longest, batches=args.batch_size > 1)
    compile_s = {name: model.engine(name).compile_seconds for name in engines}
    if draft_lm is not None and "draft" in methods:  # our draft proposer runs the draft on the target's engine
        draft_engine = engine_for(draft_lm, args.engine)
        draft_engine.warm_up(max_length=longest)
        compile_s[f"draft on {args.engine}"] = draft_engine.compile_seconds
    settings["compile_s"] = {name: round(s, 1) for name, s in compile_s.items() if s}
    if "compiled" in engines:  # built above; hooks on its pre-packed copy count its forwards like the base's
        runner = model.engine("compiled").runner  # the compiled engine's forward (a pre-packed copy on CPU)
        targets += [runner] if runner is not model.base else []
    recorders = {"target": ForwardRecorder(targets, sync)}
    if draft_lm is not None:  # times transformers' assistant forwards (our draft proposer is timed by the profiler)
        recorders["draft"] = ForwardRecorder(draft_lm, sync)

    def prompt_ids(messages):
        return torch.tensor([encode_conversation(tokenizer, messages)], device=model.device)

    if todo:  # warm-up: every method once, untimed here but recorded (the compiled engine packs or compiles then)
        warm = prompt_ids([{"role": "user", "content": todo[0]["turns"][0]}])
        warm_tokens = min(WARMUP_TOKENS, args.max_new_tokens)
        # batches: every batch size the questions come in, as a batch (the plan lays out each size once)
        sizes = sorted({len(batch) for batch in question_batches(todo, args.batch_size)})
        firsts = [first_turn_ids(todo[:n], prompt_ids) for n in sizes]
        pad = batch_pad(tokenizer, stop_ids)
        warmup = {}
        for name in methods:
            start = time.perf_counter()
            runs[name](warm, warm_tokens, args.seed)
            for prompts in firsts if args.batch_size > 1 else []:
                run_batch(runs[name], recorders, prompts, pad, warm_tokens, args.seed, set(stop_ids))
            warmup[name] = round(time.perf_counter() - start, 3)
        settings["warmup_s"] = warmup
        print("warm-up seconds (engine set-up included): " + ", ".join(f"{m} {s:.1f}" for m, s in warmup.items()))

    if args.batch_size > 1:
        run_batches(args, todo, methods, runs, recorders, records, raw_path, tokenizer, stop_ids, prompt_ids)
    with raw_path.open("a") as raw:
        for q_index, q in enumerate(tqdm(todo if args.batch_size == 1 else [], desc="questions", unit="q")):
            missing = [m for m in methods if (q["question_id"], m) not in records]
            shift = q_index % len(missing)
            order = missing[shift:] + missing[:shift]  # rotate who goes first: no method always runs on a warm cache
            conversations = {m: [] for m in order}
            turns = {m: [] for m in order}
            for turn_index, text in enumerate(q["turns"]):
                for m in order:
                    conversations[m].append({"role": "user", "content": text})
                    ids = prompt_ids(conversations[m])
                    record = run_turn(
                        runs[m],
                        recorders,
                        ids,
                        args.max_new_tokens,
                        args.seed + 1000 * q["question_id"] + turn_index,
                        sync,
                    )
                    record["prompt_tokens"] = ids.shape[1]
                    turns[m].append(record)
                    conversations[m].append(answer_message(tokenizer, record["output_ids"]))
            for m in order:
                r = {
                    "question_id": q["question_id"],
                    "category": q["category"],
                    "group": q["group"],
                    "method": m,
                    "turns": turns[m],
                }
                raw.write(json.dumps(r) + "\n")
                raw.flush()
                records[(q["question_id"], m)] = r

    if settings["llama_cpp"] is not None:  # the files that had to run without repacked weights are known now
        settings["llama_cpp"] = llama_cpp.build_info()
        without = set(settings["llama_cpp"]["without_repacking"]) | set(earlier_without_repacking)
        settings["llama_cpp"]["without_repacking"] = sorted(without)
        atomic_write_text(settings_path, json.dumps(settings, indent=2))
    summary = summarize(records, questions, methods, settings)
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2))
    write_markdown(summary, out / "summary.md")
    plot_speedups(summary, out / "speedup.png")
    print((out / "summary.md").read_text())
    return summary
