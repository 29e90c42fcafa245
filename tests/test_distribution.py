"""Proof by test: exact sampling methods produce the target's distribution; planted wrong rules are caught.

Tiny random models with a 12-token vocabulary, so the target's exact probability of every 3-token continuation
(1,728 sequences) can be enumerated, with the shaping computed by transformers' own logits warpers (independent of
medusa.sampling). Each exact method draws 20,000 continuations end to end through `generate`; a chi-square
goodness-of-fit test must not reject at significance 0.001 (99.9 % confidence), and any sequence the target cannot
produce fails outright. The same test applied to planted wrong rules must reject (p < 1e-6). Seeds are fixed, so
every outcome is deterministic; the p-values are printed (`pytest -s`).
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LogitsProcessorList,
    PreTrainedTokenizerFast,
    Qwen2Config,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from medusa import MedusaModel
from medusa.acceptance import ACCEPTANCE_RULES, Acceptance, rejection, speculative
from medusa.ngram import copy_chain
from medusa.prompt_lookup import PromptLookupProposer
from medusa.proposers import PROPOSERS
from medusa.sampling import SamplingConfig, select_token, target_probs
from tests.conftest import make_heads

V = 12  # vocabulary: V**3 = 1,728 continuations of 3 tokens
NEW = 3
PROMPT = torch.tensor([[1, 2]])
SIGNIFICANCE = 1e-3  # an exact sampler is rejected with this probability (for a given seed: never, or always)
DETECTED = 1e-6  # a planted wrong rule must be rejected at least this clearly
EXACT_SAMPLES = 20_000
CONTROL_SAMPLES = 1_000  # planted bugs are gross: 1,000 samples already reject them by many orders of magnitude
MEDUSA_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0]]  # three siblings at depth 1: sibling rejection is exercised
MEDUSA_SETTINGS = dict(temperature=0.7, top_p=0.9)
DRAFT_SETTINGS = dict(temperature=1.3, top_k=8, top_p=0.95)


# ---------------------------------------------------------------- statistics
def chi2_sf(x: float, dof: int) -> float:
    """P(X >= x) for X ~ chi-square(dof): the regularised upper incomplete gamma Q(dof / 2, x / 2)."""
    a, x = dof / 2, x / 2
    if x <= 0:
        return 1.0
    log_prefactor = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1:  # series for the lower part P(a, x)
        term = total = 1 / a
        k = a
        while abs(term) > abs(total) * 1e-16:
            k += 1
            term *= x / k
            total += term
        return max(0.0, 1.0 - total * math.exp(log_prefactor))
    tiny = 1e-300  # continued fraction for Q(a, x) (modified Lentz)
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 100_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < 1e-16:
            break
    return math.exp(log_prefactor) * h


def chi_square(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> dict:
    """Goodness of fit of observed counts (K,) to exact probabilities (K,).

    Cells expected fewer than `min_expected` times are pooled into one bin (merged into the smallest bin if the pool
    is still too small), so the chi-square approximation holds. Observations in zero-probability cells make p = 0.
    """
    counts, probs = counts.double(), probs.double() / probs.sum()
    n = counts.sum()
    expected = probs * n
    impossible = int(counts[probs == 0].sum())
    big, small = expected >= min_expected, (expected < min_expected) & (probs > 0)
    obs, exp = counts[big], expected[big]
    if small.any():
        pooled_obs, pooled_exp = counts[small].sum(), expected[small].sum()
        if pooled_exp >= min_expected:
            obs, exp = torch.cat([obs, pooled_obs.view(1)]), torch.cat([exp, pooled_exp.view(1)])
        else:
            i = exp.argmin()
            obs[i], exp[i] = obs[i] + pooled_obs, exp[i] + pooled_exp
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = obs.numel() - 1
    return dict(
        stat=stat,
        dof=dof,
        p_value=0.0 if impossible else chi2_sf(stat, dof),
        impossible=impossible,
        tv=float((counts / n - probs).abs().sum() / 2),
        samples=int(n),
    )


def test_chi2_sf_matches_known_quantiles():
    assert chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-9)
    assert chi2_sf(18.307038053275146, 10) == pytest.approx(0.05, rel=1e-9)
    assert chi2_sf(124.34211340400407, 100) == pytest.approx(0.05, rel=1e-9)
    assert chi2_sf(2.0, 2) == pytest.approx(math.exp(-1), rel=1e-12)
    assert chi2_sf(10.827566170662733, 1) == pytest.approx(1e-3, rel=1e-8)
    assert chi2_sf(1000.0, 10) < 1e-150


def test_chi_square_accepts_exact_draws_and_rejects_a_biased_sampler():
    gen = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    exact = torch.bincount(torch.multinomial(probs, 20_000, True, generator=gen), minlength=5)
    assert chi_square(exact, probs)["p_value"] > SIGNIFICANCE
    biased = torch.bincount(
        torch.multinomial(torch.tensor([0.48, 0.32, 0.15, 0.05, 0.0]), 20_000, True, generator=gen), minlength=5
    )
    assert chi_square(biased, probs)["p_value"] < SIGNIFICANCE
    assert chi_square(torch.tensor([100, 60, 30, 10, 1]), probs)["p_value"] == 0.0  # an impossible outcome


# ---------------------------------------------------------------- tiny small-vocabulary models
def tiny_lm(config_class, seed: int, init: float = 0.5):
    """1 layer, hidden 16, 12 tokens; a large init range makes the distributions peaked (top-p matters)."""
    torch.manual_seed(seed)
    config = config_class(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
        initializer_range=init,
    )
    config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(config).eval()


def tiny_tokenizer(size: int = V, prefix: str = "t") -> PreTrainedTokenizerFast:
    """A word-level tokenizer with `size` tokens named prefix0..: builds offline, no files."""
    tok = Tokenizer(models.WordLevel({f"{prefix}{i}": i for i in range(size)}, unk_token=f"{prefix}0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def hf_warpers(temperature=1.0, top_k=None, top_p=None) -> LogitsProcessorList:
    """transformers' own sampling warpers, in generate's order: the independent reference for shaping."""
    warpers = LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k is not None:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p is not None and top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    return warpers


@torch.inference_mode()
def exact_continuations(target, prompt: torch.Tensor, **settings) -> torch.Tensor:
    """(V**3,) the target's probability of every 3-token continuation, index x1 * V**2 + x2 * V + x3."""
    t = prompt.shape[1]
    grid = torch.cartesian_prod(torch.arange(V), torch.arange(V))  # (V*V, 2): every (x1, x2)
    logits = target(torch.cat([prompt.expand(V * V, t), grid], dim=1)).logits.float()  # (V*V, t+2, V)
    warpers = hf_warpers(**settings)
    dummy = torch.zeros((V * V, 1), dtype=torch.long)
    p1 = warpers(dummy[:1], logits[:1, t - 1]).softmax(-1)[0]  # (V,)
    p2 = warpers(dummy, logits[:, t]).softmax(-1).view(V, V, V)[:, 0]  # (V, V): x1 -> x2
    p3 = warpers(dummy, logits[:, t + 1]).softmax(-1).view(V, V, V)  # (V, V, V): x1, x2 -> x3
    return (p1[:, None, None] * p2[:, :, None] * p3).flatten()


