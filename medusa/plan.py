"""A decoding plan calibrated on the machine at hand: engine, tree size and proposer, chosen from measured latency.

The right tree for a 2-core CPU is not the right one for a GPU, and the shipped trees that gave 2x on one CPU gave
0.43x on another. So the plan times the target's forward on each engine for a ladder of query lengths (plus what the
proposers cost), combines that with the heads' accuracy table (`acc_given_prefix`, shipped as ACCURACY_NAME in the
heads directory), and keeps the option with the most expected tokens per second:

    expected speedup = expected tau / (step time(N) / plain step time)

where a static tree's tau is 1 + the sum of its paths' values (medusa.tree_builder), discounted; where the heads ship
taus decoded with each option on held-out prompts (`medusa accuracy --taus`), those are taken instead, and hybrid's
step is costed at the nodes it verified there. If nothing beats plain decoding by MIN_GAIN, the plan is plain
decoding on the fastest engine. Plans are cached as JSON under the medusa cache (`$MEDUSA_CACHE/plans/`), keyed by
what changes them (hardware, threads, torch, base, heads, dtype, decoded taus); `calibrate` redoes one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from medusa.acceptance import get_rule
from medusa.batch import prefill_groups, time_batch_prefill, time_batch_step, time_batch_verify
from medusa.decode import decode, prefill
from medusa.fileio import atomic_write_text
from medusa.guard import GuardedProposer
from medusa.hardware import describe
from medusa.loading import cache_root
from medusa.prompt_lookup import NUM_TOKENS as LOOKUP_CHAIN
from medusa.propose import ContextRead
from medusa.runtime import (
    ENGINES,
    ONE_TOKEN_STEPS_OF,
    compile_seconds,
    engine_for,
    onednn_batches_may_pay,
    onednn_trees_may_pay,
    precision_of,
    runs_the_target,
)
from medusa.sampling import SamplingConfig
from medusa.tree import Candidates, TreeSpec, build_buffers, chain
from medusa.tree_builder import check_accuracy, expected_tau, grow_tree, sync, time_step

logger = logging.getLogger(__name__)

# in a heads directory: {"acc_given_prefix": [[...], ...], "source": ..., optionally "decoded": (check_decoded)}
ACCURACY_NAME = "medusa_accuracy.json"
PLAN_VERSION = 24  # 3: the inductor engine is an option; 4: the dynamic tree skips heads that cannot matter (cheaper);
# 5: the inductor engine runs ahead-of-time packages on CPU; 6: a context layer's read of each step's positions costed;
# 7: pre-packed weights laid out for 8 rows (cheaper heads, context reads and pre-packed verifies); 8: proposing on
# int8 weights on a CPU (cheaper heads and context reads); 9: more repeats, a verify curve that never falls, near-ties
# go to the larger expected tau (choices that do not flip on noise); 10: the inductor engine attends over the rows
# written and concatenates float projections (cheaper verifies, flatter over tree size); 11: half-precision one-token
# steps on aten's GEMV (a cheaper plain step); 12: the dynamic tree's search on host lists, a CPU's heads rank 4,096
# candidates (a cheaper proposal); 13: w8a8's attention reads the values in place (cheaper verifies, most at long
# contexts); 14: bf16 on AMX runs inductor's C++ GEMM template, one-token steps too (cheaper steps); 15: taus decoded on
# held-out prompts where the heads ship them, hybrid costed at the nodes it verified there, 10 timed rounds; 16: w8a8
# on AVX2 calls fbgemm through a library op, sibling projections fused (a cheaper step); 17: proposing on fbgemm's int8
# GEMM, compiled ahead of time with the inductor engine (a cheaper proposal); 18: fp32 GEMMs on AVX-512 in 16 x 16
# register blocks (flatter verifies from 3 nodes); 19: fp32 GEMMs ask for their weights ahead (flatter verifies from 2
# nodes, on AVX2 too), int8 ones without AMX too; 20: int8 and int4 one-token steps on AMX CPUs without AMX kernels (a
# cheaper plain step); 21: bf16 without AMX on inductor's template, its weights asked for ahead (cheaper steps); 22: an
# EAGLE-3 draft's step compiled ahead of time with the inductor engine (a cheaper proposal); 23: a dynamic tree's
# verifies timed at LONG_CONTEXT too (a long call takes the tree that pays at its context); 24: a long call's growth
# measured from the same fitted curve at CONTEXT (short_latency_ms), not the static tree's raw medians
SIZES = (1, 2, 4, 6, 8, 12, 16, 24)  # tree nodes timed, root included (1 = plain decoding)
SLOW_ENGINE = 1.25  # an engine whose plain step is this much slower than the fastest one's is not timed further
MIN_GAIN = 1.05  # a speculative option must beat plain decoding by this much to be chosen
# Options expected within this share of the best are a tie on this machine's noise (two calibrations of one CPU
# differed by more): the tie goes to the most expected tokens per step, the part of the estimate timing noise
# does not move.
TIE_MARGIN = 0.03
REPEATS = 10  # timed rounds per option (medians), after one warm-up round
CONTEXT = 256  # tokens in the cache while timing: a typical chat prompt
# A plan of dynamic trees also times their verifies at this many cached tokens (where the model's positions reach
# it): each query row attends over every cached key, so a tree's verify grows with the context faster than a
# one-token step's (4,000 cached tokens: a 4-token verify 1.6-2.0x a one-token step, against 1.06-1.56x at 256;
# docs/benchmarks/cpu-zen4-long-context-session71), and a call decoding at a longer context than CONTEXT takes the tree
# size that pays there (Plan.at_context), which may be none
LONG_CONTEXT = 2048
# tau of the proposers the accuracy model does not cover, relative to a static tree of the same size, as measured on
# Spec-Bench (limit 10, shipped heads): dynamic 2.86 vs 2.74 (medusa); hybrid 3.21, at up to HYBRID_CHAIN more nodes.
DYNAMIC_TAU_GAIN = 1.04
# The accuracy table comes from MT-bench answers; on Spec-Bench's mix (translation, QA, maths, RAG...) the 16-node
# static tree accepted 2.47 tokens per step where the table predicts 3.02: 73% of the guessed part carried over.
# Expected taus are discounted so (1 + TAU_CARRY_OVER * sum of path values), which also keeps plans conservative.
TAU_CARRY_OVER = 0.73
HYBRID_TAU_GAIN = 1.17
CONTEXT_ROWS = 2  # positions a heads' context layer reads per step while calibrating (a step commits tau of them)
HYBRID_CHAIN = LOOKUP_CHAIN  # prompt lookup's longest chain: a hybrid step costed at its full length without taus
PROPOSERS = ("medusa", "dynamic", "hybrid")  # the speculative proposers a plan weighs for Medusa heads
DRAFT_PROPOSER = "eagle3"  # what a plan weighs for a target paired with an EAGLE-3 draft (medusa.eagle3)
# Batches (medusa.batch) verify rows x nodes tokens per forward, so the best tree shrinks as rows grow: a batch takes
# the choice timed for the smallest of these sizes that holds it (the largest beyond), measured on its first use
BATCH_BUCKETS = (2, 4, 8, 16)
BATCH_NODES = (2, 3, 4, 6, 8)  # tree sizes a batch may take, root included
BATCH_REPEATS = 4
# Choosing a batch's layout times whole decoding steps (what a verify's timing leaves out: masks, acceptance, commits),
# this many after a warm-up, at each of these numbers of cached tokens: every row of a batch attends over its longest
# prompt (padding included), so a batch's step grows with the width where one sequence's does not. The wider stays
# inside a 1,024-row cache with its steps, the size a call's prompts of up to ~900 tokens use too
BATCH_LAYOUT_STEPS = 6
# One sequence's steps are timed as the decode loop of twice this many new tokens less this many (time_alone_step): a
# step of the plan's tree commits a few (fewer steps to count than tokens), and 6 tokens left a difference of 2-3
# steps, whose timing ranged 17.6-34.9 ms for one 26 ms step (bf16, 8 nodes)
ALONE_TIMED_TOKENS = 4 * BATCH_LAYOUT_STEPS
BATCH_WIDTHS = (CONTEXT, 3 * CONTEXT)
# What a kept batch layout was timed with: 2, the plan's own steps alone (session 50); 3, a batch's rows proposing
# together (dynamic_tree.propose_batch) on heads compiled as for one sequence; 4, the inductor engine's batch package
# writing a step's rows in place (cheaper batched steps); 5, every tree expected to pay timed as whole steps, not
# the best three by the verify's expectation (which ranked the 3-node tree last of five at 2 fp32 rows, where its
# whole steps decoded fastest: docs/benchmarks/cpu-batch2-session56), and a tree of a size not decoded expected
# between the sizes decoded (planned_tau); 6, prompts on oneDNN on the inductor engine (cheaper prefills on AMD CPUs);
# 7, the inductor_onednn engine's batches on a package of their own with every GEMM on oneDNN (on the template's
# before). An older layout, or choice on a named engine, is timed again
BATCH_LAYOUT_VERSION = 7
# A batch's trees are expected to accept what they did on held-out prompts (decoded_taus); another workload accepts
# less of their guesses (Spec-Bench's first turns: 74-80% of the guessed part, tau - 1, at 2-8 nodes,
# docs/benchmarks/cpu-batch-trees-session49). Batches decoded together record what their rows accepted
# (ObservedAcceptance), and later layouts expect that share: from a prior of this many guessed tokens at the decoded
# taus, the older counting less past the memory
ACCEPTANCE_PRIOR = 32.0
ACCEPTANCE_MEMORY = 2048.0


@dataclass
class Option:
    """One configuration the plan compared."""

    engine: str
    proposer: str  # plain, medusa (static tree), dynamic, hybrid
    num_nodes: int  # tree nodes, root included (hybrid: before the prompt-lookup chain)
    tau: float  # expected tokens per step
    step_ms: float  # measured: propose + verify (+ acceptance)
    speedup: float = 0.0  # expected, over the best plain decoding

    @property
    def tokens_per_s(self) -> float:
        return 1000 * self.tau / self.step_ms


@dataclass
class ObservedAcceptance:
    """How much of their expected guessed part (tau - 1) a model's batch steps accepted: tokens accepted beyond each
    step's one against those expected, both from ACCEPTANCE_PRIOR at the expectation and scaled down together past
    ACCEPTANCE_MEMORY (older batches count less)."""

    accepted: float = ACCEPTANCE_PRIOR
    expected: float = ACCEPTANCE_PRIOR

    @property
    def share(self) -> float:
        return self.accepted / self.expected

    def add(self, expected_tau: float, accepted_lengths: list[int]) -> None:
        """Steps of a tree expected to accept `expected_tau` tokens a step that accepted these (one per row step)."""
        self.accepted += sum(accepted_lengths) - len(accepted_lengths)
        self.expected += (expected_tau - 1) * len(accepted_lengths)
        if self.expected > ACCEPTANCE_MEMORY:
            scale = ACCEPTANCE_MEMORY / self.expected
            self.accepted, self.expected = self.accepted * scale, self.expected * scale


def own_one_token_steps(engines) -> set[str]:
    """The engines among `engines` that plain decoding is measured on: not one whose one-token steps run another's
    package timed beside it (`inductor_onednn`'s are `inductor`'s), so that the yardstick, its engine and its step
    time, is one engine's whichever of the two timed its plain step faster."""
    return {name for name in engines if ONE_TOKEN_STEPS_OF.get(name) not in engines}


