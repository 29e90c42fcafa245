"""The calibrated plan: choices from synthetic latency curves, the cache and its key, overrides, the online guard."""

import dataclasses
import json
import logging
from types import SimpleNamespace

import pytest
import torch

import medusa.decode
import medusa.dynamic_tree
import medusa.guard
import medusa.model
import medusa.plan
import medusa.precision
import medusa.runtime
from medusa import MedusaModel
from medusa.guard import BACKOFF, PROBE, WINDOW, GuardedProposer
from medusa.plan import (
    ACCEPTANCE_MEMORY,
    ACCEPTANCE_PRIOR,
    ACCURACY_NAME,
    BATCH_LAYOUT_VERSION,
    CONTEXT,
    LONG_CONTEXT,
    MIN_GAIN,
    TIE_MARGIN,
    ObservedAcceptance,
    Plan,
    _step_ms_at,
    decide,
    load_accuracy,
    long_context,
    plan_path,
    save_accuracy,
    verify_curve,
)
from medusa.propose import PlainProposer
from medusa.sampling import SamplingConfig
from medusa.tree import chain
from medusa.tree_builder import grow_tree
from tests.conftest import FAMILIES, make_heads, make_tiny_model, save_tiny_checkpoint

STRONG = [[0.8, 0.1, 0.05], [0.8, 0.1, 0.05], [0.8, 0.1, 0.05], [0.8, 0.1, 0.05]]
WEAK = [[0.1, 0.03, 0.01], [0.05, 0.02, 0.01], [0.03, 0.01, 0.01], [0.02, 0.01, 0.01]]
SIZES = (2, 4, 8, 12)


def curve(verify_ms, propose_ms=0.5, engines=("compiled",)):
    """Synthetic measurements: verify_ms(nodes) for plain decoding and every proposer and size."""
    jobs = {("plain", 1): (0.0, verify_ms(1))}
    for n in SIZES:
        for proposer in ("medusa", "dynamic", "hybrid"):
            jobs[(proposer, n)] = (propose_ms, verify_ms(n))
    return {engine: dict(jobs) for engine in engines}


def test_weak_heads_on_a_steep_curve_decode_plainly():
    """Two tokens cost 1.5x one, and the heads are rarely right: nothing beats plain decoding by MIN_GAIN."""
    plan = decide(curve(lambda n: 10.0 * (1 + 0.5 * (n > 1) + 0.1 * n)), grow_tree(WEAK, 12), WEAK)
    assert plan.proposer == "plain" and plan.tree == []
    assert plan.expected_speedup == pytest.approx(1.0)
    assert "beat plain decoding" in plan.reason
    assert all(o["speedup"] < MIN_GAIN for o in plan.options if o["proposer"] != "plain")


def test_a_flat_curve_picks_a_wide_tree():
    """Verifying costs the same at any size (a GPU): the widest tree timed wins."""
    plan = decide(curve(lambda n: 10.0), grow_tree(STRONG, 12), STRONG)
    assert plan.proposer != "plain" and len(plan.tree) + 1 == max(SIZES)
    assert plan.expected_speedup > 2


def test_a_steep_curve_with_strong_heads_picks_a_small_tree():
    plan = decide(curve(lambda n: 10.0 * n**0.6), grow_tree(STRONG, 12), STRONG)
    assert plan.proposer == "dynamic" and len(plan.tree) + 1 < max(SIZES)
    assert plan.plain_ms == pytest.approx(10.0)
    assert plan.step_ms == pytest.approx(0.5 + 10.0 * (len(plan.tree) + 1) ** 0.6)  # propose + verify: the guard's


def test_the_fastest_engine_wins():
    measured = curve(lambda n: 20.0 + n)
    measured.update({"eager": curve(lambda n: 40.0 + n)["compiled"]})
    plan = decide(measured, grow_tree(STRONG, 12), STRONG)
    assert plan.engine == "compiled" and plan.plain_ms == pytest.approx(21.0)


def test_without_an_accuracy_table_the_heads_own_tree_runs_on_the_fastest_engine():
    measured = {"compiled": {("plain", 1): (0.0, 10.0)}, "eager": {("plain", 1): (0.0, 30.0)}}
    plan = decide(measured, [], None)
    assert (plan.engine, plan.proposer, plan.tree) == ("compiled", "medusa", [])
    assert "no accuracy table" in plan.reason


def test_untrained_heads_leave_the_guessing_to_prompt_lookup_on_the_fastest_engine():
    measured = {"compiled": {("plain", 1): (0.0, 10.0)}, "eager": {("plain", 1): (0.0, 30.0)}}
    plan = decide(measured, [], None, heads_trained=False)
    assert (plan.engine, plan.proposer, plan.tree, plan.plain_ms) == ("compiled", "prompt_lookup", [], 10.0)
    assert "untrained" in plan.reason
    with_table = decide(curve(lambda n: 10.0), grow_tree(STRONG, 12), STRONG, heads_trained=False)
    assert with_table.proposer == "prompt_lookup"  # whatever an accuracy table says of other heads


def test_a_drafts_plan_weighs_the_tree_sizes_it_decoded_and_none_else():
    jobs = {
        ("plain", 1): (0.0, 10.0),
        ("eagle3", 2): (1.0, 11.0),
        ("eagle3", 4): (2.0, 12.0),
        ("eagle3", 8): (3.0, 20.0),
    }
    decoded = {"tau": {"eagle3": {"2": 1.5, "4": 2.2, "8": 2.4}}, "nodes": {"eagle3": {"2": 2, "4": 4, "8": 8}}}
    plan = decide({"compiled": jobs}, chain(7), None, decoded, proposer="eagle3")
    # tokens per ms: plain 1/10, 2 nodes 1.5/12, 4 nodes 2.2/14, 8 nodes 2.4/23
    assert (plan.engine, plan.proposer, plan.tree) == ("compiled", "eagle3", chain(3))
    assert plan.expected_speedup == pytest.approx(2.2 / 14 * 10)
    assert plan.latency_ms["compiled"] == {"1": 10.0, "2": 11.0, "4": 12.0, "8": 20.0}
    beyond = {**jobs, ("eagle3", 12): (0.0, 21.0)}  # past the sizes decoded: nothing to expect of it
    plan = decide({"compiled": beyond}, chain(11), None, decoded, proposer="eagle3")
    assert plan.tree == chain(3) and 12 not in [o["num_nodes"] for o in plan.options]
    slow = {("plain", 1): (0.0, 10.0), ("eagle3", 4): (2.0, 30.0)}
    assert decide({"compiled": slow}, chain(3), None, decoded, proposer="eagle3").proposer == "plain"


def test_a_draft_without_decoded_taus_keeps_its_own_proposal_on_the_fastest_engine():
    measured = {"compiled": {("plain", 1): (0.0, 10.0)}, "eager": {("plain", 1): (0.0, 30.0)}}
    plan = decide(measured, [], None, None, proposer="eagle3")
    assert (plan.engine, plan.proposer, plan.tree) == ("compiled", "eagle3", [])
    assert "decoded taus" in plan.reason


@pytest.mark.parametrize("family", FAMILIES)
def test_a_base_without_trained_heads_decodes_exactly_with_planned_prompt_lookup(tmp_path, monkeypatch, family):
    """from_base's plan: prompt lookup on the fastest engine, guarded, its trees sized by their timed cost; alone
    and in a batch, every output is the base's own greedy output. Without a plan, lookup still guesses, its whole
    10-guess lookups taken whole where the output repeats (planned, how many it guesses depends on the timings)."""
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path / "cache"))
    base_dir, _ = save_tiny_checkpoint(tmp_path, family)
    model = MedusaModel.from_base(base_dir, plan="auto")
    assert (model.plan.proposer, model.plan.key["heads"]) == ("prompt_lookup", "untrained")
    assert model.default_engine == model.plan.plain_engine
    prompts = [[3, 4, 5, 6, 3, 4, 5, 6, 3, 4], [7, 8, 9]]
    assert len(model.plan.chain_ms(model.plan.engine, 10)) == 11  # chains timed there: lookup sizes them by it
    alone = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        reference = model.base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
        assert torch.equal(model.generate(ids, max_new_tokens=40), reference)
        alone.append(reference[0, len(prompt) :].tolist())
    ids = torch.tensor([prompts[0], [0] * 7 + prompts[1]])  # left-padded
    mask = torch.tensor([[1] * 10, [0] * 7 + [1] * 3])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=40)
    assert [row[-40:].tolist() for row in out] == alone
    # with no plan: the eager engine, still guessing with lookup (10 guesses a step: no timing decides fewer)
    unplanned = MedusaModel.from_base(base_dir, plan="off")
    out = unplanned.generate(torch.tensor([prompts[0]]), max_new_tokens=40, return_dict_in_generate=True)
    deepest_heads = model.config.num_heads + 1  # only lookup's chain of 10 accepts more than the heads can guess
    assert out.sequences[0, 10:].tolist() == alone[0] and max(out.stats.accepted_lengths) > deepest_heads