def sample_counts(model, n: int, seed: int, prompt: torch.Tensor = PROMPT, **kwargs) -> torch.Tensor:
    """(V**3,) how often `model.generate(do_sample=True)` emitted each continuation in n runs."""
    generator = torch.Generator().manual_seed(seed)
    index = torch.empty(n, dtype=torch.long)
    for i in range(n):
        x1, x2, x3 = model.generate(prompt, max_new_tokens=NEW, do_sample=True, generator=generator, **kwargs)[
            0, -NEW:
        ].tolist()
        index[i] = x1 * V * V + x2 * V + x3
    return torch.bincount(index, minlength=V**3)


@pytest.fixture(scope="module")
def target():
    return tiny_lm(LlamaConfig, seed=0)


@pytest.fixture(scope="module")
def medusa(target):
    return MedusaModel(target, make_heads(num_heads=2, random=True, hidden=16, vocab=V), tree=MEDUSA_TREE)


@pytest.fixture(scope="module")
def draft_model(target):
    tok = tiny_tokenizer()
    return MedusaModel.from_draft_model(
        target=target, draft=tiny_lm(Qwen2Config, seed=1), num_speculative_tokens=2, tokenizer=tok, draft_tokenizer=tok
    )


def report(name: str, result: dict) -> None:
    print(
        f"\n{name}: n={result['samples']} chi2={result['stat']:.1f} dof={result['dof']} "
        f"p={result['p_value']:.3g} TV={result['tv']:.4f} impossible={result['impossible']}"
    )