def planned_engines(device, compile: bool | None = None, base=None) -> tuple[str, ...]:
    """The engines a plan times. `compile` (default: `$MEDUSA_COMPILE` != "0") lets it time `inductor`, whose
    torch.compile takes minutes on a small CPU in every new process (torch keeps only its C++ kernels on disk for
    it: see medusa.runtime). On a GPU the compiled engine is torch.compile already, so `inductor` adds nothing.
    `inductor_onednn` only where it may pay for `base` (runtime.onednn_trees_may_pay): its package of trees is
    compiled once more per machine, and elsewhere it is `inductor` again."""
    compile = os.environ.get("MEDUSA_COMPILE") != "0" if compile is None else compile
    skip = {"inductor", "inductor_onednn"} if torch.device(device).type == "cuda" or not compile else set()
    if base is None or not onednn_trees_may_pay(base):
        skip.add("inductor_onednn")
    return tuple(e for e in ENGINES if e not in skip)


@dataclass
class Plan:
    """What `generate` uses unless told otherwise, and why (the options, measured latencies)."""

    engine: str
    proposer: str
    tree: list[list[int]]  # static tree paths (dynamic and hybrid take their size from it); [] for plain
    expected_speedup: float  # over plain decoding on the fastest engine
    plain_ms: float  # that plain decoding's step time: the online guard's yardstick
    reason: str
    options: list[dict] = field(default_factory=list)
    latency_ms: dict = field(default_factory=dict)  # engine -> {query length: median verify ms}
    key: dict = field(default_factory=dict)
    calibration_s: float = 0.0  # timing, compiling excluded
    compile_s: float = 0.0  # spent compiling the engines timed (torch.compile), before timing them
    # batch_key (a bucket and an engine) -> its choice (batch_choice), once measured
    batches: dict = field(default_factory=dict)
    long_context: int = 0  # cached tokens of long_latency_ms's timings (0: none taken)
    long_latency_ms: dict = field(default_factory=dict)  # {query length: fitted verify ms} on `engine` there
    # the same fit at CONTEXT (plain steps and dynamic trees, verify_curve): what a long call's growth is measured from
    short_latency_ms: dict = field(default_factory=dict)

    @property
    def chosen_option(self) -> dict | None:
        """The option chosen, as measured (engine, proposer, num_nodes, tau, step_ms, speedup)."""
        nodes = len(self.tree) + 1  # a plain plan's tree is []
        chosen = (
            o
            for o in self.options
            if (o["engine"], o["proposer"], o["num_nodes"]) == (self.engine, self.proposer, nodes)
        )
        return next(chosen, None)

    @property
    def step_ms(self) -> float | None:
        """The chosen option's measured step (propose + verify): what the guard scales its yardstick by."""
        option = self.chosen_option
        return option["step_ms"] if option else None

    @property
    def tau(self) -> float:
        """The tokens a step of the chosen option is expected to commit (1 for plain decoding)."""
        option = self.chosen_option
        return option["tau"] if option and self.proposer != "plain" else 1.0

    def at_context(self, context: int) -> tuple[int, float, float] | None:
        """For a call whose decoding attends over about `context` cached tokens: (the nodes of the dynamic tree that
        pays best there, root included, 1 for none, never more than the plan's own; its expected step ms; plain
        decoding's) -> what the call's proposer and guard take. Each verify's growth beyond CONTEXT is interpolated
        between the same fitted curve at CONTEXT and at `long_context` (extrapolated beyond it); the plan's own size
        is kept unless another is expected faster by TIE_MARGIN, and plain decoding wins unless a tree beats it by
        MIN_GAIN, as when the plan chose.
        None: no change (the context is no longer than CONTEXT, the plan is not of dynamic trees, or its long
        timings were not taken)."""
        if self.proposer != "dynamic" or not (self.long_latency_ms and self.short_latency_ms) or context <= CONTEXT:
            return None
        short = {int(n): ms for n, ms in self.short_latency_ms.items()}
        long = {int(n): ms for n, ms in self.long_latency_ms.items()}
        share = (context - CONTEXT) / (self.long_context - CONTEXT)

        def grown(nodes: int) -> float:
            return share * max(0.0, interpolate(long, nodes) - interpolate(short, nodes))

        steps = {1: self.plain_ms + grown(1)}
        taus = {1: 1.0}
        for o in self.options:
            if (o["engine"], o["proposer"]) == (self.engine, self.proposer):
                steps[o["num_nodes"]] = o["step_ms"] + grown(o["num_nodes"])
                taus[o["num_nodes"]] = o["tau"]
        rate = {n: taus[n] / steps[n] for n in steps}
        chosen = len(self.tree) + 1
        trees = [n for n in rate if 1 < n <= chosen]  # no larger: the call's cache and guard are sized by its tree
        best = max(trees, key=rate.get, default=1)
        if best == 1 or rate[best] < rate[1] * MIN_GAIN:
            best = 1
        elif chosen in rate and rate[chosen] >= rate[1] * MIN_GAIN and rate[best] <= rate[chosen] * (1 + TIE_MARGIN):
            best = chosen
        return best, steps[best], steps[1]

    def chain_ms(self, engine: str, guesses: int) -> list[float] | None:
        """The verify's ms on `engine` for the root and 0 .. `guesses` guessed tokens, from the query lengths timed
        there (never falling with length; linear between them and beyond): what prompt lookup sizes its trees by.
        None where fewer than two lengths were timed."""
        timed = sorted((int(n), ms) for n, ms in self.latency_ms.get(engine, {}).items())
        if len(timed) < 2:
            return None
        curve, most = {}, 0.0
        for n, ms in timed:
            most = max(most, ms)
            curve[n] = most
        return [interpolate(curve, 1 + g) for g in range(guesses + 1)]

    @property
    def plain_engine(self) -> str:
        """The engine of the fastest plain decoding measured: the yardstick `expected_speedup` is over."""
        plain = [o for o in self.options if o["proposer"] == "plain"]
        own = own_one_token_steps({o["engine"] for o in plain})
        plain = [o for o in plain if o["engine"] in own]
        return min(plain, key=lambda o: o["step_ms"])["engine"] if plain else self.engine

    def describe(self) -> str:
        if self.proposer == "prompt_lookup":  # no acceptance to expect: trees as large as their timed cost pays for
            summary = f"plan: prompt lookup on the {self.engine} engine, trees sized by the verify's cost timed here"
        else:
            summary = (
                f"plan: {self.proposer} on the {self.engine} engine, {len(self.tree) + 1 if self.tree else 1} nodes, "
                f"expected {self.expected_speedup:.2f}x over plain decoding"
            )
        lines = [
            f"{summary} ({self.reason})",
            f"{'engine':<9} {'proposer':<8} {'nodes':>5} {'exp. tau':>8} {'step ms':>8} {'exp. speedup':>12}",
        ]
        for o in sorted(self.options, key=lambda o: -o["speedup"])[:12]:
            lines.append(
                f"{o['engine']:<9} {o['proposer']:<8} {o['num_nodes']:>5} {o['tau']:>8.2f} "
                f"{o['step_ms']:>8.1f} {o['speedup']:>11.2f}x"
            )
        if self.long_latency_ms:  # what sizes a long call's tree (at_context)
            for context, curve in ((CONTEXT, self.short_latency_ms), (self.long_context, self.long_latency_ms)):
                timed = ", ".join(f"{n}: {ms:.1f}" for n, ms in curve.items())
                lines.append(
                    f"verify ms at {context} cached tokens, by nodes, fitted (sizes a long call's tree): {timed}"
                )
        return "\n".join(lines)