def test_auto_dtype_is_bf16_only_with_native_support(tmp_path, monkeypatch):
    base_dir, heads_dir = save_tiny_checkpoint(tmp_path)
    for native, dtype in ((False, torch.float32), (True, torch.bfloat16)):
        monkeypatch.setattr(medusa.precision, "native_bf16", lambda device="cpu", native=native: native)
        model = MedusaModel.from_pretrained(heads_dir, base=base_dir, dtype="auto", plan="off")
        assert model.base.dtype == dtype


def _tiny_with_accuracy(tmp_path, family="llama"):
    base_dir, heads_dir = save_tiny_checkpoint(tmp_path, family)
    save_accuracy(heads_dir, STRONG, source="test")
    return base_dir, heads_dir


def test_plan_is_cached_keyed_and_rebuilt_when_corrupt(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path / "cache"))
    base_dir, heads_dir = _tiny_with_accuracy(tmp_path)
    model = MedusaModel.from_pretrained(heads_dir, base=base_dir, plan="auto")
    path = plan_path(model.plan.key)
    assert path.is_file() and json.loads(path.read_text())["proposer"] == model.plan.proposer
    assert model.plan.key["has_accuracy"] and model.accuracy == STRONG

    again = MedusaModel.from_pretrained(heads_dir, base=base_dir, plan="auto")
    assert again.plan.options == model.plan.options  # read from the cache, not measured again

    path.write_text("{ not json")
    with caplog.at_level(logging.WARNING, logger="medusa.plan"):
        rebuilt = MedusaModel.from_pretrained(heads_dir, base=base_dir, plan="auto")
    assert "unreadable" in caplog.text
    assert json.loads(path.read_text())["key"] == rebuilt.plan.key

    # the key changes with the hardware (another CPU's flags, GPU, threads) and with the heads
    other = dict(model.plan.key, isa=["avx2"])
    assert plan_path(other) != path
    monkeypatch.setattr(medusa.plan, "describe", lambda device: {"cpu": "another", "threads": 64})
    assert plan_path(medusa.plan.plan_key(model, tuple(model.plan.key["engines"]))) != path
    # and with the engines it may choose from (compile=True adds torch.compile's)
    assert model.plan.key["engines"] == ["eager", "compiled"]
    assert medusa.plan.plan_key(model, ("eager", "compiled", "inductor")) != model.plan.key
    with torch.no_grad():
        model.heads.blocks[0][0].linear.bias.add_(1.0)
    assert medusa.plan.heads_fingerprint(model) != model.plan.key["heads"]
    # and with the taus decoded beside the accuracy table, which travel with the heads
    model.decoded_taus = decoded_taus({"dynamic": {4: 2.0}})
    assert (
        medusa.plan.plan_key(model, tuple(model.plan.key["engines"]))["decoded_taus"] != model.plan.key["decoded_taus"]
    )
    model.save_pretrained(tmp_path / "saved")
    assert load_accuracy(tmp_path / "saved") == (STRONG, model.decoded_taus)


def test_a_corrupt_accuracy_table_is_named(tmp_path):
    (tmp_path / ACCURACY_NAME).write_text('{"acc_given_prefix": [[1.5]]}')
    with pytest.raises(ValueError, match="not a valid accuracy table"):
        load_accuracy(tmp_path)
    for bad in ({"tau": {"eagle": {}}, "nodes": {}}, {"tau": {"dynamic": {"4": 0.5}}, "nodes": {}}, {"tau": {}}):
        (tmp_path / ACCURACY_NAME).write_text(json.dumps({"acc_given_prefix": STRONG, "decoded": bad}))
        with pytest.raises(ValueError, match="not a valid accuracy table"):
            load_accuracy(tmp_path)


def decoded_taus(tau: dict, nodes: dict | None = None) -> dict:
    """A decoded table: {proposer: {nodes: tau}}; static and dynamic trees verify their own nodes."""
    sizes = {str(n): float(n) for n in SIZES}
    return {
        "tau": {p: {str(n): v for n, v in by.items()} for p, by in tau.items()},
        "nodes": {
            "medusa": sizes,
            "dynamic": sizes,
            **{p: {str(n): v for n, v in by.items()} for p, by in (nodes or {}).items()},
        },
        "source": "test",
    }


def test_decoded_taus_replace_the_accuracy_model_and_round_trip(tmp_path):
    """Taus decoded on held-out prompts decide where the table's model would not: here the model's best is not the
    one that decoded best."""
    measured, order = curve(lambda n: 10.0 * n**0.2), grow_tree(STRONG, 12)
    modelled = decide(measured, order, STRONG)
    wanted = 4 if len(modelled.tree) + 1 != 4 else 8
    low = {n: 1.2 for n in SIZES if n > 2}  # size 2 not decoded: the model's tau there
    decoded = decoded_taus({"medusa": low, "hybrid": low, "dynamic": {**low, wanted: 2.2}})
    plan = decide(measured, order, STRONG, decoded)
    assert (plan.proposer, len(plan.tree) + 1) == ("dynamic", wanted)
    assert plan.expected_speedup == pytest.approx(2.2 / (0.5 + 10.0 * wanted**0.2) * 10.0)
    taus = {(o["proposer"], o["num_nodes"]): o["tau"] for o in plan.options}
    assert taus["dynamic", wanted] == 2.2 and taus["medusa", 4] == 1.2
    assert taus["medusa", 2] == pytest.approx(medusa.plan.planned_tau(order, 2, STRONG, "medusa"))
    # a size between two decoded: linear between them; beyond the decoded ones, the model's
    between = decoded_taus({"dynamic": {2: 1.6, 4: 2.4}})
    assert medusa.plan.planned_tau(order, 3, STRONG, "dynamic", between) == pytest.approx(2.0)
    assert medusa.plan.planned_tau(order, 6, STRONG, "dynamic", between) == medusa.plan.planned_tau(
        order, 6, STRONG, "dynamic"
    )
    save_accuracy(tmp_path, STRONG, source="test", decoded=decoded)
    assert load_accuracy(tmp_path) == (STRONG, decoded)
    save_accuracy(tmp_path, STRONG)  # a new table: taus grown from the old one go
    assert load_accuracy(tmp_path) == (STRONG, None)


def test_hybrid_is_costed_at_the_nodes_it_verified_where_decoded():
    """Without decoded nodes a hybrid is costed as if its whole chain ran every step; with them, at their mean."""
    measured, order = curve(lambda n: 10.0 + n), grow_tree(STRONG, 12)
    hybrid = {"hybrid": {n: 3.0 for n in SIZES}}
    costed = {
        "full chain": decide(measured, order, STRONG, decoded_taus(hybrid)),
        "decoded": decide(measured, order, STRONG, decoded_taus(hybrid, {"hybrid": {"4": 6.5}})),
    }
    steps = {
        name: next(o["step_ms"] for o in plan.options if (o["proposer"], o["num_nodes"]) == ("hybrid", 4))
        for name, plan in costed.items()
    }
    assert steps["decoded"] == pytest.approx(0.5 + 10.0 + 6.5)  # interpolated between 4 and 8 nodes
    assert steps["full chain"] == pytest.approx(0.5 + 2 * (10.0 + 4))  # no size timed holds the chain: twice 4
    assert medusa.plan.interpolate({1: 1.0, 4: 4.0, 8: 12.0}, 10) == pytest.approx(16.0)  # the last slope beyond
    assert medusa.plan.interpolate({1: 1.0, 4: 4.0}, 0.5) == 1.0