# ---------------------------------------------------------------- shaping equals transformers'
@pytest.mark.parametrize(
    "settings",
    [
        dict(temperature=0.7),
        dict(top_k=3),
        dict(top_p=0.8),
        dict(top_k=1),
        dict(temperature=1.3, top_k=8, top_p=0.95),
        dict(temperature=0.5, top_p=0.3),
    ],
)
def test_target_probs_match_transformers_warpers(settings):
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0)) * 3
    logits[0, :5] = 2.0  # ties at the top-k boundary are kept, as transformers keeps them
    want = hf_warpers(**settings)(torch.zeros((64, 1), dtype=torch.long), logits.clone()).softmax(-1)
    got = target_probs(logits, SamplingConfig(do_sample=True, **settings))
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(temperature=0.0), "temperature must be > 0"),
        (dict(temperature=-1.0), "temperature must be > 0"),
        (dict(top_p=0.0), r"top_p must lie in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must lie in \(0, 1\]"),
        (dict(top_k=2.5), "top_k must be a positive integer"),
        (dict(top_k=-3), "top_k must be a positive integer"),
        (dict(posterior_threshold=1.5), "posterior_threshold"),
        (dict(posterior_alpha=-0.1), "posterior_alpha"),
    ],
)
def test_invalid_sampling_settings_are_named(medusa, settings, message):
    with pytest.raises(ValueError, match=message):
        medusa.generate(PROMPT, max_new_tokens=3, do_sample=True, **settings)


def test_unknown_acceptance_rule_is_named(medusa):
    with pytest.raises(ValueError, match="unknown acceptance rule 'nope'.*rejection"):
        medusa.generate(PROMPT, max_new_tokens=3, do_sample=True, acceptance="nope")


def test_seeded_generator_reproduces_a_sample(medusa, draft_model):
    for model in (medusa, draft_model):
        runs = [
            model.generate(
                PROMPT, max_new_tokens=20, do_sample=True, generator=torch.Generator().manual_seed(7), **MEDUSA_SETTINGS
            )
            for _ in range(2)
        ]
        assert torch.equal(runs[0], runs[1])


# ---------------------------------------------------------------- planted wrong rules (negative controls)
def always_accept(candidates, verified, sampling, generator=None) -> Acceptance:
    """WRONG: accept the first root-to-leaf path whatever the target says, bonus from p at its leaf."""
    path = candidates.tree.leaf_paths[0]
    path = path[path < candidates.tree.num_nodes]
    bonus = select_token(verified.logits[path[-1]], sampling, generator)
    return Acceptance(nodes=path, tokens=candidates.tokens[path[1:]].tolist() + [int(bonus)])


def bonus_from_p(rule):
    """WRONG: after a rejection, draw the bonus from the full p instead of the residual (norm(max(0, p - q)))."""

    def wrong(candidates, verified, sampling, generator=None) -> Acceptance:
        accepted = rule(candidates, verified, sampling, generator)
        last = int(accepted.nodes[-1])
        children = candidates.tree.parent[1:] == last
        if bool(children.any()):  # the walk stopped at a node with children: they were all rejected
            bonus = int(select_token(verified.logits[last], sampling, generator))
            return Acceptance(nodes=accepted.nodes, tokens=accepted.tokens[:-1] + [bonus])
        return accepted

    return wrong


# ---------------------------------------------------------------- the proof
@pytest.mark.slow
def test_medusa_tree_rejection_sampling_is_exact(target, medusa):
    exact = exact_continuations(target, PROMPT, **MEDUSA_SETTINGS)
    counts = sample_counts(medusa, EXACT_SAMPLES, seed=1, **MEDUSA_SETTINGS)  # default rule for do_sample: rejection
    result = chi_square(counts, exact)
    report("medusa tree, rejection (exact)", result)
    assert result["impossible"] == 0
    assert result["p_value"] > SIGNIFICANCE, result


@pytest.mark.slow
def test_copying_heads_tree_rejection_sampling_is_exact(target):
    """Heads with copy guesses (copy_ngram): every bigram (5, v) is in the prompt, so every step has a copy chain
    ranked first; sampling must stay exact."""
    heads = make_heads(num_heads=2, random=True, hidden=16, vocab=V)
    heads.config = dataclasses.replace(heads.config, copy_ngram=2)
    model = MedusaModel(target, heads, tree=MEDUSA_TREE)
    prompt = torch.tensor([[t for v in range(V) if v != 5 for t in (5, v)] + [5]])
    assert copy_chain(torch.cat([prompt[0], torch.tensor([0])]), 2, 2) == [5, 1]  # after root 0: copy 5, then 1
    exact = exact_continuations(target, prompt, **MEDUSA_SETTINGS)
    counts = sample_counts(model, EXACT_SAMPLES, seed=3, prompt=prompt, **MEDUSA_SETTINGS)
    result = chi_square(counts, exact)
    report("medusa tree with copy guesses, rejection (exact)", result)
    assert result["impossible"] == 0
    assert result["p_value"] > SIGNIFICANCE, result