def load_accuracy(directory) -> tuple[list[list[float]] | None, dict | None]:
    """The heads' accuracy table and decoded taus (check_decoded) from their directory (None where absent)."""
    path = Path(directory) / ACCURACY_NAME
    if not path.is_file():
        return None, None
    try:
        data = json.loads(path.read_text())
        decoded = data.get("decoded")
        return check_accuracy(data["acc_given_prefix"]), None if decoded is None else check_decoded(decoded)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as err:
        raise ValueError(
            f"{path} is not a valid accuracy table ({err}): regenerate it with medusa accuracy "
            f"--heads-dir (and --taus), or delete it to plan without one"
        ) from err


def save_accuracy(directory, acc: list[list[float]], source: str = "", decoded: dict | None = None) -> None:
    """Writes the table (and decoded taus, which were grown from it: a new table drops them)."""
    data = {"acc_given_prefix": check_accuracy(acc), "source": source}
    if decoded is not None:
        data["decoded"] = check_decoded(decoded)
    atomic_write_text(Path(directory) / ACCURACY_NAME, json.dumps(data, indent=2))


def load_draft_taus(directory) -> dict | None:
    """A draft's decoded taus (check_decoded) from its directory (None where it has none): a draft has no accuracy
    table, so ACCURACY_NAME holds them alone."""
    path = Path(directory) / ACCURACY_NAME
    if not path.is_file():
        return None
    try:
        return check_decoded(json.loads(path.read_text())["decoded"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as err:
        raise ValueError(
            f"{path} holds no valid decoded taus ({err}): write them again with medusa accuracy --taus --eagle3 "
            f"{directory} --heads-dir, or delete the file to plan without them"
        ) from err


def save_draft_taus(directory, decoded: dict) -> None:
    atomic_write_text(Path(directory) / ACCURACY_NAME, json.dumps({"decoded": check_decoded(decoded)}, indent=2))


def check_decoded(decoded: dict) -> dict:
    """Validate decoded taus: {"tau": {proposer: {nodes: tokens per step}}, "nodes": {proposer: {nodes: nodes verified
    per step}}, "source": str}, proposers from PROPOSERS (or DRAFT_PROPOSER), node counts >= 2, values >= 1 -> the
    table, keys as JSON's."""
    checked = dict(decoded)  # with node counts as strings (JSON's keys), values as floats
    for part in ("tau", "nodes"):
        checked[part] = {}
        for proposer, by_size in decoded[part].items():
            if proposer not in (*PROPOSERS, DRAFT_PROPOSER):
                raise ValueError(
                    f"decoded {part}: unknown proposer {proposer!r} (expected one of {(*PROPOSERS, DRAFT_PROPOSER)})"
                )
            for nodes, value in by_size.items():
                if not (str(nodes).isdigit() and int(nodes) >= 2 and float(value) >= 1):
                    raise ValueError(f"decoded {part} of {proposer} at {nodes!r} nodes: {value!r} is not >= 1")
            checked[part][proposer] = {str(nodes): float(value) for nodes, value in by_size.items()}
    return checked


def decoded_curve(decoded: dict | None, part: str, proposer: str) -> dict[int, float]:
    """decoded[part][proposer] (check_decoded) by node count; empty where not decoded."""
    return {} if decoded is None else {int(n): value for n, value in decoded[part].get(proposer, {}).items()}


def decoded_value(decoded: dict | None, part: str, proposer: str, nodes: int) -> float | None:
    """decoded[part][proposer][nodes] (check_decoded), None where not decoded."""
    return decoded_curve(decoded, part, proposer).get(nodes)


def weights_fingerprint(module, described: str) -> str:
    """Changes when `described` (how the module is configured) or the module's weights do (a sum per tensor: cheap,
    and enough to tell weights apart)."""
    sums = [float(t.double().sum()) for t in module.state_dict().values()]
    return hashlib.sha256((described + repr(sums)).encode()).hexdigest()[:16]


def heads_fingerprint(model) -> str:
    return weights_fingerprint(model.heads, json.dumps(asdict(model.config), sort_keys=True, default=str))


def draft_fingerprint(model) -> str:
    """A target's draft (medusa.draft.TargetAndDraft) and how deep it drafts."""
    shape = [type(model.draft).__name__, model.num_speculative_tokens, getattr(model, "topk", None)]
    return weights_fingerprint(model.draft, repr(shape))


def drafts(model) -> bool:
    """Whether `model` pairs its target with a draft (medusa.draft.TargetAndDraft) rather than Medusa heads."""
    return getattr(model, "draft", None) is not None


def plan_key(model, engines: tuple[str, ...]) -> dict:
    base = model.base
    if drafts(model):
        proposal = "draft " + draft_fingerprint(model)
    else:
        proposal = heads_fingerprint(model) if model.heads_trained else "untrained"
    return {
        "version": PLAN_VERSION,
        "engines": list(engines),
        **describe(model.device),
        "base": str(base.config.name_or_path),
        "base_parameters": sum(p.numel() for p in base.parameters()),
        "heads": proposal,
        "dtype": precision_of(base),
        "has_accuracy": getattr(model, "accuracy", None) is not None,
        "decoded_taus": hashlib.sha256(json.dumps(model.decoded_taus, sort_keys=True).encode()).hexdigest()[:16]
        if model.decoded_taus
        else None,
    }


def plan_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_root() / "plans" / f"{digest}.json"


# ------------------------------------------------------------------------------------------------------ measuring
@torch.inference_mode()
def measure(
    model,
    engines=None,
    sizes=SIZES,
    repeats: int = REPEATS,
    context: int = CONTEXT,
    progress: bool = True,
    proposers: tuple[str, ...] = PROPOSERS,
):
    """-> ({engine: {(proposer, nodes): (propose_ms, verify_ms)}} as medians, the static trees' path order).

    Static trees come from the heads' accuracy table (grow_tree), dynamic and hybrid trees from the same sizes
    (untrained heads: chains of those sizes, as many tokens as prompt lookup verifies); a draft's (DRAFT_PROPOSER)
    trees of those sizes are its own, `order` a chain that only sizes them; every proposal is verified
    and accepted, then the cache is set back, so all sizes see `context` tokens. Engines (for their plain steps),
    sizes and proposers are interleaved within each repeat, so drifts in machine load hit them alike. `proposers`:
    those of trained heads to time (every one the plan weighs by default).
    """
    device, sampling = model.device, SamplingConfig()
    engines = engines or planned_engines(device, base=model.base)
    vocab = model.base.get_output_embeddings().weight.shape[0]
    prompt = torch.randint(0, vocab, (1, context), generator=torch.Generator().manual_seed(0)).to(device)
    if drafts(model):
        order = chain(max(sizes) - 1)
        jobs = [("plain", 1)] + [(DRAFT_PROPOSER, n) for n in sizes if n > 1]
    elif model.heads_trained:
        order = grow_tree(model.accuracy, max(sizes)) if model.accuracy is not None else []
        sizes = [n for n in sizes if n == 1 or n - 1 <= len(order)]
        jobs = [("plain", 1)] + [(p, n) for n in sizes if n > 1 for p in proposers]
    else:  # no trees to weigh: prompt lookup's verifies, whose guesses follow their cost (Plan.chain_ms)
        order, sizes = [], [n for n in sizes if n <= LOOKUP_CHAIN + 2]
        jobs = [("plain", 1)] + [("prompt_lookup", n) for n in sizes if n > 1]
    states = {}  # per engine: the prefilled state every step starts from
    for name in engines:
        engine = engine_for(model.base, name)  # compiles first, if this engine does (timed apart: see calibrate)
        states[name] = prefill(
            model.base,
            prompt,
            sampling,
            feature_layers=model.feature_layers,
            engine=engine,
            max_length=context + max(sizes) + HYBRID_CHAIN + 1,
        )
    # plain steps first, the engines in turn (a busy spell of the machine slows them alike; timed one engine after
    # another, it had left out the fastest engine, and the plan is kept): engines far slower than the fastest are
    # not timed further
    plain, plain_samples = model.make_proposer("plain", None, sampling, None), {name: [] for name in engines}
    for _ in range(repeats + 1):
        for name in engines:
            plain_samples[name].append(
                sum(time_step(model, engine_for(model.base, name), plain, states[name], sampling))
            )
    plain_ms = {name: statistics.median(times[1:] or times) for name, times in plain_samples.items()}  # 1st: warm-up
    fastest = min(plain_ms.values())
    engines = [name for name in engines if plain_ms[name] <= SLOW_ENGINE * fastest]
    for name in engines:  # what proposes is timed as decoding runs it: compiled where an engine compiles the target
        model.prepare_proposal(engine_for(model.base, name))
    proposers = {
        (p, n): _Chain(n, device)
        if p == "prompt_lookup"
        else model.make_proposer(p, [list(path) for path in order[: n - 1]] or None, sampling, None)
        for p, n in jobs
    }  # the same for every engine
    for job in jobs:
        if job[0] == DRAFT_PROPOSER:
            proposers[job] = _Steady(proposers[job])
    results = {}
    total = len(engines) * (repeats + 1) * len(jobs)
    done, start = 0, time.perf_counter()
    for name in engines:
        engine = engine_for(model.base, name)
        samples, state = {job: ([], []) for job in jobs}, states[name]
        for rep in range(repeats + 1):  # the first round warms up
            for job in jobs[rep % len(jobs) :] + jobs[: rep % len(jobs)]:
                propose_ms, verify_ms, accept_ms = time_step(model, engine, proposers[job], state, sampling)
                if rep:
                    samples[job][0].append(propose_ms)
                    samples[job][1].append(verify_ms + accept_ms)
                done += 1
            if progress:
                _progress(f"calibrating: {done}/{total} steps timed", start)
        results[name] = {job: tuple(statistics.median(s) for s in samples[job]) for job in jobs}
    if progress:
        print(file=sys.stderr)
    read_ms = 0.0 if drafts(model) else _context_read_ms(model, states[engines[0]], repeats + 1)
    for jobs_measured in results.values():
        for job, (propose_ms, verify_ms) in jobs_measured.items():
            if job[0] != "plain":
                jobs_measured[job] = (propose_ms + read_ms, verify_ms)
    return results, order


class _Chain:
    """The root and `nodes` - 1 copies of it as a chain: a prompt-lookup step's verify, timed (a random prompt
    matches nothing to look up; a tree of as many nodes verifies as many tokens)."""

    def __init__(self, nodes: int, device):
        self.nodes, self.tree = nodes, build_buffers(TreeSpec(chain(nodes - 1)), nodes - 1).to(device)

    def propose(self, state) -> Candidates:
        return Candidates(state.root_token.view(1).repeat(self.nodes), self.tree)

    def observe(self, state, accepted_tokens) -> None:
        pass


class _Steady:
    """A draft's proposal as decoding makes it: each step it first reads the positions the last step committed. The
    timed state never moves on, so before each proposal the draft forgets the last CONTEXT_ROWS positions it read
    (medusa.eagle3.Eagle3Proposer.forget) and reads them again."""

    def __init__(self, inner, rows: int = CONTEXT_ROWS):
        self.inner, self.rows, self.max_nodes = inner, rows, inner.max_nodes

    def propose(self, state) -> Candidates:
        self.inner.forget(self.rows)
        return self.inner.propose(state)

    def observe(self, state, accepted_tokens) -> None:
        pass


@torch.inference_mode()
def decode_options(
    model, prompts: list[list[int]], max_new_tokens: int = 128, sizes=SIZES, engine=None, progress: bool = True
) -> dict:
    """Decode each prompt (token ids) greedily with every option the plan weighs (PROPOSERS x `sizes`, trees grown
    from the heads' accuracy table; a draft's own trees of `sizes` nodes) -> decoded taus (check_decoded, "source" left
    to the caller): tokens committed per verify step, and nodes verified per step (a hybrid's chain varies), pooled
    over the prompts. Greedy outputs are the same whatever the option (up to near-ties below float32), so only the
    steps differ."""
    if drafts(model):
        proposers, order = (DRAFT_PROPOSER,), chain(max(sizes) - 1)
    elif model.accuracy is None:
        raise ValueError("decoding the plan's options needs the heads' accuracy table: run medusa accuracy --heads-dir")
    else:
        proposers, order = PROPOSERS, grow_tree(model.accuracy, max(sizes))
    jobs = [(p, n) for n in sizes if 1 < n <= len(order) + 1 for p in proposers]
    tau, nodes = {p: {} for p in proposers}, {p: {} for p in proposers}
    start = time.perf_counter()
    for done, (proposer, n) in enumerate(jobs):
        committed = verified = steps = 0
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt], device=model.device),
                max_new_tokens=max_new_tokens,
                proposer=proposer,
                tree=[list(path) for path in order[: n - 1]],
                engine=engine,
                return_dict_in_generate=True,
            )
            committed += sum(out.stats.accepted_lengths)
            verified += sum(out.stats.verified_nodes)
            steps += len(out.stats.accepted_lengths)
        tau[proposer][str(n)] = round(committed / max(steps, 1), 4)
        nodes[proposer][str(n)] = round(verified / max(steps, 1), 3)
        if progress:
            _progress(f"decoding the plan's options: {done + 1}/{len(jobs)}", start)
    if progress:
        print(file=sys.stderr)
    return {"tau": tau, "nodes": nodes}