@pytest.mark.parametrize("family", FAMILIES)
def test_planned_generate_is_exact_and_arguments_override_the_plan(tmp_path, monkeypatch, family):
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path / "cache"))
    base_dir, heads_dir = _tiny_with_accuracy(tmp_path, family)
    model = MedusaModel.from_pretrained(heads_dir, base=base_dir, plan="auto")
    prompt = torch.tensor([[3, 4, 5, 6, 3, 4]])
    reference = model.base.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=30, do_sample=False)
    assert torch.equal(model.generate(prompt, max_new_tokens=30), reference)
    assert model.default_engine == model.plan.engine
    eager = MedusaModel.from_pretrained(heads_dir, base=base_dir, plan="auto", engine="eager")
    assert eager.default_engine == "eager"
    out = eager.generate(prompt, max_new_tokens=30, proposer="medusa", tree=[[0], [0, 0]], return_dict_in_generate=True)
    assert torch.equal(out.sequences, reference) and max(out.stats.proposed_lengths) == 2
    with pytest.raises(ValueError, match="plan must be"):
        MedusaModel.from_pretrained(heads_dir, base=base_dir, plan="yes")


def _long_plan(long_ms: dict) -> Plan:
    """A plan of 6-node dynamic trees on the eager engine, timed at CONTEXT and at LONG_CONTEXT (`long_ms`)."""
    short_ms = {1: 10.0, 2: 10.3, 4: 10.8, 6: 12.0}
    taus = {2: 1.6, 4: 2.3, 6: 2.6}
    options = [dict(engine="eager", proposer="plain", num_nodes=1, tau=1.0, step_ms=10.0, speedup=1.0)] + [
        dict(engine="eager", proposer="dynamic", num_nodes=n, tau=t, step_ms=short_ms[n] + 0.5, speedup=0.0)
        for n, t in taus.items()
    ]
    return Plan(
        engine="eager",
        proposer="dynamic",
        tree=[[0], [1], [0, 0], [0, 1], [0, 0, 0]],
        expected_speedup=2.6 / 12.5 * 10,
        plain_ms=10.0,
        reason="test",
        options=options,
        # the static tree's raw medians (noise put 2 nodes above 4): not what a long call's growth is measured from
        latency_ms={"eager": {"1": 10.0, "2": 12.5, "4": 10.8, "6": 12.0}},
        long_context=LONG_CONTEXT,
        long_latency_ms={str(n): ms for n, ms in long_ms.items()},
        short_latency_ms={str(n): ms for n, ms in short_ms.items()},
    )


def test_a_long_call_takes_the_tree_that_pays_at_its_context():
    """Each query row attends over every cached key, so trees grow dearer with the context than a plain step: past
    CONTEXT a call takes the size expected fastest at its own context, interpolating the two timings."""
    plan = _long_plan({1: 15.0, 2: 18.0, 4: 30.0, 6: 45.0})
    assert plan.at_context(CONTEXT) is None  # the plan's own choice, timed there
    assert f"{LONG_CONTEXT} cached tokens" in plan.describe() and f"{CONTEXT} cached tokens" in plan.describe()
    nodes, step_ms, plain_ms = plan.at_context(LONG_CONTEXT)
    assert nodes == 2 and plain_ms == pytest.approx(15.0) and step_ms == pytest.approx(10.8 + 7.7)
    assert plan.at_context((CONTEXT + LONG_CONTEXT) // 2)[0] == 4
    assert plan.at_context(2 * LONG_CONTEXT)[0] == 2  # extrapolated beyond the long timing
    assert _long_plan({1: 15.0, 2: 30.0, 4: 60.0, 6: 90.0}).at_context(LONG_CONTEXT)[0] == 1  # no tree pays: plain
    flat = _long_plan({1: 11.0, 2: 11.3, 4: 11.8, 6: 13.0})  # attention costs nothing here: the plan's own tree
    assert flat.at_context(LONG_CONTEXT)[0] == 6
    # 6 nodes would pay best here, but a call's cache and guard are sized by the plan's own tree (4): never more
    smaller = dataclasses.replace(_long_plan({1: 11.0, 2: 11.3, 4: 20.0, 6: 13.0}), tree=[[0], [1], [0, 0]])
    assert smaller.at_context(LONG_CONTEXT)[0] == 2
    assert dataclasses.replace(plan, long_latency_ms={}).at_context(LONG_CONTEXT) is None  # not timed: no change
    assert dataclasses.replace(plan, short_latency_ms={}).at_context(LONG_CONTEXT) is None
    assert dataclasses.replace(plan, proposer="medusa").at_context(LONG_CONTEXT) is None  # a static tree keeps its own


def test_a_long_prompt_decodes_the_plans_tree_for_its_context_exactly(monkeypatch):
    """generate sizes the plan's dynamic tree by the call's context (prompt and half the new tokens), and hands the
    guard the steps expected there; an explicit tree or proposer is left as asked. Greedy output stays plain's."""
    model = MedusaModel(make_tiny_model("llama"), make_heads(random=True, condition_on_path=True))
    model.plan = _long_plan({1: 15.0, 2: 18.0, 4: 30.0, 6: 45.0})  # 4 nodes pay best at ~400 cached tokens
    budgets, yardsticks = [], []
    budget = medusa.dynamic_tree.DynamicTreeProposer.budget
    monkeypatch.setattr(
        medusa.dynamic_tree.DynamicTreeProposer, "budget", lambda self, n: budgets.append(n) or budget(self, n)
    )
    propose = GuardedProposer.propose
    monkeypatch.setattr(
        GuardedProposer,
        "propose",
        lambda self, s: yardsticks.append((self.plain_ms, self.expected_step_ms)) or propose(self, s),
    )
    short = torch.tensor([[3, 4, 5, 6, 3, 4]])
    long = torch.randint(3, 60, (1, 396), generator=torch.Generator().manual_seed(0))
    for prompt in (short, long):
        reference = model.base.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8)
        yardsticks.clear()
        assert torch.equal(model.generate(prompt, max_new_tokens=8, do_sample=False), reference)
    assert budgets == [4]  # the long prompt alone: 400 cached tokens
    share = (400 - CONTEXT) / (LONG_CONTEXT - CONTEXT)
    plain_ms, step_ms = yardsticks[0]
    assert plain_ms == pytest.approx(10.0 + 5.0 * share) and step_ms == pytest.approx(11.3 + 19.2 * share)
    budgets.clear()
    model.generate(long, max_new_tokens=8, tree=[[0], [0, 0]])
    model.generate(long, max_new_tokens=8, proposer="dynamic")
    assert budgets == []


def test_a_long_calls_growth_is_measured_from_like_timings(monkeypatch):
    """calibrate keeps the fitted verify curve of plain steps and dynamic trees at both contexts (the same jobs, the
    same fit), not the static tree's raw medians on one side: noise that put a size's median out of order at CONTEXT
    must not read as growth."""
    model = SimpleNamespace(
        base=make_tiny_model("llama"), device=torch.device("cpu"), accuracy=[[0.9] * 4] * 3, decoded_taus=None
    )
    model.base.config.max_position_embeddings = 8192
    model.heads_trained = True
    short = {("plain", 1): (0.0, 10.0), ("medusa", 2): (0.5, 13.0), ("medusa", 4): (0.5, 11.0)}
    short |= {("dynamic", 2): (0.5, 11.2), ("dynamic", 4): (0.5, 11.0), ("hybrid", 2): (0.6, 30.0)}
    long = {("plain", 1): (0.0, 14.0), ("dynamic", 2): (0.5, 16.0), ("dynamic", 4): (0.5, 19.0)}
    contexts = []

    def measure(model, engines, sizes, repeats, context=CONTEXT, progress=True, proposers=None):
        contexts.append(context)
        return {"eager": dict(short if context == CONTEXT else long)}, [[0], [0, 0], [0, 0, 0]]

    monkeypatch.setattr(medusa.plan, "measure", measure)
    monkeypatch.setattr(medusa.plan, "decide", lambda *a, **k: _long_plan({1: 1.0}))  # a plan of dynamic trees
    plan = medusa.plan.calibrate(model, engines=("eager",), sizes=(1, 2, 4), progress=False, key={"test": 1})
    assert contexts == [CONTEXT, LONG_CONTEXT]
    # 2 and 4 nodes' dynamic medians out of order: pooled, as the long side's fit pools its own
    assert plan.short_latency_ms == {"1": 10.0, "2": 11.1, "4": 11.1}
    assert plan.long_latency_ms == {"1": 14.0, "2": 16.0, "4": 19.0}


def test_long_timings_are_taken_where_the_positions_reach():
    model = SimpleNamespace(base=make_tiny_model("llama"))  # 512 positions
    assert long_context(model) is None
    model.base.config.max_position_embeddings = 8192
    assert long_context(model) == LONG_CONTEXT


