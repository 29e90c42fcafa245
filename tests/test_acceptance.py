"""Acceptance rules on hand-made trees and logits: one step of each exact rule is exact, duplicates are never
accepted twice, typical acceptance follows its criterion, and misuse is named."""

import math

import pytest
import torch

from medusa.acceptance import ACCEPTANCE_RULES, get_rule, greedy, rejection, speculative, typical
from medusa.runtime import VerifyOutput
from medusa.sampling import SamplingConfig, greedy_tokens, target_probs
from medusa.tree import Candidates, TreeSpec, build_buffers, chain
from tests.test_distribution import DETECTED, SIGNIFICANCE, bonus_from_p, chi_square

SAMPLE = SamplingConfig(do_sample=True)
GREEDY = SamplingConfig()


def step(paths, tokens, logits, draft_probs=None):
    """Candidates + VerifyOutput for a tree given in canonical order (depth, then ranks); tokens (N,), logits (N, V)."""
    tree = build_buffers(TreeSpec(paths), max((len(p) for p in paths), default=1))
    assert tree.num_nodes == len(tokens) == logits.shape[0]
    return (
        Candidates(tokens=torch.tensor(tokens), tree=tree, draft_probs=draft_probs),
        VerifyOutput(logits=logits, hidden=torch.zeros(len(tokens), 4)),
    )


def random_logits(n, v, seed, scale=1.5):
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * scale


def test_registry_names_every_rule():
    assert {"greedy", "rejection", "speculative", "typical"} <= set(ACCEPTANCE_RULES)
    assert get_rule("rejection") is rejection and get_rule("speculative") is speculative
    with pytest.raises(ValueError, match="unknown acceptance rule 'fast'.*typical"):
        get_rule("fast")


@pytest.mark.parametrize("rule", [rejection, speculative])
def test_exact_rules_are_greedy_when_not_sampling(rule):
    logits = random_logits(4, 10, seed=0)
    predicted = logits.argmax(-1).tolist()
    tokens = [1, predicted[0], predicted[1], (predicted[2] + 1) % 10]  # two right, the third wrong
    candidates, verified = step(chain(3), tokens, logits, draft_probs=torch.full((4, 10), 0.1))
    got, want = rule(candidates, verified, GREEDY), greedy(candidates, verified, GREEDY)
    assert got.tokens == want.tokens == tokens[1:3] + [predicted[2]]
    assert torch.equal(got.nodes, want.nodes)


# ---------------------------------------------------------------- rejection (tree, deterministic candidates)
# nodes: 0 root, 1 = [0], 2 = [1], 3 = [2], 4 = [0, 0], 5 = [1, 0]; node 2 duplicates node 1's token
DUP_TREE = [[0], [1], [2], [0, 0], [1, 0]]
DUP_TOKENS = [0, 3, 3, 5, 7, 2]


def test_rejection_one_step_is_exact_and_never_accepts_a_duplicate():
    v, n = 8, 10_000
    logits = random_logits(6, v, seed=1)
    logits[0, 3], logits[0, 5] = 1.5, 1.0  # the root's p puts real mass on the candidate tokens
    logits[2] = -logits[1]  # the duplicate's distribution differs from node 1's: taking it would show
    candidates, verified = step(DUP_TREE, DUP_TOKENS, logits)
    p = target_probs(logits, SAMPLE)
    generator = torch.Generator().manual_seed(0)
    first = torch.zeros(v, dtype=torch.long)
    after = {1: torch.zeros(v, dtype=torch.long), 3: torch.zeros(v, dtype=torch.long)}
    for _ in range(n):
        out = rejection(candidates, verified, SAMPLE, generator)
        nodes = out.nodes.tolist()
        assert 2 not in nodes  # a duplicate of a rejected sibling has p = 0
        assert len(out.tokens) == len(nodes)
        first[out.tokens[0]] += 1
        if len(nodes) == 1:
            assert out.tokens[0] not in (3, 5)  # every child was rejected: the bonus avoids their tokens
        else:
            after[nodes[1]][out.tokens[1]] += 1
    for name, counts, want in (
        ("first", first, p[0]),
        ("after node 1", after[1], p[1]),
        ("after node 3", after[3], p[3]),
    ):
        result = chi_square(counts, want)
        assert result["p_value"] > SIGNIFICANCE, (name, result)
    assert after[1].sum() > 1000 and after[3].sum() > 1000  # both branches were really exercised