def _progress(text: str, start: float) -> None:
    """`text` and the seconds since `start` over stderr's current line (a newline ends it when the work is done)."""
    print(f"\r{text}, {time.perf_counter() - start:.0f} s", end="", file=sys.stderr, flush=True)


def _context_read_ms(model, state, repeats: int, rows: int = CONTEXT_ROWS) -> float:
    """What heads with a context layer pay each step in decoding and not in `time_step` (whose state never moves
    on): reading the positions the last step committed, as decoding reads them (compiled where it is). Median ms of
    reading `rows` of them; 0 without the layer."""
    heads = getattr(model, "proposal_heads", model.heads)
    if heads.context is None:
        return 0.0
    compiled = getattr(model, "compiled_proposal", None)
    read = compiled.context_read if compiled else ContextRead(heads)
    embed = model.base.get_input_embeddings()
    tokens = torch.tensor(state.tokens[1:], device=model.device)  # the token after each cached position
    _, (keys, values, seen) = heads.contextualise(state.new_hidden[None, :-rows], embed(tokens[:-rows])[None])
    past = keys, values, torch.as_tensor(seen, device=model.device).view(1)
    counts = torch.tensor([rows], device=model.device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        read(state.new_hidden[None, -rows:], embed(tokens[None, -rows:]), *past, counts)
        sync(model.device)
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def verify_curve(jobs: dict) -> dict[int, float]:
    """One engine's measurements -> {nodes: verify ms}: the median of every proposer's verify over that many nodes (the
    same forward), fitted so that more nodes never cost less (adjacent sizes that noise put out of order are pooled,
    weighted by how many measurements each has: the least-squares non-decreasing fit)."""
    by_nodes: dict[int, list[float]] = {}
    for (proposer, n), (_, verify_ms) in jobs.items():
        if proposer != "hybrid":  # a hybrid verifies its chain too: more nodes than it is named by
            by_nodes.setdefault(n, []).append(verify_ms)
    blocks = []  # [mean, weight, sizes]
    for n in sorted(by_nodes):
        blocks.append([statistics.median(by_nodes[n]), len(by_nodes[n]), [n]])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (a, wa, na), (b, wb, nb) = blocks[-2], blocks.pop()
            blocks[-1] = [(a * wa + b * wb) / (wa + wb), wa + wb, na + nb]
    return {n: mean for mean, _, sizes in blocks for n in sizes}


def choose(measured: dict, order, acc, decoded: dict | None = None) -> tuple[Option, list[Option], Option]:
    """Every option's expected speedup over the fastest plain decoding -> (best, all options, that plain option).
    Options within TIE_MARGIN of the fastest expected are a tie, won by the most expected tokens per step.
    `decoded`: the heads' decoded taus (check_decoded), where they have them."""
    options = []
    for engine, jobs in measured.items():
        fitted = verify_curve(jobs)
        for (proposer, n), (propose_ms, verify_ms) in jobs.items():
            if proposer == "prompt_lookup":  # timed for its chains' verify cost (latency_ms), not weighed
                continue
            verify_ms = fitted[n] if proposer != "hybrid" else verify_ms
            if proposer == "plain":
                options.append(Option(engine, "plain", 1, 1.0, propose_ms + verify_ms))
                continue
            tau = planned_tau(order, n, acc, proposer, decoded)
            if tau is None:  # nothing to expect it to accept
                continue
            step = propose_ms + verify_ms
            verified = decoded_value(decoded, "nodes", proposer, n)
            if proposer == "hybrid" and verified is not None:  # the tree and the chain it grafted on, on average
                step = propose_ms + interpolate(fitted, verified)
            elif proposer == "hybrid":  # costed as if the whole chain were grafted on
                larger = [m for (p, m) in jobs if p == "medusa" and m >= n + HYBRID_CHAIN]
                step = propose_ms + (fitted[min(larger)] if larger else verify_ms * 2)
            options.append(Option(engine, proposer, n, tau, step))
    own = own_one_token_steps({o.engine for o in options})
    plain = max((o for o in options if o.proposer == "plain" and o.engine in own), key=lambda o: o.tokens_per_s)
    return _fastest(options, plain), options, plain


def interpolate(curve: dict[int, float], nodes: float) -> float:
    """A verify curve ({nodes: ms}) at a fractional node count: linear between the sizes around it, the nearest
    segment's slope beyond the largest."""
    sizes = sorted(curve)
    if nodes <= sizes[0] or len(sizes) == 1:
        return curve[sizes[0]]
    upper = next((n for n in sizes[1:] if n >= nodes), sizes[-1])
    lower = sizes[sizes.index(upper) - 1]
    return curve[lower] + (nodes - lower) * (curve[upper] - curve[lower]) / (upper - lower)


def planned_tau(order, nodes: int, acc, proposer: str, decoded: dict | None = None) -> float | None:
    """Expected tokens per step of `proposer` over the first `nodes - 1` paths of `order`: as decoded on held-out
    prompts where `decoded` has it, or linearly between the sizes decoded around it (a batch's 3-node tree: the
    table's model, another workload's, put the shipped heads' at 1.76 where 2 and 4 nodes decoded 1.66 and 2.37),
    else the accuracy table's, discounted by TAU_CARRY_OVER, times what the proposer gains over a static tree of that
    size; None without a table (a draft's trees beyond the sizes decoded)."""
    taus = decoded_curve(decoded, "tau", proposer)
    if nodes in taus:
        return taus[nodes]
    if taus and min(taus) < nodes < max(taus):
        return interpolate(taus, nodes)
    if acc is None:
        return None
    tau = 1 + TAU_CARRY_OVER * (expected_tau(order[: nodes - 1], acc) - 1)
    return tau * {"medusa": 1.0, "dynamic": DYNAMIC_TAU_GAIN, "hybrid": HYBRID_TAU_GAIN}[proposer]


def _fastest(options: list[Option], plain: Option) -> Option:
    """Sets each option's speedup over `plain` -> the fastest; speculative options within TIE_MARGIN of it (and
    beating plain by MIN_GAIN) are a tie, won by the most expected tokens per step."""
    for o in options:
        o.speedup = o.tokens_per_s / plain.tokens_per_s
    best = max(options, key=lambda o: o.speedup)
    tied = [o for o in options if o.proposer != "plain" and o.speedup >= max(MIN_GAIN, best.speedup * (1 - TIE_MARGIN))]
    return max(tied, key=lambda o: (o.tau, o.speedup)) if tied else best


def long_context(model) -> int | None:
    """LONG_CONTEXT where the model's positions reach past it with room for a tree (None: they do not)."""
    positions = getattr(model.base.config.get_text_config(), "max_position_embeddings", None) or 0
    return LONG_CONTEXT if positions >= LONG_CONTEXT + max(SIZES) + HYBRID_CHAIN + 1 else None


def calibrate(
    model, engines=None, sizes=None, repeats: int = REPEATS, progress: bool = True, key: dict | None = None
) -> Plan:
    """Measure on this machine and choose (nothing is read from or written to the cache). `key`: the model's
    plan_key when the caller has it already (it sums every heads tensor). `engines`: default planned_engines;
    `sizes`: the tree sizes timed, SIZES by default."""
    engines = engines or planned_engines(model.device, base=model.base)
    sizes = sizes or SIZES  # read when called (a test times fewer)
    start = time.perf_counter()
    compiled_before = compile_seconds(model.base)
    if drafts(model):  # the sizes whose acceptance was decoded: nothing else can be weighed
        taus = decoded_curve(model.decoded_taus, "tau", DRAFT_PROPOSER)
        measured, order = measure(model, engines, [n for n in sizes if n == 1 or n in taus], repeats, progress=progress)
        plan = decide(measured, order, None, model.decoded_taus, proposer=DRAFT_PROPOSER)
    else:
        acc = model.accuracy
        timed = sizes if acc is not None or not model.heads_trained else (1,)  # untrained heads: lookup's chains
        measured, order = measure(model, engines, timed, repeats, progress=progress)
        plan = decide(measured, order, acc, model.decoded_taus, heads_trained=model.heads_trained)
        long = long_context(model)
        if plan.proposer == "dynamic" and long:  # what its trees cost where a call's context is long
            at_long, _ = measure(model, [plan.engine], timed, repeats, long, progress, proposers=("dynamic",))
            at_short = {job: ms for job, ms in measured[plan.engine].items() if job[0] in ("plain", "dynamic")}
            fitted = lambda jobs: {str(n): round(ms, 3) for n, ms in verify_curve(jobs).items()}  # noqa: E731
            plan.long_context, plan.long_latency_ms = long, fitted(at_long[plan.engine])
            plan.short_latency_ms = fitted(at_short)  # like with like: the same jobs, fitted alike
    plan.compile_s = compile_seconds(model.base) - compiled_before
    plan.key, plan.calibration_s = key or plan_key(model, engines), time.perf_counter() - start - plan.compile_s
    return plan


def decide(
    measured: dict, order, acc, decoded: dict | None = None, heads_trained: bool = True, proposer: str = "medusa"
) -> Plan:
    """Measured step times ({engine: {(proposer, nodes): (propose_ms, verify_ms)}}), the static trees' path order,
    the accuracy table (None: unknown) and decoded taus -> the plan: the best option, or plain decoding unless one
    beats it by MIN_GAIN. With neither a table nor decoded taus: `proposer` (the heads' own tree, a draft's own
    proposal; `tree` []) on the fastest engine, guarded online; untrained heads (`heads_trained` False) leave the
    guessing to prompt lookup there, guarded as well."""
    best, options, plain = choose(measured, order, acc, decoded)
    if not heads_trained:
        best = Option(plain.engine, "prompt_lookup", 0, 0.0, 0.0, speedup=1.0)
        reason = (
            "untrained heads guess nothing: prompt lookup (copies of the prompt and output so far) on the fastest "
            "engine, guarded online"
        )
    elif acc is None and decoded is None:
        best = Option(plain.engine, proposer, 0, 0.0, 0.0, speedup=1.0)
        reason = (
            "the heads have no accuracy table to predict acceptance from: their own tree, guarded online"
            if proposer == "medusa"
            else "the draft has no decoded taus to predict acceptance from (medusa accuracy --taus --eagle3 DIR "
            "--heads-dir): its own proposal, guarded online"
        )
    elif best.speedup < MIN_GAIN:
        best, reason = (
            plain,
            (
                f"no speculative option is expected to beat plain decoding by {MIN_GAIN - 1:.0%} "
                f"here (best {max((o.speedup for o in options if o.proposer != 'plain'), default=0):.2f}x)"
            ),
        )
    else:
        reason = f"the most expected tokens per second of {len(options)} options measured here"
    latency = {
        e: {
            str(n): round(v[1], 3)
            for (p, n), v in jobs.items()
            if p in ("plain", "medusa", "prompt_lookup", DRAFT_PROPOSER)
        }
        for e, jobs in measured.items()
    }
    tree = [list(p) for p in order[: best.num_nodes - 1]] if best.proposer != "plain" else []
    return Plan(
        engine=best.engine,
        proposer=best.proposer,
        tree=tree,
        expected_speedup=best.speedup,
        plain_ms=plain.step_ms,
        reason=reason,
        options=[asdict(o) for o in options],
        latency_ms=latency,
    )


def load_or_calibrate(model, recalibrate: bool = False, progress: bool = True, compile: bool | None = None) -> Plan:
    """The cached plan for this machine, model and heads; calibrated (and cached) when there is none or it is
    unreadable (a corrupt file is replaced, with a warning)."""
    engines = planned_engines(model.device, compile, model.base)
    key = plan_key(model, engines)
    path = plan_path(key)
    if path.is_file() and not recalibrate:
        try:
            data = json.loads(path.read_text())
            if data.get("key") == json.loads(json.dumps(key)):
                return Plan(**data)
            logger.warning("cached plan %s was made for another set-up: calibrating again", path)
        except (json.JSONDecodeError, TypeError) as err:
            logger.warning("cached plan %s is unreadable (%s): calibrating again", path, err)
    if progress:
        print(
            f"calibrating a decoding plan for this machine (once; cached in {path.parent})", file=sys.stderr, flush=True
        )
    plan = calibrate(model, engines, progress=progress, key=key)
    _save(plan, path)
    return plan


def _save(plan: Plan, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(asdict(plan), indent=1))


class Planned:
    """What a model whose `generate` follows a calibrated plan holds (MedusaModel, medusa.eagle3.Eagle3Model): `plan`
    (None: the eager engine, the model's own proposal), `engine_override` (an engine named at load wins over the
    plan), `calibrate`."""

    plan: Plan | None = None
    engine_override: str | None = None

    @property
    def default_engine(self) -> str:
        return self.engine_override or (self.plan.engine if self.plan else "eager")

    @runs_the_target
    def calibrate(self, recalibrate: bool = True, progress: bool = True, compile: bool | None = None) -> Plan:
        """Measure this machine and choose engine, proposal and its size (medusa.plan); cached, and used from now on.
        `compile`: whether torch.compile's engine is an option (default: `$MEDUSA_COMPILE` != "0")."""
        self.plan = None  # measure the proposers themselves, not the guard around them
        self.plan = load_or_calibrate(self, recalibrate=recalibrate, progress=progress, compile=compile)
        return self.plan

    def guarded(self, proposer) -> GuardedProposer:
        """`proposer`, decoding plainly where its guesses stop paying (medusa.guard): judged against the plan's plain
        and guessing steps."""
        return GuardedProposer(proposer, self.plan.plain_ms, self.device, expected_step_ms=self.plan.step_ms)

    def _planned(self, plan: str | None, engine: str | None, compile: bool | None):
        """The constructors' `plan`, `engine` and `compile` (from_pretrained's docstring) applied -> self."""
        if engine is not None and engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}: use one of {list(ENGINES)}")
        self.engine_override = engine
        plan = plan or os.environ.get("MEDUSA_PLAN", "auto")
        if plan not in ("auto", "off"):
            raise ValueError(f"plan must be 'auto' or 'off', got {plan!r}")
        if plan == "auto":
            self.calibrate(recalibrate=False, compile=compile)
            self.engine()  # built (and compiled, for torch.compile's engine) at load, not in the first generate
        return self