@pytest.mark.slow
def test_prompt_lookup_tree_rejection_sampling_is_exact(monkeypatch, target):
    """Prompt lookup on one-token matches: every token came three times before, followed by three different tokens,
    so every step guesses a tree with siblings (deterministic guesses: no q); sampling must stay exact."""
    monkeypatch.setitem(PROPOSERS, "prompt_lookup", lambda model, tree: PromptLookupProposer(model.device, 1, 4))
    model = MedusaModel(target, make_heads(num_heads=2, random=True, hidden=16, vocab=V))
    prompt = torch.tensor([[*range(V), *(5 * i % V for i in range(V)), *((7 * i + 1) % V for i in range(V))]])
    state = SimpleNamespace(tokens=prompt[0].tolist() + [4], root_token=torch.tensor(4))
    assert PromptLookupProposer(torch.device("cpu"), 1, 4).propose(state).tree.parent.tolist()[:4] == [0, 0, 0, 0]
    exact = exact_continuations(target, prompt, **MEDUSA_SETTINGS)
    counts = sample_counts(model, EXACT_SAMPLES, seed=4, prompt=prompt, proposer="prompt_lookup", **MEDUSA_SETTINGS)
    result = chi_square(counts, exact)
    report("prompt lookup tree, rejection (exact)", result)
    assert result["impossible"] == 0
    assert result["p_value"] > SIGNIFICANCE, result


@pytest.mark.slow
def test_draft_model_speculative_sampling_is_exact(target, draft_model):
    exact = exact_continuations(target, PROMPT, **DRAFT_SETTINGS)
    counts = sample_counts(draft_model, EXACT_SAMPLES, seed=2, **DRAFT_SETTINGS)  # default rule: speculative
    result = chi_square(counts, exact)
    report("draft model, speculative (exact)", result)
    assert result["impossible"] == 0
    assert result["p_value"] > SIGNIFICANCE, result


@pytest.mark.slow
@pytest.mark.parametrize(
    "method, planted",
    [
        ("medusa", "always_accept"),
        ("medusa", "bonus_from_p"),
        ("draft", "always_accept"),
        ("draft", "bonus_from_p"),
    ],
)
def test_planted_wrong_rules_are_detected(monkeypatch, target, medusa, draft_model, method, planted):
    model, settings = (medusa, MEDUSA_SETTINGS) if method == "medusa" else (draft_model, DRAFT_SETTINGS)
    exact_rule = rejection if method == "medusa" else speculative
    wrong = always_accept if planted == "always_accept" else bonus_from_p(exact_rule)
    monkeypatch.setitem(ACCEPTANCE_RULES, "planted", wrong)
    counts = sample_counts(model, CONTROL_SAMPLES, seed=3, acceptance="planted", **settings)
    result = chi_square(counts, exact_continuations(target, PROMPT, **settings))
    report(f"{method}, planted {planted} (must be detected)", result)
    assert result["p_value"] < DETECTED, result


def eagle3_model(target, **options):
    """A random EAGLE-3 draft over the target's embeddings (layer 0) with 8 of the 12 tokens in its vocabulary: the
    four it cannot draft are reached only through rejection, so a wrong residual shows."""
    from medusa.eagle3 import Eagle3Draft, Eagle3Model

    torch.manual_seed(4)
    draft = Eagle3Draft(target.config, [0], 8, V)
    for parameter in draft.parameters():
        torch.nn.init.normal_(parameter, std=1.5 / parameter.shape[-1] ** 0.5)
    draft.set_vocabulary(torch.tensor([0, 1, 2, 3, 5, 7, 8, 11]))
    return Eagle3Model(target, draft, **options)


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_eagle3_sampling_is_exact(target, shape):
    """A chain samples from the draft's q and is judged by the speculative rule; a tree is a deterministic set of
    guesses judged by the rejection rule (each the model's default for its shape)."""
    options = (
        dict(num_speculative_tokens=2) if shape == "chain" else dict(num_speculative_tokens=2, num_nodes=5, topk=2)
    )
    settings = DRAFT_SETTINGS if shape == "chain" else MEDUSA_SETTINGS
    model = eagle3_model(target, **options)
    exact = exact_continuations(target, PROMPT, **settings)
    counts = sample_counts(model, EXACT_SAMPLES, seed=5, **settings)
    result = chi_square(counts, exact)
    report(f"eagle3 {shape} (exact)", result)
    assert result["impossible"] == 0
    assert result["p_value"] > SIGNIFICANCE, result