def test_rejection_one_step_control_bonus_from_p_is_detected():
    """The same check catches a rule that forgets to zero rejected children before drawing the bonus."""
    logits = random_logits(6, 8, seed=1)
    logits[0, 3], logits[0, 5] = 1.5, 1.0
    candidates, verified = step(DUP_TREE, DUP_TOKENS, logits)
    wrong, generator = bonus_from_p(rejection), torch.Generator().manual_seed(0)
    first = torch.bincount(
        torch.tensor([wrong(candidates, verified, SAMPLE, generator).tokens[0] for _ in range(4000)]), minlength=8
    )
    assert chi_square(first, target_probs(logits[0], SAMPLE))["p_value"] < DETECTED


def test_rejection_certain_and_impossible_children():
    sampling = SamplingConfig(do_sample=True, top_k=2)
    logits = torch.zeros(4, 6)
    logits[0, 4], logits[0, 1] = 30.0, 29.0  # top-2 = {4, 1}: token 2 has p = 0 after shaping
    candidates, verified = step([[0], [1], [2]], [0, 2, 4, 1], logits)  # children in order: 2, 4, 1
    generator = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(300):
        out = rejection(candidates, verified, sampling, generator)
        assert out.nodes.tolist() in ([0, 2], [0, 3])  # 2 is never accepted; 4 or else 1 always is
        seen.add(out.tokens[0])
    assert seen == {4, 1}


@pytest.mark.parametrize("rule", [rejection, speculative])  # speculative: a guarded chain's plain steps (no q)
def test_a_root_only_tree_samples_from_p(rule):
    logits = random_logits(1, 5, seed=2)
    candidates, verified = step([], [3], logits)
    generator = torch.Generator().manual_seed(0)
    counts = torch.bincount(
        torch.tensor([rule(candidates, verified, SAMPLE, generator).tokens[0] for _ in range(3000)]), minlength=5
    )
    assert chi_square(counts, target_probs(logits[0], SAMPLE))["p_value"] > SIGNIFICANCE


# ---------------------------------------------------------------- speculative (chain with a draft's q)
def draft_step(p_logits, q, generator):
    """Draw each draft token from its q row (the draft's randomness) and build the chain candidates."""
    drafts = [int(torch.multinomial(q[i], 1, generator=generator)) for i in range(1, q.shape[0])]
    return step(chain(q.shape[0] - 1), [0] + drafts, p_logits, draft_probs=q)


def test_speculative_one_step_is_exact_and_accepts_at_the_predicted_rate():
    v, gamma, n = 6, 2, 10_000
    p_logits = random_logits(gamma + 1, v, seed=3)
    q = torch.cat([torch.zeros(1, v), random_logits(gamma, v, seed=4).softmax(-1)])  # row i drew node i
    p = target_probs(p_logits, SAMPLE)
    generator = torch.Generator().manual_seed(0)
    counts = [torch.zeros(v, dtype=torch.long) for _ in range(gamma + 1)]
    first_accepted = 0
    for _ in range(n):
        out = speculative(*draft_step(p_logits, q, generator), SAMPLE, generator)
        for i, token in enumerate(out.tokens):
            counts[i][token] += 1  # token i is drawn from p_i given the first i were accepted
        first_accepted += len(out.tokens) > 1
    for i in range(gamma + 1):
        result = chi_square(counts[i], p[i])
        assert result["p_value"] > SIGNIFICANCE, (i, result)
    beta = float(torch.minimum(p[0], q[1]).sum())  # Leviathan et al.: P(accept) = sum_x min(p(x), q(x))
    assert abs(first_accepted / n - beta) < 5 * math.sqrt(beta * (1 - beta) / n)


def test_speculative_one_step_control_resample_from_p_is_detected():
    v = 6
    p_logits = random_logits(3, v, seed=3)
    q = torch.cat([torch.zeros(1, v), random_logits(2, v, seed=4).softmax(-1)])
    wrong, generator = bonus_from_p(speculative), torch.Generator().manual_seed(0)
    first = torch.bincount(
        torch.tensor([wrong(*draft_step(p_logits, q, generator), SAMPLE, generator).tokens[0] for _ in range(4000)]),
        minlength=v,
    )
    assert chi_square(first, target_probs(p_logits[0], SAMPLE))["p_value"] < DETECTED


def test_speculative_accepts_everything_when_the_draft_is_the_target():
    sampling = SamplingConfig(do_sample=True, temperature=0.8, top_p=0.9)
    p_logits = random_logits(4, 7, seed=5)
    q = torch.cat([torch.zeros(1, 7), target_probs(p_logits[:-1], sampling)])  # q_i = p_{i-1}: a perfect draft
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        out = speculative(*draft_step(p_logits, q, generator), sampling, generator)
        assert out.nodes.tolist() == [0, 1, 2, 3]