# ------------------------------------------------------------------------------------------------------ batches
def batch_bucket(rows: int) -> int:
    """The batch size whose choice a batch of `rows` takes: the smallest bucket that holds it, else the largest."""
    return next((bucket for bucket in BATCH_BUCKETS if bucket >= rows), BATCH_BUCKETS[-1])


def batch_key(rows: int, engine: str | None) -> str:
    """Where the plan keeps the choice for batches of `rows` rows on `engine` (its bucket's, batch_bucket); None: the
    layout chosen among the engines and decoding the rows one at a time."""
    return f"{batch_bucket(rows)} on {engine or 'the fastest layout'}"


def batch_choice(model, rows: int, progress: bool = True, engine: str | None = None) -> dict:
    """How a batch of `rows` decodes under `model.plan`, measured the first time its bucket is asked for, then kept
    in the plan and its cache file.
    On a named batch `engine`: {"proposer", "tree", "expected_speedup" (over batched plain decoding there), "tau",
    "verify_ms" ({nodes: ms} at the bucket's rows), "engine"} (_calibrate_batch).
    With none: what `lay_out` chooses from for a call (_lay_out_batch): the rows decoded together on the batch engine
    whose plain decoding is faster, plainly or with that engine's tree, or one at a time as the plan decodes one
    sequence, each timed as whole steps."""
    plan = model.plan
    key = batch_key(rows, engine)  # (an older plan's keys name no engine: timed again)
    # a choice timed by an older BATCH_LAYOUT_VERSION, or a layout timed before every engine the plan weighs took
    # batches (the inductor engine's package): timed again
    kept = plan.batches.get(key)
    stale = kept is not None and (
        kept.get("version") != BATCH_LAYOUT_VERSION
        or (not engine and set(kept["plain_ms"]) != set(_batch_engines(model)))
    )
    if kept is None or stale:
        if progress:
            print(f"calibrating batches of {key} (once; kept with the plan)", file=sys.stderr, flush=True)
        start = time.perf_counter()
        if engine is None:
            plan.batches[key] = _lay_out_batch(model, batch_bucket(rows), progress)
        else:
            plan.batches[key] = _calibrate_batch(model, batch_bucket(rows), engine)
        plan.batches[key].update(version=BATCH_LAYOUT_VERSION, calibration_s=round(time.perf_counter() - start, 1))
        if plan.key:
            _save(plan, plan_path(plan.key))
    return plan.batches[key]