def _guarded(plain_ms, family="llama", context=False):
    if context:
        from tests.conftest import context_heads

        heads = context_heads()
    else:
        heads = make_heads(random=True, condition_on_path=True)
    model = MedusaModel(make_tiny_model(family), heads, projection_dtype=torch.float32)
    model.plan = Plan(
        engine="eager",
        proposer="medusa",
        tree=[[0], [1], [0, 0], [0, 0, 0]],
        expected_speedup=1.5,
        plain_ms=plain_ms,
        reason="test",
    )
    return model


@pytest.mark.parametrize("context", [False, True], ids=["path-heads", "context-layer"])
def test_guard_falls_back_to_plain_decoding_when_guessing_loses_and_stays_exact(context):
    model = _guarded(plain_ms=1e-6, context=context)  # no step can beat a plain step this cheap
    prompt = torch.tensor([[3, 4, 5, 6, 7]])
    reference = model.base.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=80, do_sample=False)
    out = model.generate(prompt, max_new_tokens=80, return_dict_in_generate=True)
    assert torch.equal(out.sequences, reference)
    depths = out.stats.proposed_lengths
    guessed = 1 + WINDOW  # the untimed first step and one window of guessing, then plain steps (depth 0), a retry
    assert depths[:guessed] == [3] * guessed
    assert depths[guessed : guessed + BACKOFF] == [0] * BACKOFF and 3 in depths[guessed + BACKOFF :]


def test_guard_leaves_the_first_step_untimed(monkeypatch):
    """The first step also feeds the prompt to a context layer: however slow, it alone must not end guessing."""
    times = iter([0.0, 5.0] + [t for step in range(1, 40) for t in (step * 10.0, step * 10.0 + 0.002)])
    monkeypatch.setattr(medusa.guard.time, "perf_counter", lambda: next(times))
    proposer = SimpleNamespace(max_nodes=2, propose=lambda state: "guess", observe=lambda state, tokens: None)
    guard = GuardedProposer(proposer, plain_step_ms=10.0, device="cpu")  # guessing: 2 ms a token, then 5 s once
    for _ in range(1 + 3 * WINDOW):
        assert guard.propose(None) == "guess"
        guard.observe(None, [1])
    assert guard.fallbacks == 0


def _drive_guard(monkeypatch, step_ms: float, tokens: int, steps: int, **guard_options) -> GuardedProposer:
    """A guard over a proposer whose every step takes `step_ms` and commits `tokens`, on a fake clock."""
    times = iter([t for step in range(steps) for t in (step * 10.0, step * 10.0 + step_ms / 1000)])
    monkeypatch.setattr(medusa.guard.time, "perf_counter", lambda: next(times))
    proposer = SimpleNamespace(max_nodes=2, propose=lambda state: "guess", observe=lambda state, tokens: None)
    guard = GuardedProposer(proposer, device="cpu", **guard_options)
    for _ in range(steps):
        if guard.propose(None) != "guess":
            break
        guard.observe(None, [1] * tokens)
    return guard


@pytest.mark.parametrize("tokens, falls_back", [(2, False), (1, True)])
def test_guard_scales_the_plans_yardstick_by_this_calls_steps(monkeypatch, tokens, falls_back):
    """Steps twice as slow as calibrated (a larger cache, a busier machine) slow plain steps too: guessing at the
    plan's ratio (an 18 ms step for 2 tokens against a 10 ms plain step) is not judged against the calibrated 10
    ms, while guessing that commits one token a step still loses."""
    guard = _drive_guard(
        monkeypatch, step_ms=36.0, tokens=tokens, steps=1 + WINDOW, plain_step_ms=10.0, expected_step_ms=18.0
    )
    assert (guard.fallbacks == 1) is falls_back


def _drive_two_speeds(monkeypatch, guess_ms: float, plain_ms: float, steps: int, **guard_options):
    """A guard over a proposer whose guessing steps take `guess_ms` and commit 2 tokens, while plain steps take
    `plain_ms`, on a fake clock -> (guard, 'g'/'p' per step)."""
    clock = [0.0]
    monkeypatch.setattr(medusa.guard.time, "perf_counter", lambda: clock[0])
    proposer = SimpleNamespace(max_nodes=2, propose=lambda state: "guess", observe=lambda state, tokens: None)
    guard = GuardedProposer(proposer, device="cpu", **guard_options)
    kinds, state = [], SimpleNamespace(root_token=torch.tensor(1))
    for _ in range(steps):
        guessing = guard.propose(state) == "guess"
        clock[0] += (guess_ms if guessing else plain_ms) / 1000
        guard.observe(state, [1, 2] if guessing else [1])
        kinds.append("g" if guessing else "p")
    return guard, "".join(kinds)


@pytest.mark.parametrize("real_plain_ms, loses", [(9.0, True), (12.0, False)])
def test_a_close_window_is_judged_on_plain_steps_timed_in_the_call(monkeypatch, real_plain_ms, loses):
    """11 ms a token against the plan's 10 ms plain step is too close to call on a figure measured at another moment
    (on the AVX2 CPU a plan's plain step came out 58 ms where plain decoding then ran at 41): the guard times PROBE
    plain steps, and the window wins or loses against those."""
    steps = 1 + WINDOW + PROBE + BACKOFF
    guard, kinds = _drive_two_speeds(monkeypatch, 22.0, real_plain_ms, steps, plain_step_ms=10.0)
    probed = 1 + WINDOW + PROBE
    assert kinds[:probed] == "g" * (1 + WINDOW) + "p" * PROBE
    assert guard.plain_ms == pytest.approx(real_plain_ms) and guard.fallbacks == int(loses)
    assert kinds[probed:] == ("p" * BACKOFF if loses else "g" * BACKOFF)


@pytest.mark.parametrize("guess_ms, fallbacks", [(14.0, 0), (32.0, 1)])
def test_a_clear_window_needs_no_probe(monkeypatch, guess_ms, fallbacks):
    """7 ms a token against a 10 ms plain step wins as it is; 16 ms loses at once (its plain steps are timed then)."""
    guard, kinds = _drive_two_speeds(monkeypatch, guess_ms, 1.0, 1 + WINDOW + 1, plain_step_ms=10.0)
    assert guard.fallbacks == fallbacks and kinds[-1] == "gp"[fallbacks]


@pytest.mark.parametrize("guess_ms, loses", [(23.0, False), (26.0, True)])
def test_a_window_loses_only_past_the_margin(monkeypatch, guess_ms, loses):
    """One window's tau is noisy: 11.5 ms a token against 10 ms plain steps (timed in the call) is within LOSS_MARGIN
    and guessing goes on; 13 ms is past it."""
    assert medusa.guard.LOSS_MARGIN == pytest.approx(0.2)
    steps = 1 + WINDOW + PROBE + BACKOFF
    guard, kinds = _drive_two_speeds(monkeypatch, guess_ms, 10.0, steps, plain_step_ms=10.0)
    assert kinds[: 1 + WINDOW + PROBE] == "g" * (1 + WINDOW) + "p" * PROBE  # too close to call on the plan's figure
    assert guard.fallbacks == int(loses) and kinds[1 + WINDOW + PROBE :] == ("p" if loses else "g") * BACKOFF


def test_guard_keeps_guessing_while_it_pays():
    model = _guarded(plain_ms=1e9)
    out = model.generate(torch.tensor([[3, 4, 5, 6, 7]]), max_new_tokens=60, return_dict_in_generate=True)
    assert 0 not in out.stats.proposed_lengths


def test_an_explicit_proposer_is_not_guarded():
    model = _guarded(plain_ms=1e-6)
    out = model.generate(
        torch.tensor([[3, 4, 5, 6, 7]]), max_new_tokens=60, proposer="medusa", return_dict_in_generate=True
    )
    assert 0 not in out.stats.proposed_lengths