def test_speculative_never_accepts_a_token_the_target_cannot_emit():
    sampling = SamplingConfig(do_sample=True, top_k=1)
    p_logits = torch.zeros(2, 5)
    p_logits[0, 2] = 5.0  # p puts all mass on token 2
    q = torch.tensor([[0.0] * 5, [0.5, 0.5, 0.0, 0.0, 0.0]])  # the draft never proposes it
    generator = torch.Generator().manual_seed(0)
    for _ in range(100):
        out = speculative(*draft_step(p_logits, q, generator), sampling, generator)
        assert out.tokens == [2] and out.nodes.tolist() == [0]  # rejected, residual max(0, p - q) = token 2


def test_speculative_misuse_is_named():
    logits = random_logits(3, 5, seed=6)
    with pytest.raises(ValueError, match="needs the draft model's probabilities"):
        speculative(*step(chain(2), [0, 1, 2], logits), SAMPLE)
    with pytest.raises(ValueError, match="takes a chain"):
        speculative(*step([[0], [1]], [0, 1, 2], logits, draft_probs=torch.full((3, 5), 0.2)), SAMPLE)


# ---------------------------------------------------------------- typical (lossy)
def probs_to_logits(rows):
    return torch.tensor(rows).log()


def threshold(p_row, epsilon=0.09, alpha=0.3):
    entropy = -sum(x * math.log(x) for x in p_row if x > 0)
    return min(epsilon, alpha * math.exp(-entropy))


def test_typical_accepts_by_entropy_threshold_and_takes_the_longest_path():
    # root p: token 1 well above the threshold (0.09 here), token 2 below it
    root = [0.05, 0.6, 0.05, 0.25, 0.05]
    assert root[3] > threshold(root) > root[2]
    node = [0.1, 0.1, 0.1, 0.1, 0.6]  # at nodes 1..: token 4 likely
    # nodes: 0 root, 1 = [0] token 2 (rejected), 2 = [1] token 3 (accepted), 3 = [0, 0] token 4, 4 = [1, 0] token 4
    logits = probs_to_logits([root, node, node, node, node])
    candidates, verified = step([[0], [1], [0, 0], [1, 0]], [0, 2, 3, 4, 4], logits)
    out = typical(candidates, verified, GREEDY)
    assert out.nodes.tolist() == [0, 2, 4]  # rank 0 is rejected, rank 1 and its child are accepted
    assert out.tokens == [3, 4, 4]  # + the argmax at node 4 when not sampling


def test_typical_breaks_ties_by_likelihood_and_uses_the_settings():
    root = [0.1, 0.3, 0.5, 0.05, 0.05]
    logits = probs_to_logits([root] * 3)
    candidates, verified = step([[0], [1]], [0, 1, 2], logits)
    assert typical(candidates, verified, GREEDY).nodes.tolist() == [0, 2]  # both accepted: the likelier one
    strict = SamplingConfig(posterior_threshold=0.4, posterior_alpha=10.0)  # threshold 0.4: only token 2 passes
    assert typical(candidates, verified, strict).tokens[0] == 2
    none = SamplingConfig(posterior_threshold=0.9, posterior_alpha=10.0)
    out = typical(candidates, verified, none)
    assert out.nodes.tolist() == [0] and out.tokens == [2]  # nothing accepted: the bonus is the argmax


def test_typical_accepts_anything_under_a_uniform_target():
    logits = torch.zeros(3, 50)  # H = log 50: threshold = 0.3 / 50 < 1 / 50
    out = typical(*step(chain(2), [0, 17, 33], logits), GREEDY)
    assert out.nodes.tolist() == [0, 1, 2]


def test_typical_samples_its_bonus_from_the_shaped_p():
    sampling = SamplingConfig(do_sample=True, temperature=0.7, top_p=0.9, posterior_threshold=0.9, posterior_alpha=0.0)
    logits = random_logits(2, 6, seed=7)
    candidates, verified = step(chain(1), [0, 1], logits)  # threshold 0: the child is accepted if p(1) > 0
    generator = torch.Generator().manual_seed(0)
    outs = [typical(candidates, verified, sampling, generator) for _ in range(3000)]
    p = target_probs(logits, sampling)
    last = 1 if p[0, 1] > 0 else 0
    assert all(o.nodes.tolist()[-1] == last for o in outs)
    counts = torch.bincount(torch.tensor([o.tokens[-1] for o in outs]), minlength=6)
    assert chi_square(counts, p[last])["p_value"] > SIGNIFICANCE


def test_greedy_tokens_of_bf16_logits_are_bf16_argmax_ties_included():
    torch.manual_seed(0)
    logits = torch.randn(5, 300).bfloat16()
    logits[1, 7] = logits[1, 200] = logits[1].max() + 1  # a tie: the first index wins
    assert torch.equal(greedy_tokens(logits), logits.argmax(-1))
    assert int(greedy_tokens(logits)[1]) == 7