def calibrate_batches(model, most_rows: int, progress: bool = True) -> None:
    """Time now every batch layout that continuous batching of up to `most_rows` rows may ask `model`'s plan for
    (each bucket's, with no engine named and on each engine it weighs), rather than when a call first needs it and a
    server holds every request behind that timing (`medusa serve` calls this before it listens; docs/serving.md says
    how long it takes). Timed once per machine, kept with the plan; nothing without a plan."""
    if getattr(model, "plan", None) is None or most_rows < 2:
        return
    for bucket in BATCH_BUCKETS[: BATCH_BUCKETS.index(batch_bucket(most_rows)) + 1]:
        for engine in batch_choice(model, bucket, progress)["plain_ms"]:
            batch_choice(model, bucket, progress, engine=engine)


def _lay_out_batch(model, rows: int, progress: bool) -> dict:
    """What `lay_out` weighs for `rows` rows, timed for real: whole steps of plain decoding together on each engine
    the plan weighed (time_batch_step) at each of BATCH_WIDTHS cached tokens; on the fastest (at CONTEXT) every tree
    its batched verify expects to pay (_calibrate_batch: a verify's timing leaves out each row's propose, mask and
    acceptance, which grow with the tree), each timed as whole steps there too, with its expected tau, and the
    prefill per token (time_batch_prefill); one sequence's plain step on the plan's plain engine and the plan's own
    whole steps on its engine (time_alone_step, at each of BATCH_WIDTHS), its prefill per token on the plan's engine,
    and its expected tau. (Every row's step attends over the batch's longest prompt: batches took trees that lost,
    docs/benchmarks/cpu-batch-amx-session46.)"""
    plan, sampling, engines = model.plan, SamplingConfig(), _batch_engines(model)

    def step_ms(engine: str, proposer: str, tree) -> dict[str, float]:
        make = lambda: model.make_proposer(proposer, tree, sampling, None)  # noqa: E731
        target = engine_for(model.base, engine)
        model.prepare_proposal(target)  # as a batch on that engine proposes (decode.SpeculativeGenerator)
        return {
            str(width): time_batch_step(target, make, rows, width, BATCH_LAYOUT_STEPS, model.feature_layers)
            for width in BATCH_WIDTHS
        }

    def alone_ms(engine: str, proposer: str, tree) -> dict[str, float]:
        return {
            str(width): time_alone_step(model, engine, width, ALONE_TIMED_TOKENS, proposer=proposer, tree=tree)
            for width in BATCH_WIDTHS
        }

    together_ms = {e: step_ms(e, "plain", None) for e in engines}
    batched = min(engines, key=lambda e: together_ms[e][str(CONTEXT)])
    candidates = batch_choice(model, rows, progress, engine=batched)["candidates"]
    return {
        "rows": rows,
        "engine": batched,
        "plain_ms": together_ms,  # {engine: {width: ms per step}}
        "prefill_ms_per_token": time_batch_prefill(engine_for(model.base, batched), 2, CONTEXT),
        # {proposer, tree, tau, expected_speedup, step_ms {width: ms}}; none where the heads have no accuracy table
        "trees": [dict(tree, step_ms=step_ms(batched, tree["proposer"], tree["tree"])) for tree in candidates],
        "alone_engine": plan.engine,
        "alone_plain_engine": plan.plain_engine,
        "alone_plain_ms": alone_ms(plan.plain_engine, "plain", None),
        # the plan's own steps, as timed here: one sequence's plan expects its steps at the plan's context and its
        # tau on held-out prompts (Spec-Bench's 12 first turns one at a time, bf16: 1.55x plain where it expected 2.16)
        "alone_step_ms": alone_ms(plan.engine, plan.proposer, plan.tree or None),
        "alone_tau": plan.tau,
        "alone_prefill_ms_per_token": time_alone_prefill(model, plan.engine, CONTEXT),
    }


