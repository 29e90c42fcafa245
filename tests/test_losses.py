"""medusa/train/losses.py: which token each head is scored on, the fused chunked losses, weights and accuracies."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from medusa.heads import head_target_offset
from medusa.train.losses import (
    BASE_TARGET_OFFSET,
    base_kl_loss,
    head_targets,
    head_weights,
    linear_cross_entropy,
    linear_kl,
    medusa_heads_loss,
    scored_positions,
    shifted_targets,
    topk_correct,
)
from tests.conftest import HIDDEN, VOCAB, make_heads


def test_head_offset_on_a_hand_made_sequence():
    #            position: 0   1   2   3   4   5   6   7
    ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])  # the response starts at position 3
    assert head_target_offset(0) == 2 and head_target_offset(3) == 5 and BASE_TARGET_OFFSET == 1
    # Head 0 reads position t and is scored on token t+2, only where that token is a response token.
    targets, valid = head_targets(ids, mask, 0)
    assert valid.tolist() == [[False, True, True, True, True, True, False, False]]
    assert targets[valid].tolist() == [13, 14, 15, 16, 17]
    # Head 2 is scored on t+4: each (position, target) pair spelled out.
    targets, valid = head_targets(ids, mask, 2)
    assert [(t, int(targets[0, t])) for t in range(8) if valid[0, t]] == [(0, 14), (1, 15), (2, 16), (3, 17)]
    # The base's own next-token target.
    targets, valid = shifted_targets(ids, mask, BASE_TARGET_OFFSET)
    assert [(t, int(targets[0, t])) for t in range(8) if valid[0, t]] == [(2, 13), (3, 14), (4, 15), (5, 16), (6, 17)]


def test_targets_never_reach_padding_or_past_the_end():
    ids = torch.tensor([[5, 6, 7, 8, 0, 0], [5, 6, 7, 8, 9, 10]])
    mask = torch.tensor([[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]])  # row 0 is right-padded after 4 tokens
    targets, valid = head_targets(ids, mask, 1)  # offset 3
    assert valid.tolist() == [[True, False, False, False, False, False], [True, True, True, False, False, False]]
    assert targets[valid].tolist() == [8, 8, 9, 10]
    _, valid = shifted_targets(ids, mask, 6)  # the offset is the whole sequence: nothing to predict
    assert not valid.any()
    with pytest.raises(ValueError, match="offset must be positive"):
        shifted_targets(ids, mask, 0)


@pytest.mark.parametrize("length, response_start, offset", [(8, 3, 2), (8, 3, 5), (8, 1, 2), (4, 3, 5), (6, 6, 1)])
def test_scored_positions_counts_the_valid_targets(length, response_start, offset):
    mask = torch.zeros(1, length, dtype=torch.long)
    mask[0, response_start:] = 1
    _, valid = shifted_targets(torch.arange(length)[None], mask, offset)
    assert scored_positions(length, response_start, offset) == int(valid.sum())


def test_head_weights_decay():
    assert head_weights(4) == pytest.approx([1.0, 0.8, 0.64, 0.512])
    assert head_weights(3, decay=0.5, coefficient=0.2) == pytest.approx([0.2, 0.1, 0.05])


def test_topk_correct_on_fixed_logits():
    logits = torch.tensor(
        [
            [0.0, 3.0, 2.0, 1.0],  # target 1 is the argmax: top-1
            [0.0, 3.0, 2.0, 1.0],  # target 3 ranks third
            [5.0, 1.0, 1.0, 0.0],
        ]
    )  # target 2 ties with 1 for second place: counted as second
    correct = topk_correct(logits, torch.tensor([1, 3, 2]), topk=4)
    assert correct.tolist() == [1, 2, 3, 3]


@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_cross_entropy_matches_torch(with_bias):
    torch.manual_seed(0)
    x = torch.randn(37, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    b = torch.randn(50, requires_grad=True) if with_bias else None
    y = torch.randint(0, 50, (37,))
    loss, correct = linear_cross_entropy(x, w, y, b, chunk_size=8)  # 5 chunks, the last one short
    (0.5 * loss).backward()
    ours = [t.grad.clone() for t in (x, w, b) if t is not None]
    for t in (x, w, b):
        if t is not None:
            t.grad = None
    logits = x @ w.T + (b if b is not None else 0)
    reference = F.cross_entropy(logits, y, reduction="sum")
    (0.5 * reference).backward()
    torch.testing.assert_close(loss, reference.detach(), atol=1e-4, rtol=1e-5)
    for got, t in zip(ours, [t for t in (x, w, b) if t is not None]):
        torch.testing.assert_close(got, t.grad, atol=1e-5, rtol=1e-5)
    assert correct.tolist() == topk_correct(logits.detach(), y).tolist()


def test_fused_cross_entropy_in_bf16_is_close_and_returns_input_dtypes():
    torch.manual_seed(0)
    x = torch.randn(64, 32, requires_grad=True)
    w = torch.randn(40, 32) * 0.2
    y = torch.randint(0, 40, (64,))
    loss, _ = linear_cross_entropy(x, w, y, compute_dtype=torch.bfloat16, chunk_size=16)
    loss.backward()
    reference = F.cross_entropy(x.detach() @ w.T, y, reduction="sum")
    assert loss.dtype == torch.float32 and x.grad.dtype == torch.float32
    assert abs(loss.item() - reference.item()) / reference.item() < 1e-2


def test_fused_kl_matches_torch_with_a_constant_reference():
    torch.manual_seed(0)
    x, ref = torch.randn(21, 8, requires_grad=True), torch.randn(21, 8)
    w, b = torch.randn(30, 8, requires_grad=True), torch.randn(30, requires_grad=True)
    kl = linear_kl(x, ref, w, b, chunk_size=4)
    kl.backward()
    ours = [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    reference = F.kl_div(
        (x @ w.T + b).log_softmax(-1), (ref @ w.T + b).detach().log_softmax(-1), log_target=True, reduction="sum"
    )
    reference.backward()
    torch.testing.assert_close(kl, reference.detach(), atol=1e-4, rtol=1e-5)
    for got, t in zip(ours, (x, w, b)):
        torch.testing.assert_close(got, t.grad, atol=1e-5, rtol=1e-5)
    assert linear_kl(ref, ref, w.detach()).item() == pytest.approx(0.0, abs=1e-4)  # identical distributions


def assert_same_gradients(heads, loss, expected) -> None:
    """The fused loss's gradients agree with autograd through the naive computation."""
    loss.backward()
    ours = {n: p.grad.clone() for n, p in heads.named_parameters()}
    heads.zero_grad()
    expected.backward()
    for n, p in heads.named_parameters():
        torch.testing.assert_close(ours[n], p.grad, atol=1e-5, rtol=1e-4, msg=n)