@pytest.mark.parametrize("context", [False, True], ids=["no-context", "context-layer"])
def test_calibration_costs_the_context_layers_read_of_each_step(monkeypatch, context):
    """A timed step never moves its state on, so a context layer reads nothing in it; in decoding it reads each
    step's new positions. measure adds that read to every guessing option, not to plain decoding."""
    model = _guarded(plain_ms=1.0, context=context)
    model.plan, model.accuracy = None, STRONG
    read_ms = medusa.plan._context_read_ms(
        model, medusa.decode.prefill(model.base, torch.tensor([[3, 4, 5, 6, 7]]), SamplingConfig()), 3
    )
    assert (read_ms > 0) is context
    monkeypatch.setattr(medusa.plan, "_context_read_ms", lambda *args: 1000.0)
    measured, _ = medusa.plan.measure(model, ["eager"], sizes=(1, 2), repeats=1, context=8, progress=False)
    assert measured["eager"][("plain", 1)][0] < 1000.0
    assert all(1000.0 < propose_ms < 2000.0 for job, (propose_ms, _) in measured["eager"].items() if job[0] != "plain")


def test_a_busy_spell_while_timing_leaves_out_the_engines_it_slows_alike(monkeypatch):
    """Engines' plain steps are timed in turn: a spell of load in the second half of the timing (steps 3x as slow)
    slows every engine's steps alike, so the engine that is faster (here compiled, 5 ms against eager's 10) stays
    in the plan. Timed one engine after the other, the spell fell on the compiled engine alone and left it out."""
    model = _guarded(plain_ms=1.0)
    model.plan, model.accuracy = None, None
    calls = []

    def time_step(model, engine, proposer, state, sampling):
        calls.append(engine.name)
        busy = 3.0 if len(calls) > 6 else 1.0
        return 0.0, {"eager": 10.0, "compiled": 5.0}[engine.name] * busy, 0.0

    monkeypatch.setattr(medusa.plan, "time_step", time_step)
    measured, _ = medusa.plan.measure(model, ["eager", "compiled"], sizes=(1,), repeats=5, context=8, progress=False)
    assert list(measured) == ["compiled"]
    assert calls[:4] == ["eager", "compiled", "eager", "compiled"]


def test_planned_engines_leave_out_what_adds_nothing_or_is_switched_off(monkeypatch):
    """On a GPU the compiled engine is torch.compile already; $MEDUSA_COMPILE=0 leaves torch.compile out on CPU."""
    monkeypatch.delenv("MEDUSA_COMPILE", raising=False)
    assert medusa.plan.planned_engines("cpu") == ("eager", "compiled", "inductor")
    assert "inductor" not in medusa.plan.planned_engines("cuda")
    monkeypatch.setenv("MEDUSA_COMPILE", "0")
    assert medusa.plan.planned_engines("cpu") == ("eager", "compiled")


def test_trees_on_onednn_are_timed_for_bf16_targets_on_a_cpu_with_native_bf16_and_no_amx(monkeypatch):
    """Only there can the engine whose trees run oneDNN's GEMMs win (inductor's template widens bf16 to fp32 and
    pays each row's arithmetic); elsewhere its package would be compiled for nothing."""
    import medusa.runtime.inductor as inductor

    monkeypatch.delenv("MEDUSA_COMPILE", raising=False)
    monkeypatch.setattr(inductor, "native_bf16", lambda device: True)
    monkeypatch.setattr(inductor, "amx", lambda device: False)
    bf16, fp32 = make_tiny_model("llama", dtype=torch.bfloat16), make_tiny_model("llama")
    assert medusa.plan.planned_engines("cpu", base=bf16) == ("eager", "compiled", "inductor", "inductor_onednn")
    assert "inductor_onednn" not in medusa.plan.planned_engines("cpu", base=fp32)
    assert "inductor_onednn" not in medusa.plan.planned_engines("cpu", compile=False, base=bf16)
    monkeypatch.setattr(inductor, "amx", lambda device: True)  # the template multiplies on AMX's tiles
    assert "inductor_onednn" not in medusa.plan.planned_engines("cpu", base=bf16)
    monkeypatch.setattr(inductor, "amx", lambda device: False)
    monkeypatch.setattr(inductor, "native_bf16", lambda device: False)  # bf16 emulated: refused anyway
    assert "inductor_onednn" not in medusa.plan.planned_engines("cpu", base=bf16)


def test_float32_batches_are_timed_on_aten_gemms_beside_the_template_where_the_plan_compiles():
    """A float32 batch of many rows is a GEMM of many rows, where aten's float32 GEMM may outrun inductor's template:
    its layouts time `inductor_onednn` too, though the plan's single sequences do not; never where the plan compiles
    nothing, nor for weights that are not plain (an int8 target's)."""
    from medusa.runtime import quantize_target

    fp32 = make_tiny_model("llama")
    layout = lambda engines, base: SimpleNamespace(  # noqa: E731
        plan=SimpleNamespace(key={"engines": engines}), device=base.device, base=base
    )
    assert "inductor_onednn" not in medusa.plan.planned_engines("cpu", base=fp32)
    assert medusa.plan._batch_engines(layout(["eager", "compiled", "inductor"], fp32)) == (
        "eager",
        "compiled",
        "inductor",
        "inductor_onednn",
    )
    assert medusa.plan._batch_engines(layout(["eager", "compiled"], fp32)) == ("eager", "compiled")
    int8 = quantize_target(make_tiny_model("llama"), "int8")
    assert "inductor_onednn" not in medusa.plan._batch_engines(layout(["eager", "compiled", "inductor"], int8))


def test_the_plain_yardstick_is_the_fastest_plain_engine():
    """A plan on a faster plain engine than the one it speculates on reports that engine as the yardstick."""
    measured = curve(lambda n: 10.0 + n, engines=("compiled",))
    measured["inductor"] = {job: (p, v / 2) for job, (p, v) in measured["compiled"].items()}
    plan = decide(measured, grow_tree(STRONG, 12), STRONG)
    assert plan.plain_engine == "inductor" and plan.plain_ms == pytest.approx(5.5)
    # trees on oneDNN: its one-token steps are inductor's package, so a plain step timed a little faster there by
    # chance still names inductor
    measured["inductor_onednn"] = {job: (p, v / 2 - 0.1) for job, (p, v) in measured["compiled"].items()}
    plan = decide(measured, grow_tree(STRONG, 12), STRONG)
    assert plan.engine == "inductor_onednn" and plan.plain_engine == "inductor"
    assert plan.plain_ms == pytest.approx(5.5)  # the guard's yardstick is inductor's step too


def test_a_near_tie_goes_to_the_most_expected_tokens_per_step():
    """4 nodes expected 2.6% slower than 2 (within the noise of two calibrations): the plan takes 4, whose extra
    tokens per step timing noise does not move; 4 nodes clearly slower stay unchosen."""
    for verify_4, nodes in ((16.0, 4), (17.0, 2)):
        measured = curve(lambda n, v=verify_4: {1: 10.0, 2: 10.0, 4: v, 8: 40.0, 12: 60.0}[n])
        plan = decide(measured, grow_tree(STRONG, 12), STRONG)
        fastest = max(o["speedup"] for o in plan.options)
        assert (plan.proposer, len(plan.tree) + 1) == ("dynamic", nodes)
        assert plan.expected_speedup >= fastest * (1 - TIE_MARGIN)
    assert plan.expected_speedup == pytest.approx(fastest)


def test_the_verify_curve_never_falls():
    """A larger tree measured cheaper than a smaller one is noise: both get their pooled mean; the rest stand."""
    jobs = {("plain", 1): (0.0, 10.0), ("medusa", 2): (0.5, 13.0), ("dynamic", 2): (0.5, 13.0)}
    jobs |= {("medusa", 4): (0.5, 11.0), ("dynamic", 4): (0.5, 11.0), ("medusa", 8): (0.5, 20.0)}
    jobs[("hybrid", 2)] = (0.5, 99.0)  # verifies its chain too: not a 2-node forward
    assert verify_curve(jobs) == {1: 10.0, 2: 12.0, 4: 12.0, 8: 20.0}
    increasing = {("plain", 1): (0.0, 10.0), ("medusa", 2): (0.5, 11.0), ("medusa", 4): (0.5, 12.0)}
    assert verify_curve(increasing) == {1: 10.0, 2: 11.0, 4: 12.0}


def _batch_choice_with(monkeypatch, model, verify_ms):
    """batch_choice over a synthetic batched verify curve (`verify_ms(rows, nodes)`) and fixed per-row costs;
    -> (the choice, how many times the curve was timed)."""
    timed = []

    def fake_verify(base, rows, nodes, context, repeats):
        timed.append(rows)
        return {n: verify_ms(rows, n) for n in nodes}

    monkeypatch.setattr(medusa.plan, "time_batch_verify", fake_verify)
    monkeypatch.setattr(medusa.plan, "time_step", lambda *args: (0.1, 1.0, 0.05))
    return timed