def _batch_engines(model) -> tuple[str, ...]:
    """The engines a batch layout times: those the plan weighed, and `inductor_onednn` beside `inductor` where its
    batch package may pay though its trees do not (runtime.onednn_batches_may_pay: float32 targets)."""
    engines = tuple(model.plan.key.get("engines") or planned_engines(model.device, base=model.base))
    if "inductor" in engines and "inductor_onednn" not in engines and onednn_batches_may_pay(model.base):
        engines += ("inductor_onednn",)
    return engines


def _step_ms_at(by_width: dict, width: int) -> float:
    """A step's ms at `width` cached tokens from its timings at BATCH_WIDTHS: linear in the width (attention and
    masks grow with it), extrapolated beyond, never below the cheapest timed."""
    (w0, ms0), (w1, ms1) = sorted((int(w), ms) for w, ms in by_width.items())[:2]
    return max(min(ms0, ms1), ms0 + (ms1 - ms0) * (width - w0) / (w1 - w0))


def lay_out(
    layout: dict, lengths: list[int], max_new_tokens: int, plain: bool = False, acceptance: float = 1.0
) -> tuple[str, bool, str | None, list | None, dict]:
    """How a batch of prompts of `lengths` tokens decodes `max_new_tokens` each, from `_lay_out_batch`'s timings:
    together, rows prefill in groups of like lengths (batch.prefill_groups: each padded to its group's longest) and
    each step attends over the longest prompt and half the new tokens (plainly on whichever engine is fastest at that
    width, with a tree on the layout's engine); one at a time, each row prefills its own ->
    (engine, one row at a time?, proposer, tree, expected tokens/s over all rows per layout); proposer and tree None:
    one sequence's plan. `plain`: for plain decoding. `acceptance`: the share of their guessed part (tau - 1) the
    trees, and one sequence's plan, are expected to keep (ObservedAcceptance.share)."""
    rows, longest, new = len(lengths), max(lengths), max(max_new_tokens, 1)
    width = longest + new // 2
    tokens = rows * new

    def rate(prefill_ms: float, steps: float, ms_per_step: float) -> float:
        return 1000 * tokens / (prefill_ms + steps * ms_per_step)

    alone_prefill = layout["alone_prefill_ms_per_token"] * sum(lengths)
    alone_width = sum(lengths) / rows + new // 2  # each row attends over its own prompt: the mean width costs the sum
    together_prefill = sum(  # a lone row prefills as one sequence does
        (layout["alone_prefill_ms_per_token"] if len(group) == 1 else layout["prefill_ms_per_token"] * len(group))
        * max(lengths[b] for b in group)
        for group in prefill_groups(lengths)
    )
    engine = layout["engine"]
    rates = {
        "plain one at a time": rate(alone_prefill, tokens, _step_ms_at(layout["alone_plain_ms"], alone_width)),
        "planned one at a time": rate(
            alone_prefill,
            tokens / (1 + acceptance * (layout["alone_tau"] - 1)),
            _step_ms_at(layout["alone_step_ms"], alone_width),
        ),
    }
    # plain steps together on each engine timed, at this call's width: the fastest at CONTEXT (where the trees were
    # timed) may not be at this one (the inductor engine's package attends slowly over many wide rows)
    for each, by_width in layout["plain_ms"].items():
        rates[f"plain together on {each}"] = rate(together_prefill, new, _step_ms_at(by_width, width))
    plain_engine = max(layout["plain_ms"], key=lambda each: rates[f"plain together on {each}"])
    together = rates[f"plain together on {plain_engine}"]
    if plain:
        alone = rates["plain one at a time"] >= together
        return (layout["alone_plain_engine"] if alone else plain_engine), alone, "plain", None, rates
    best = ("plain", None, together)
    trees = {}
    for tree in layout["trees"]:
        label = f"{tree['proposer']} {len(tree['tree']) + 1} nodes together on {engine}"
        tau = 1 + acceptance * (tree["tau"] - 1)
        rates[label] = rate(together_prefill, new / tau, _step_ms_at(tree["step_ms"], width))
        trees[label] = tree
    # whole steps timed: a tree may lose to plain decoding after all, and guessing must beat it by MIN_GAIN, as in
    # one sequence's plan (Spec-Bench's 12-row fp32 batch took a 4-node tree expected 4.9% ahead: 0.92x plain); trees
    # within TIE_MARGIN of the fastest are a tie, won by the fewest nodes (the tau expected of a larger tree is the
    # less certain, and it is the one lost)
    fastest = max((rates[label] for label in trees), default=0.0)
    tied = [
        label for label in trees if rates[label] > together * MIN_GAIN and rates[label] >= fastest * (1 - TIE_MARGIN)
    ]
    if tied:
        label = min(tied, key=lambda label: (len(trees[label]["tree"]), -rates[label]))
        best = (trees[label]["proposer"], trees[label]["tree"], rates[label])
    if rates["planned one at a time"] >= best[2] * (MIN_GAIN if best[1] is None else 1.0):
        return layout["alone_engine"], True, None, None, rates
    return (engine if best[1] else plain_engine), False, best[0], best[1], rates