BATCH_PROMPTS = [[1, 2], [3], [4, 5, 6], [7, 8]]
BATCH_SAMPLES = 5_000  # per row: each call draws one continuation for every row


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["medusa", "draft_model"])
def test_each_row_of_a_sampled_batch_is_distributed_as_the_target(request, target, model_name):
    """Batch 4, rows of different lengths left-padded: every row's continuations follow the target's distribution
    for that row's prompt, so decoding rows together (their own trees, acceptance and draws) stays exact."""
    model = request.getfixturevalue(model_name)
    settings = MEDUSA_SETTINGS if model_name == "medusa" else DRAFT_SETTINGS
    width = max(map(len, BATCH_PROMPTS))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in BATCH_PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in BATCH_PROMPTS])
    generator = torch.Generator().manual_seed(11)
    index = torch.empty((len(BATCH_PROMPTS), BATCH_SAMPLES), dtype=torch.long)
    for i in range(BATCH_SAMPLES):
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True, generator=generator, **settings
        )
        x1, x2, x3 = out[:, -NEW:].T
        index[:, i] = x1 * V * V + x2 * V + x3
    assert_each_row_exact(target, index, f"{model_name}, batch row", settings)


def assert_each_row_exact(target, index: torch.Tensor, label: str, settings, prompts=BATCH_PROMPTS) -> None:
    """index[row]: each draw's 3-token continuation (as an index) for prompts[row]: every row must follow the
    target's distribution for its prompt under `settings` (one dict for all rows, or a list of one per row)."""
    for row, prompt in enumerate(prompts):
        own = settings[row] if isinstance(settings, list) else settings
        exact = exact_continuations(target, torch.tensor([prompt]), **own)
        result = chi_square(torch.bincount(index[row], minlength=V**3), exact)
        report(f"{label} {row} (exact)", result)
        assert result["impossible"] == 0
        assert result["p_value"] > SIGNIFICANCE, (row, result)


@pytest.mark.slow
def test_each_request_joining_a_running_batch_is_distributed_as_the_target(target, medusa):
    """Continuous batching (generate_continuously), sampled: two requests start a batch (6 new tokens, their first 3
    counted), two more join it after its first step, each request with its own sampling settings and one greedy
    among them; every sampled request's continuations follow the target's distribution for its prompt and settings
    and the greedy one is the target's greedy continuation every time, so rows that join a running batch (their own
    prefill, masks, positions, rules and draws) stay exact."""
    from medusa.batch import GenerationRequest

    own = [MEDUSA_SETTINGS, None, dict(temperature=1.3, top_k=8), dict(temperature=0.5)]  # None: greedy
    greedy = medusa.base.generate(torch.tensor([BATCH_PROMPTS[1]]), max_new_tokens=NEW, do_sample=False)[0, -NEW:]
    torch.manual_seed(13)
    index = torch.empty((len(BATCH_PROMPTS), BATCH_SAMPLES), dtype=torch.long)
    for i in range(BATCH_SAMPLES):
        requests = [
            GenerationRequest([p], max_new_tokens=6 if r < 2 else NEW, do_sample=s is not None, **(s or {}))
            for r, (p, s) in enumerate(zip(BATCH_PROMPTS, own))
        ]
        calls = []

        def take(room, requests=requests, calls=calls):
            calls.append(room)
            return requests[:2] if len(calls) == 1 else requests[2:] if len(calls) == 2 else []

        medusa.generate_continuously(take)
        for row, (request, prompt) in enumerate(zip(requests, BATCH_PROMPTS)):
            x1, x2, x3 = request.result.result(timeout=0).sequences[0, len(prompt) : len(prompt) + NEW].tolist()
            index[row, i] = x1 * V * V + x2 * V + x3
    x1, x2, x3 = greedy.tolist()
    assert (index[1] == x1 * V * V + x2 * V + x3).all()
    sampled = [0, 2, 3]
    prompts, settings = [BATCH_PROMPTS[r] for r in sampled], [own[r] for r in sampled]
    assert_each_row_exact(target, index[sampled], "continuous batching, request", settings, prompts)