def test_a_batch_takes_the_tree_its_rows_can_afford(tmp_path, monkeypatch):
    """Each batch size bucket is timed once, its choice kept in the plan's file: a verify whose cost grows with
    rows x nodes beyond a few tokens takes a smaller tree as rows grow, and plain decoding where no tree pays."""
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path / "cache"))
    base_dir, heads_dir = _tiny_with_accuracy(tmp_path)
    model = MedusaModel.from_pretrained(heads_dir, base=base_dir, plan="auto")
    timed = _batch_choice_with(monkeypatch, model, lambda rows, n: 10.0 * max(1.0, rows * n / 8))
    engine, other = "compiled", "eager"
    small, large = medusa.plan.batch_choice(model, 2, engine=engine), medusa.plan.batch_choice(model, 16, engine=engine)
    assert small["proposer"] != "plain" and len(small["tree"]) + 1 == 4  # 8 tokens verify at the price of one
    assert large["proposer"] == "plain" and large["tree"] == []  # 16 rows: every tree costs more than it accepts
    speedups = [c["expected_speedup"] for c in small["candidates"]]  # what a layout times: those that pay, best first
    assert speedups == sorted(speedups, reverse=True) and min(speedups) >= MIN_GAIN and large["candidates"] == []
    assert medusa.plan.batch_choice(model, 12, engine=engine) == large and timed == [2, 16]  # the 16 bucket, once
    saved = json.loads(plan_path(model.plan.key).read_text())["batches"]
    assert saved[f"2 on {engine}"] == small and saved[f"16 on {engine}"] == large
    again = MedusaModel.from_pretrained(heads_dir, base=base_dir, plan="auto")
    assert medusa.plan.batch_choice(again, 2, engine=engine) == small and timed == [2, 16]  # read back, not timed
    assert medusa.plan.batch_choice(again, 2, engine=other)["engine"] == other and timed == [2, 16, 2]  # timed there
    assert medusa.plan.batch_choice(again, 2, engine=engine) == small
    assert medusa.plan.batch_choice(again, 2, engine=other)
    assert timed == [2, 16, 2]  # each kept under its own engine
    again.plan.batches[f"2 on {engine}"]["version"] = BATCH_LAYOUT_VERSION - 1  # kept from an older layout
    assert medusa.plan.batch_choice(again, 2, engine=engine)["candidates"] and timed == [2, 16, 2, 2]


def test_a_server_times_every_batch_layout_it_may_ask_for_before_any_request(monkeypatch):
    """calibrate_batches asks the plan, for each bucket up to the one holding `most_rows`, for the layout with no
    engine named and for the choice on each engine that layout weighs (what continuous batching asks as rows join
    and leave); nothing for one row at a time or a model without a plan."""
    asked = []

    def batch_choice(model, rows, progress=True, engine=None):
        asked.append((rows, engine))
        return {"plain_ms": {"eager": {}, "inductor": {}}} if engine is None else {}

    monkeypatch.setattr(medusa.plan, "batch_choice", batch_choice)
    planned = SimpleNamespace(plan=object())
    medusa.plan.calibrate_batches(planned, 3)
    assert asked == [(rows, engine) for rows in (2, 4) for engine in (None, "eager", "inductor")]
    asked.clear()
    medusa.plan.calibrate_batches(planned, 64)  # beyond the largest bucket: every bucket
    assert [rows for rows, engine in asked if engine is None] == list(medusa.plan.BATCH_BUCKETS)
    asked.clear()
    medusa.plan.calibrate_batches(planned, 1)
    medusa.plan.calibrate_batches(SimpleNamespace(plan=None), 16)
    assert asked == []


def test_a_flat_batched_curve_keeps_the_largest_tree(tmp_path, monkeypatch):
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path / "cache"))
    base_dir, heads_dir = _tiny_with_accuracy(tmp_path)
    model = MedusaModel.from_pretrained(heads_dir, base=base_dir, plan="auto")
    _batch_choice_with(monkeypatch, model, lambda rows, n: 10.0)
    choice = medusa.plan.batch_choice(model, 4, engine="eager")
    assert len(choice["tree"]) + 1 == max(medusa.plan.BATCH_NODES) and choice["expected_speedup"] > MIN_GAIN


@pytest.mark.parametrize("family", FAMILIES)
def test_a_planned_batch_decodes_each_row_as_alone(tmp_path, monkeypatch, family):
    """A batch under the plan runs the plan's batch choice (here: timed for real on the tiny model) and every row
    is what plain greedy decoding of that prompt alone gives."""
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path / "cache"))
    base_dir, heads_dir = _tiny_with_accuracy(tmp_path, family)
    model = MedusaModel.from_pretrained(heads_dir, base=base_dir, plan="auto")
    prompts = [[3, 4, 5, 6, 3, 4], [7, 8, 9]]
    ids = torch.tensor([prompts[0], [0] * 3 + prompts[1]])  # left-padded
    mask = torch.tensor([[1] * 6, [0] * 3 + [1] * 3])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=20, return_dict_in_generate=True)
    layout = model.plan.batches["2 on the fastest layout"]
    assert set(layout["plain_ms"]) == set(model.plan.key["engines"])
    assert min(layout["alone_plain_ms"].values()) > 0 and min(layout["alone_step_ms"].values()) > 0
    for row, prompt in zip(out.sequences, prompts):
        alone = torch.tensor([prompt])
        reference = model.base.generate(
            alone, attention_mask=torch.ones_like(alone), max_new_tokens=20, do_sample=False
        )
        assert row[-20:].tolist() == reference[0, len(prompt) :].tolist()


def _layout_with(
    monkeypatch, model, batch_ms, alone_ms: float, tree_ms=None, prefill_ms=(0.0, 0.0), planned_ms: float | None = None
):
    """batch_choice's layout over synthetic whole-step timings: a batched plain step of `batch_ms(engine, width)` ms
    (a tree's: `tree_ms(width, nodes)`, else the same), one sequence's plain step of `alone_ms` (its plan's:
    `planned_ms`, else the same), a flat batched verify (so a batch's trees are expected to pay), prefills of
    `prefill_ms` ms per token (together, alone)."""
    _batch_choice_with(monkeypatch, model, lambda rows, n: 10.0)

    def alone_step(model, engine, context, steps, seed=0, proposer="plain", tree=None):
        return alone_ms if proposer == "plain" or planned_ms is None else planned_ms

    def batch_step(target, make_proposer, rows, context, steps, feature_layers):
        engine = target.name
        proposer = make_proposer()
        plain = isinstance(proposer, PlainProposer)
        return batch_ms(engine, context) if plain or tree_ms is None else tree_ms(context, proposer.max_nodes)

    monkeypatch.setattr(medusa.plan, "time_batch_step", batch_step)
    monkeypatch.setattr(medusa.plan, "time_alone_step", alone_step)
    monkeypatch.setattr(medusa.plan, "time_batch_prefill", lambda *args: prefill_ms[0])
    monkeypatch.setattr(medusa.plan, "time_alone_prefill", lambda *args: prefill_ms[1])


def _plan_expecting(model, tau: float) -> None:
    """One sequence's plan: the heads' two-node tree on its engine, expected to commit `tau` tokens a step."""
    plan = model.plan
    plan.proposer, plan.tree = "medusa", [[0]]
    option = dict(engine=plan.engine, proposer="medusa", num_nodes=2, tau=tau, step_ms=1.0, speedup=tau)
    plan.options = [option, *plan.options]


def _at(width: int, rows: int) -> tuple[list[int], int]:
    """lay_out's arguments for `rows` prompts whose steps attend over `width` tokens (2 new tokens each)."""
    return [width - 1] * rows, 2


def test_a_batch_layout_prices_a_row_that_prefills_alone_as_one_sequences_prefill():
    """A batch's prompt of batch.ALONE_FROM tokens or more prefills alone, as one sequence's does: lay_out prices it at
    one sequence's prefill per token, the short rows' group at the batch's."""
    flat = {"256": 10.0, "768": 10.0}
    layout = dict(
        engine="compiled",
        alone_engine="inductor",
        alone_plain_engine="inductor",
        prefill_ms_per_token=1.0,
        alone_prefill_ms_per_token=3.0,
        plain_ms={"compiled": flat},
        alone_plain_ms=flat,
        alone_step_ms=flat,
        alone_tau=1.0,
        trees=[],
    )
    rates = medusa.plan.lay_out(layout, [600, 10, 10, 10], 2, plain=True)[4]
    assert rates["plain together on compiled"] == pytest.approx(1000 * 8 / (3.0 * 600 + 1.0 * 3 * 10 + 2 * 10.0))