def time_alone_prefill(model, engine: str, context: int, repeats: int = 2, seed: int = 0) -> float:
    """Median ms per token of one sequence's prefill of `context` tokens on `engine`."""
    vocab = model.base.get_output_embeddings().weight.shape[0]
    prompt = torch.randint(0, vocab, (1, context), generator=torch.Generator().manual_seed(seed)).to(model.device)
    target, times = engine_for(model.base, engine), []
    for _ in range(repeats + 1):  # the first warms up
        start = time.perf_counter()
        prefill(model.base, prompt, SamplingConfig(), None, model.feature_layers, engine=target, max_length=context + 1)
        sync(model.device)
        times.append(1000 * (time.perf_counter() - start) / context)
    return statistics.median(times[1:])


def time_alone_step(
    model, engine: str, context: int, tokens: int, seed: int = 0, proposer: str = "plain", tree=None
) -> float:
    """Median ms of one step of one sequence's decoding on `engine` with `proposer` and `tree` (no online guard), the
    decode loop as a whole after `context` prompt tokens: decoding 2 x `tokens` new tokens less decoding `tokens`
    (the prefill cancels out) over the steps that took, after a round that warms up."""
    vocab = model.base.get_output_embeddings().weight.shape[0]
    prompt = torch.randint(0, vocab, (1, context), generator=torch.Generator().manual_seed(seed)).to(model.device)
    target, sampling = engine_for(model.base, engine), SamplingConfig()

    def run(new_tokens: int) -> tuple[float, int]:
        start = time.perf_counter()
        out = decode(
            model.base,
            model.make_proposer(proposer, tree, sampling, None, engine=target),  # named: unguarded
            get_rule("greedy"),
            prompt,
            max_new_tokens=new_tokens,
            sampling=sampling,
            stop_ids=set(),
            engine=target,
            feature_layers=model.feature_layers,
        )
        sync(model.device)
        return time.perf_counter() - start, out.stats.steps

    per_step, whole = [], []
    for _ in range(BATCH_REPEATS + 1):  # the first round warms up
        (short, short_steps), (long, long_steps) = run(tokens), run(2 * tokens)
        per_step.append(1000 * (long - short) / max(long_steps - short_steps, 1))
        whole.append(1000 * long / long_steps)
    # a difference of noisy timings can come out at or below zero on a loaded machine (a step costs something):
    # then the longer run's ms per step, its prefill included, an upper bound
    difference = statistics.median(per_step[1:])
    return difference if difference > 0 else statistics.median(whole[1:])


def _calibrate_batch(model, rows: int, engine: str, context: int = CONTEXT, repeats: int = BATCH_REPEATS) -> dict:
    """Expected tokens per second of `rows` rows decoding plainly and with each tree size in BATCH_NODES: the batched
    verify timed at that many rows, each row's propose + accept (and a context layer's read) timed on one
    sequence, the expected tau as the plan's (choose) -> the choice with the most, plain unless one beats it by
    MIN_GAIN."""
    plan, acc = model.plan, model.accuracy
    if acc is None:  # nothing to predict acceptance from: the plan's own choice, as one sequence takes it
        return {
            "proposer": plan.proposer,
            "tree": plan.tree,
            "expected_speedup": None,
            "verify_ms": {},
            "engine": engine,
            "candidates": [],
        }
    proposer = plan.proposer if plan.proposer in ("medusa", "dynamic") else "dynamic"
    order = grow_tree(acc, max(BATCH_NODES))
    sizes = [n for n in BATCH_NODES if n - 1 <= len(order)]
    sampling, eager = SamplingConfig(), engine_for(model.base, "eager")
    vocab = model.base.get_output_embeddings().weight.shape[0]
    prompt = torch.randint(0, vocab, (1, context), generator=torch.Generator().manual_seed(0)).to(model.device)
    with torch.inference_mode():
        state = prefill(
            model.base,
            prompt,
            sampling,
            feature_layers=model.feature_layers,
            engine=eager,
            max_length=context + max(sizes) + 1,
        )
        proposers = {n: model.make_proposer(proposer, [list(p) for p in order[: n - 1]], sampling, None) for n in sizes}
        proposers[1] = model.make_proposer("plain", None, sampling, None)
        per_row = {n: [] for n in proposers}
        for _ in range(repeats + 1):
            for n, built in proposers.items():
                propose_ms, _, accept_ms = time_step(model, eager, built, state, sampling)
                per_row[n].append(propose_ms + accept_ms)
        row_ms = {n: statistics.median(t[1:]) for n, t in per_row.items()}
        read_ms = _context_read_ms(model, state, repeats + 1)
    verify_ms = time_batch_verify(engine_for(model.base, engine), rows, [1, *sizes], context, repeats)
    # per row and step: its share of the batched verify, its own propose + accept (and a context layer's read)
    plain = Option(engine, "plain", 1, 1.0, verify_ms[1] / rows + row_ms[1])
    options = [plain] + [
        Option(
            engine,
            proposer,
            n,
            planned_tau(order, n, acc, proposer, model.decoded_taus),
            verify_ms[n] / rows + row_ms[n] + read_ms,
        )
        for n in sizes
    ]
    best = _fastest(options, plain)
    speedup, nodes = (best.speedup, best.num_nodes) if best.speedup >= MIN_GAIN else (1.0, 1)
    paying = sorted((o for o in options[1:] if o.speedup >= MIN_GAIN), key=lambda o: -o.speedup)
    return {
        "proposer": proposer if nodes > 1 else "plain",
        "tree": [list(p) for p in order[: nodes - 1]],
        "expected_speedup": round(speedup, 3),
        "tau": round(best.tau if nodes > 1 else 1.0, 3),
        "verify_ms": {str(n): round(ms, 3) for n, ms in verify_ms.items()},
        "engine": engine,
        # every tree expected to pay, fastest first: what a layout times as whole steps (_lay_out_batch)
        "candidates": [
            {
                "proposer": proposer,
                "tree": [list(p) for p in order[: o.num_nodes - 1]],
                "tau": round(o.tau, 3),
                "expected_speedup": round(o.speedup, 3),
            }
            for o in paying
        ],
    }