@pytest.mark.parametrize("projection", ["shared", "own"])
def test_medusa_heads_loss_equals_the_naive_computation(projection):
    torch.manual_seed(0)
    heads = make_heads(num_heads=3, random=True, projection=projection)
    lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    hidden = torch.randn(2, 12, HIDDEN)
    ids = torch.randint(0, VOCAB, (2, 12))
    mask = torch.zeros(2, 12, dtype=torch.long)
    mask[0, 4:] = 1
    mask[1, 2:9] = 1  # row 1 is padded after 9 tokens
    out = medusa_heads_loss(heads, hidden, ids, mask, lm_head, decay=0.8, coefficient=0.5, chunk_size=5)
    logits = heads(hidden, lm_head)  # (K, B, T, V): every head at every position
    expected, counts = 0.0, []
    for k in range(3):
        off = head_target_offset(k)
        rows = [(b, t) for b in range(2) for t in range(12 - off) if mask[b, t + off]]
        ce = torch.stack([F.cross_entropy(logits[k, b, t], ids[b, t + off]) for b, t in rows]).mean()
        expected = expected + 0.5 * 0.8**k * ce
        torch.testing.assert_close(out.ce[k], ce.detach(), atol=1e-5, rtol=1e-5)
        counts.append(len(rows))
        top1 = sum(int(logits[k, b, t].argmax() == ids[b, t + off]) for b, t in rows)
        assert int(out.correct[k, 0]) == top1
    assert out.count.tolist() == counts
    torch.testing.assert_close(out.loss, expected, atol=1e-5, rtol=1e-5)
    assert_same_gradients(heads, out.loss, expected)