def test_a_batch_decodes_its_rows_one_at_a_time_where_that_is_faster(tmp_path, monkeypatch):
    """With no engine named, the plan weighs decoding a batch together on each batch engine (at the batch's width:
    every row attends over its longest prompt) against decoding its rows one at a time as it decodes one sequence;
    the slower layouts lose, for speculation and for plain decoding alike, and rows decoded one at a time come back
    as a batch does (left-padded, exact)."""
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path / "cache"))
    base_dir, heads_dir = _tiny_with_accuracy(tmp_path)
    model = MedusaModel.from_pretrained(heads_dir, base=base_dir, plan="auto")
    _plan_expecting(model, 2.0)  # one sequence's plan: twice its plain decoding (its steps cost plain ones')
    lay_out = medusa.plan.lay_out
    # 4 rows: a batched plain step of 40 ms at 256 tokens is 100 tok/s, 160 ms at 1024 is 25; one sequence's plain
    # 20 ms is 50 tok/s, planned 100
    _layout_with(monkeypatch, model, lambda engine, width: (1 if engine == "eager" else 2) * width * 40 / 256, 20.0)
    layout = medusa.plan.batch_choice(model, 4)
    engine, alone, proposer, tree, rates = lay_out(layout, *_at(256, 4))
    assert (engine, alone) == ("eager", False) and proposer != "plain" and tree  # its tree (flat verify) pays
    assert rates["plain together on eager"] == 100.0 and rates["plain one at a time"] == 50.0
    assert lay_out(layout, *_at(256, 4), plain=True)[:4] == ("eager", False, "plain", None)
    wide = lay_out(layout, *_at(1024, 4))
    assert wide[:4] == (model.plan.engine, True, None, None) and wide[4]["plain together on eager"] == 25.0
    assert lay_out(layout, *_at(640, 4), plain=True)[:2] == (
        model.plan.plain_engine,
        True,
    )  # 100 ms: 40 tok/s against 50
    saved = json.loads(plan_path(model.plan.key).read_text())["batches"]
    assert saved["4 on the fastest layout"] == layout
    # a layout kept from before an engine the plan weighs took batches is timed again, with it; and one kept from
    # before a layout timed several trees, or the plan's own steps, or rows proposing together (an older version)
    model.plan.batches["4 on the fastest layout"] = dict(layout, plain_ms={"eager": layout["plain_ms"]["eager"]})
    assert medusa.plan.batch_choice(model, 4)["plain_ms"].keys() == layout["plain_ms"].keys()
    older = {k: v for k, v in layout.items() if k not in ("trees", "alone_step_ms", "alone_tau", "version")}
    model.plan.batches["4 on the fastest layout"] = dict(older, alone_speedup=2.0)
    assert medusa.plan.batch_choice(model, 4)["trees"]
    model.plan.batches["4 on the fastest layout"] = dict(older, trees=layout["trees"], alone_speedup=2.0)
    assert medusa.plan.batch_choice(model, 4)["alone_step_ms"]
    model.plan.batches["4 on the fastest layout"] = dict(layout, version=2, alone_step_ms={"256": -1.0})
    assert medusa.plan.batch_choice(model, 4)["alone_step_ms"] == layout["alone_step_ms"]
    # a batch prefills its rows in groups of like lengths, each padded to its longest (batch.prefill_groups), one at
    # a time each row its own: at 1 ms a token either way, one long prompt among short ones costs the batch 250 + 3 x
    # 10 ms as it costs the rows alone, and two long ones 2 x 250 + 2 x 10 against 250 + 200 + 2 x 10
    monkeypatch.setattr(medusa.plan, "time_batch_prefill", lambda *args: 1.0)
    monkeypatch.setattr(medusa.plan, "time_alone_prefill", lambda *args: 1.0)
    del model.plan.batches["4 on the fastest layout"]
    priced = medusa.plan.batch_choice(model, 4)
    steps_ms = 2 * _step_ms_at(priced["plain_ms"]["eager"], 251)
    mixed = lay_out(priced, [250, 10, 10, 10], 2, plain=True)[4]
    assert mixed["plain together on eager"] == pytest.approx(1000 * 8 / (280 + steps_ms))
    two_long = lay_out(priced, [250, 200, 10, 10], 2, plain=True)[4]
    assert two_long["plain together on eager"] == pytest.approx(1000 * 8 / (520 + steps_ms))
    assert two_long["plain one at a time"] == pytest.approx(1000 * 8 / (470 + 8 * 20.0))
    assert lay_out(priced, *_at(256, 4))[:2] == ("eager", False)  # prompts alike: the prefills cost the same
    # 8 rows: the tree's whole step (200 ms) costs more than its tau gains over plain decoding together (40 ms)
    _layout_with(monkeypatch, model, lambda engine, width: 40.0, 20.0, tree_ms=lambda width, nodes: 200.0)
    assert lay_out(medusa.plan.batch_choice(model, 8), *_at(256, 8))[:4] == ("eager", False, "plain", None)
    # 2 rows: a batched plain step of 40 ms is 50 tok/s, no faster than one sequence's, and the tree's step (200 ms)
    # gains less than one sequence's plan: both go one at a time
    _layout_with(monkeypatch, model, lambda engine, width: 40.0, 20.0, tree_ms=lambda width, nodes: 200.0)
    two = medusa.plan.batch_choice(model, 2)
    assert lay_out(two, *_at(256, 2))[:2] == (model.plan.engine, True)
    assert lay_out(two, *_at(256, 2), plain=True)[:2] == (model.plan.plain_engine, True)

    decoded_together = []
    real = medusa.decode.decode_batch
    monkeypatch.setattr(medusa.decode, "decode_batch", lambda *a, **k: decoded_together.append(1) or real(*a, **k))
    prompts = [[3, 4, 5, 6, 3, 4], [7, 8, 9]]
    ids, mask = torch.tensor([prompts[0], [0] * 3 + prompts[1]]), torch.tensor([[1] * 6, [0] * 3 + [1] * 3])
    for proposer in (None, "plain"):
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=12, proposer=proposer, return_dict_in_generate=True
        )
        reference = model.base.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
        assert torch.equal(out.sequences, reference) and not decoded_together  # one at a time, as a batch returns
        assert out.stats.new_tokens == 24 and len(out.stats.accepted_lengths) == out.stats.steps - 2  # 2 prefills
    model.generate(ids, attention_mask=mask, max_new_tokens=4, engine="eager")  # a named batch engine: together
    assert decoded_together


def test_a_batch_takes_the_tree_whose_whole_steps_decode_fastest(tmp_path, monkeypatch):
    """A layout times whole steps of every tree its batched verify expects to pay, not only the one it expects
    fastest: a tree whose propose and acceptance cost more than its verify suggested loses to a smaller one, and
    trees within TIE_MARGIN of each other go to the fewest nodes."""
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path / "cache"))
    base_dir, heads_dir = _tiny_with_accuracy(tmp_path)
    model = MedusaModel.from_pretrained(heads_dir, base=base_dir, plan="auto")
    _plan_expecting(model, 1.0)  # one at a time never pays: the choice is among the batch's trees
    lay_out, key = medusa.plan.lay_out, "4 on the fastest layout"
    _layout_with(monkeypatch, model, lambda engine, width: 40.0, 40.0, tree_ms=lambda width, nodes: 40.0)
    expected = medusa.plan.batch_choice(model, 4, engine="eager")["candidates"]
    layout = medusa.plan.batch_choice(model, 4)
    assert [t["tree"] for t in layout["trees"]] == [c["tree"] for c in expected] and len(expected) > 3  # every one
    tau = {len(t["tree"]) + 1: t["tau"] for t in layout["trees"]}
    largest, smallest = max(tau), min(tau)
    assert len(tau) >= 2 and tau[largest] > tau[smallest] > 1.0
    # every tree's whole step as cheap as plain decoding's: the largest tau decodes fastest
    proposer = layout["trees"][0]["proposer"]  # (the plan's own, where it is medusa or dynamic)
    assert lay_out(layout, *_at(256, 4))[2:4] == (proposer, layout["trees"][0]["tree"])
    # the largest tree's step costs more than its tau gains: the smallest, which its verify expected slower, wins
    del model.plan.batches[key]
    _layout_with(monkeypatch, model, lambda e, w: 40.0, 40.0, tree_ms=lambda w, n: 40.0 * (3 if n == largest else 1))
    _, _, _, tree, rates = lay_out(medusa.plan.batch_choice(model, 4), *_at(256, 4))
    assert len(tree) + 1 != largest and rates[f"{proposer} {len(tree) + 1} nodes together on eager"] == max(
        rates.values()
    )
    # steps in proportion to tau (every tree decodes as fast, and faster than plain): the fewest nodes
    del model.plan.batches[key]
    _layout_with(monkeypatch, model, lambda e, w: 40.0, 40.0, tree_ms=lambda w, n: 20.0 * tau[n])
    assert len(lay_out(medusa.plan.batch_choice(model, 4), *_at(256, 4))[3]) + 1 == smallest
    # every tree 3% ahead of plain decoding together: short of MIN_GAIN, the batch decodes plainly; 8% ahead: a tree
    for ahead, proposer_taken in ((1.03, "plain"), (1.08, proposer)):
        del model.plan.batches[key]
        _layout_with(
            monkeypatch, model, lambda e, w: 40.0, 40.0, tree_ms=lambda w, n, ahead=ahead: 40.0 * tau[n] / ahead
        )
        assert lay_out(medusa.plan.batch_choice(model, 4), *_at(256, 4))[2] == proposer_taken


def test_a_batch_expects_the_share_of_its_trees_tau_that_batches_accepted(tmp_path, monkeypatch):
    """Each batch decoded together with the plan's tree records what its rows accepted beyond one token a step
    against what the tree was expected to (from a prior at the expectation; older batches count less past the
    memory); a later layout expects that share of each tree's guessed part, and a tree that pays at the decoded
    taus but not at the share accepted gives way to plain decoding."""
    record = ObservedAcceptance()
    assert record.share == 1.0
    record.add(3.0, [1] * 100)  # 2 guessed tokens a step expected, none accepted
    assert record.share == pytest.approx(ACCEPTANCE_PRIOR / (ACCEPTANCE_PRIOR + 200))
    record.add(3.0, [3] * 5000)
    assert record.expected == pytest.approx(ACCEPTANCE_MEMORY) and 0.9 < record.share < 1.0

    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path / "cache"))
    base_dir, heads_dir = _tiny_with_accuracy(tmp_path)
    model = MedusaModel.from_pretrained(heads_dir, base=base_dir, plan="auto")
    _plan_expecting(model, 1.0)  # one at a time never pays
    # a tree's whole step costs 10% more than a plain one: it pays at its decoded tau, not where no guess is taken
    _layout_with(monkeypatch, model, lambda e, w: 40.0, 40.0, tree_ms=lambda w, n: 44.0)
    ids, mask = torch.tensor([[3, 4, 5, 6, 3, 4], [0, 0, 0, 7, 8, 9]]), torch.tensor([[1] * 6, [0] * 3 + [1] * 3])
    layout = model.batch_layout([6, 3], 12, None, None, None)
    assert layout.proposer != "plain" and layout.expected_tau > 1.1 and not layout.one_at_a_time
    out = model.generate(ids, attention_mask=mask, max_new_tokens=12, return_dict_in_generate=True)
    steps = len(out.stats.accepted_lengths)
    assert model.acceptance.expected == pytest.approx(ACCEPTANCE_PRIOR + (layout.expected_tau - 1) * steps)
    assert model.acceptance.accepted == pytest.approx(ACCEPTANCE_PRIOR + sum(out.stats.accepted_lengths) - steps)
    model.generate(ids, attention_mask=mask, max_new_tokens=12, proposer="plain")  # plain: nothing to record
    model.generate(ids, attention_mask=mask, max_new_tokens=12, tree=[[0]])  # a tree the call names: neither
    assert model.acceptance.expected == pytest.approx(ACCEPTANCE_PRIOR + (layout.expected_tau - 1) * steps)
    model.acceptance = ObservedAcceptance(accepted=0.0, expected=100.0)  # no guess accepted
    assert model.batch_layout([6, 3], 12, None, None, None)[:3] == ("eager", False, "plain")


def test_one_at_a_time_expects_the_plans_own_timed_steps_and_records_what_its_rows_accepted(tmp_path, monkeypatch):
    """Decoding a batch's rows one at a time is priced by the plan's own whole steps timed alone and its tau (scaled
    by the share batches accepted), not by its expected speedup: a plan whose steps cost its tau's gain is no faster
    one at a time than plain decoding, and the batch decodes together. Rows decoded one at a time by the plan record
    what their guessing steps accepted against its tau."""
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path / "cache"))
    base_dir, heads_dir = _tiny_with_accuracy(tmp_path)
    model = MedusaModel.from_pretrained(heads_dir, base=base_dir, plan="auto")
    _plan_expecting(model, 3.0)
    model.plan.expected_speedup = 3.0  # what it once expected of its steps: no longer what a layout weighs
    # 4 rows: plain together 40 ms a step (100 tok/s); one sequence's plain step 20 ms (50 tok/s), the plan's 60 ms
    _layout_with(monkeypatch, model, lambda e, w: 40.0, 20.0, tree_ms=lambda w, n: 400.0, planned_ms=60.0)
    layout = medusa.plan.batch_choice(model, 4)
    assert layout["alone_tau"] == 3.0 and set(layout["alone_step_ms"].values()) == {60.0}
    _, alone, proposer, _, rates = medusa.plan.lay_out(layout, *_at(256, 4))
    assert rates["planned one at a time"] == pytest.approx(rates["plain one at a time"]) == pytest.approx(50.0)
    assert (alone, proposer) == (False, "plain")
    half = medusa.plan.lay_out(layout, *_at(256, 4), acceptance=0.5)[4]  # tau 2 expected: 2 tokens per 60 ms
    assert half["planned one at a time"] == pytest.approx(1000 * 2 / 60.0)
    # the plan's steps at 10 ms: 300 tok/s one at a time, so a batch goes so; its rows' steps are recorded
    del model.plan.batches["4 on the fastest layout"]
    _layout_with(monkeypatch, model, lambda e, w: 40.0, 20.0, tree_ms=lambda w, n: 400.0, planned_ms=10.0)
    prompts = [[3, 4, 5, 6, 3, 4], [7, 8, 9], [5, 5, 5], [9, 8, 7, 6]]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    layout = model.batch_layout(list(map(len, prompts)), 12, None, None, None)
    assert layout.one_at_a_time and layout.expected_tau == 3.0
    out = model.generate(ids, attention_mask=mask, max_new_tokens=12, return_dict_in_generate=True)
    guessed = [n for n, depth in zip(out.stats.accepted_lengths, out.stats.proposed_lengths) if depth]
    assert guessed and model.acceptance.expected == pytest.approx(ACCEPTANCE_PRIOR + 2 * len(guessed))
    assert model.acceptance.accepted == pytest.approx(ACCEPTANCE_PRIOR + sum(guessed) - len(guessed))
    reference = model.base.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert torch.equal(out.sequences, reference)


def test_plain_steps_together_take_the_engine_fastest_at_the_calls_width(tmp_path, monkeypatch):
    """The layout's engine is the one fastest at 256 cached tokens, where its trees are timed; a call whose rows
    attend over many more decodes plainly on whichever engine is fastest at its own width."""
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path / "cache"))
    base_dir, heads_dir = _tiny_with_accuracy(tmp_path)
    model = MedusaModel.from_pretrained(heads_dir, base=base_dir, plan="auto")
    # eager 40 ms a step at 256 tokens, 40 more per 256; compiled 60 ms at any width; no tree pays, nor one at a time
    _layout_with(
        monkeypatch,
        model,
        lambda engine, width: width * 40 / 256 if engine == "eager" else 60.0,
        1000.0,
        tree_ms=lambda width, nodes: 1e6,
    )
    layout = medusa.plan.batch_choice(model, 4)
    assert layout["engine"] == "eager" and {"eager", "compiled"} <= set(layout["plain_ms"])
    for plain in (False, True):
        assert medusa.plan.lay_out(layout, *_at(256, 4), plain=plain)[:3] == ("eager", False, "plain")
        assert medusa.plan.lay_out(layout, *_at(1024, 4), plain=plain)[:3] == ("compiled", False, "plain")