def test_distilled_heads_loss_is_the_kl_to_the_base_at_the_position_before_the_target():
    """distill: head k at t learns softmax(lm_head(hidden[t + offset - 1])), the base's distribution for its token."""
    torch.manual_seed(0)
    heads = make_heads(num_heads=3, random=True)
    heads.set_vocab_subset(torch.arange(0, VOCAB, 2))  # the teacher's softmax runs over the candidates too
    lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    hidden, ids = torch.randn(2, 12, HIDDEN), torch.randint(0, VOCAB, (2, 12))
    mask = torch.zeros(2, 12, dtype=torch.long)
    mask[0, 4:], mask[1, 2:9] = 1, 1
    out = medusa_heads_loss(heads, hidden, ids, mask, lm_head, chunk_size=5, candidates_only=True, distill=True)
    logits = heads(hidden, lm_head)[..., heads.vocab_subset]  # (K, B, T, V')
    teacher = lm_head(hidden)[..., heads.vocab_subset].log_softmax(-1)  # (B, T, V')
    expected = 0.0
    for k in range(3):
        off = head_target_offset(k)
        rows = [(b, t) for b in range(2) for t in range(12 - off) if mask[b, t + off]]
        kl = torch.stack(
            [
                F.kl_div(logits[k, b, t].log_softmax(-1), teacher[b, t + off - 1], log_target=True, reduction="sum")
                for b, t in rows
            ]
        ).mean()
        torch.testing.assert_close(out.ce[k], kl.detach(), atol=1e-5, rtol=1e-5)
        expected = expected + 0.8**k * kl
        hits = sum(int(heads.vocab_subset[logits[k, b, t].argmax()] == ids[b, t + off]) for b, t in rows)
        assert int(out.correct[k, 0]) == hits  # accuracy still counts the data's tokens
    torch.testing.assert_close(out.loss, expected, atol=1e-5, rtol=1e-5)
    assert_same_gradients(heads, out.loss, expected)
    with pytest.raises(ValueError, match="shared"):
        medusa_heads_loss(make_heads(num_heads=2, projection="own"), hidden, ids, mask, lm_head, distill=True)


def test_normalizer_turns_micro_batches_into_one_batch():
    """Summing micro-batch losses, each divided by the whole batch's counts, equals the loss of the whole batch."""
    torch.manual_seed(0)
    heads = make_heads(num_heads=2, random=True)
    lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    hidden, ids = torch.randn(4, 10, HIDDEN), torch.randint(0, VOCAB, (4, 10))
    mask = torch.zeros(4, 10, dtype=torch.long)
    for b, start in enumerate([2, 5, 7, 3]):  # unequal response lengths: a mean of means would differ
        mask[b, start:] = 1
    whole = medusa_heads_loss(heads, hidden, ids, mask, lm_head)
    norm = whole.count.float()
    parts = [
        medusa_heads_loss(heads, hidden[i : i + 1], ids[i : i + 1], mask[i : i + 1], lm_head, normalizer=norm)
        for i in range(4)
    ]
    torch.testing.assert_close(sum(p.loss for p in parts), whole.loss, atol=1e-5, rtol=1e-5)
    mean_of_means = (
        sum(
            medusa_heads_loss(heads, hidden[i : i + 1], ids[i : i + 1], mask[i : i + 1], lm_head).loss for i in range(4)
        )
        / 4
    )
    assert abs(mean_of_means.item() - whole.loss.item()) > 1e-3  # the test would notice plain averaging


def test_heads_without_any_scored_position_still_get_zero_gradients():
    heads = make_heads(num_heads=2, random=True)
    lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    ids = torch.randint(0, VOCAB, (1, 4))
    mask = torch.tensor([[0, 0, 0, 1]])  # head 1 (offset 3) has one position, a longer offset none
    out = medusa_heads_loss(make_heads(num_heads=3, random=True), torch.randn(1, 4, HIDDEN), ids, mask, lm_head)
    assert out.count.tolist() == [1, 1, 0] and out.ce[2] == 0
    out = medusa_heads_loss(heads, torch.randn(1, 2, HIDDEN), ids[:, :2], torch.tensor([[0, 1]]), lm_head)
    out.loss.backward()  # no head has a target: the loss is 0 and every parameter gets a (zero) gradient (DDP needs it)
    assert out.loss.item() == 0 and all(p.grad is not None and not p.grad.any() for p in heads.parameters())


def test_base_kl_is_zero_for_the_same_hidden_states_and_positive_otherwise():
    torch.manual_seed(0)
    lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    hidden, ids = torch.randn(2, 6, HIDDEN), torch.randint(0, VOCAB, (2, 6))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0]])
    kl, n = base_kl_loss(hidden, hidden, ids, mask, lm_head)
    assert kl.item() == pytest.approx(0, abs=1e-5) and int(n) == 4 + 3
    kl, _ = base_kl_loss(hidden + 0.5 * torch.randn_like(hidden), hidden, ids, mask, lm_head)
    assert kl.item() > 1e-3
