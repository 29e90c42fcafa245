"""Choosing a static tree: greedy growth by path value on a hand-made accuracy table, latency timing, the script."""

import itertools
import json

import pytest

from medusa import MedusaModel, TreeSpec, load_tree
from medusa.tree_builder import best_size, check_accuracy, expected_tau, grow_tree, measure_step_latency, path_value
from tests.conftest import make_heads, make_tiny_model, save_tiny_checkpoint
from tests.test_benchmark import load_script

# falls with rank (as real heads' accuracies do); values chosen so that no two paths tie
ACC = [[0.61, 0.17, 0.071], [0.43, 0.13, 0.052], [0.33, 0.097], [0.23]]


def all_paths(acc):
    ranks = [range(len(row)) for row in acc]
    return [p for n in range(1, len(acc) + 1) for p in itertools.product(*ranks[:n])]


def test_path_value_and_expected_tau_by_hand():
    acc = [[0.5, 0.2], [0.4]]
    assert path_value((0, 0), acc) == pytest.approx(0.2)
    assert expected_tau([[0], [1], [0, 0]], acc) == pytest.approx(1 + 0.5 + 0.2 + 0.5 * 0.4)
    assert expected_tau([], acc) == 1.0


def test_grow_tree_takes_the_highest_value_paths():
    paths = all_paths(ACC)
    ranked = sorted(paths, key=lambda p: path_value(p, ACC), reverse=True)
    assert len({round(path_value(p, ACC), 12) for p in paths}) == len(paths), "the table must have no ties"
    order = grow_tree(ACC, max_nodes=len(paths) + 1)
    assert len(order) == len(paths)
    for n in range(1, len(paths) + 1):
        assert set(order[:n]) == set(ranked[:n]), n
        TreeSpec([list(p) for p in order[:n]], num_heads=len(ACC))  # every prefix is a valid tree


def test_grow_tree_first_paths_by_hand():
    # values: [0] .61, [0,0] .2623, [1] .17, [0,1] .0793, [0,0,0] .0866, ...
    assert grow_tree(ACC, max_nodes=5) == [(0,), (0, 0), (1,), (0, 0, 0)]


def test_grow_tree_stays_valid_when_accuracy_rises_with_rank():
    acc = [[0.2, 0.5, 0.4], [0.1, 0.6], [0.3]]  # noisy estimates: rank 1 above rank 0
    order = grow_tree(acc, max_nodes=64)
    assert len(order) == len(all_paths(acc))
    for n in range(1, len(order) + 1):
        TreeSpec([list(p) for p in order[:n]])  # rank 1 never comes before rank 0, children never before parents


def test_grow_tree_limits():
    assert grow_tree(ACC, max_nodes=1) == []
    assert len(grow_tree(ACC, max_nodes=4)) == 3


@pytest.mark.parametrize("acc, message", [([], "non-empty"), ([[0.5], []], "head 1"), ([[1.5]], "outside")])
def test_check_accuracy_errors(acc, message):
    with pytest.raises(ValueError, match=message):
        check_accuracy(acc)


def test_best_size():
    taus = {1: 1.0, 4: 2.0, 8: 2.4}
    assert best_size(taus, {1: 10.0, 4: 12.0, 8: 20.0}) == 4
    assert best_size(taus, {1: 10.0, 4: 12.0, 8: 12.5}) == 8
    assert best_size({1: 1.0, 2: 1.01}, {1: 1.0, 2: 5.0}) == 2  # plain decoding is never "the tree"
    with pytest.raises(ValueError, match="at least 2 nodes"):
        best_size({1: 1.0}, {1: 1.0})


def test_measure_step_latency_on_a_tiny_model():
    model = MedusaModel(make_tiny_model("llama"), make_heads(random=True))
    trees = {1: [], 4: [list(p) for p in grow_tree(ACC, 4)]}
    latency = measure_step_latency(model, trees, kv_length=16, repeats=2, warmup=1)
    assert sorted(latency) == [1, 4]
    assert latency[1].heads_ms < latency[4].heads_ms  # no tree, no heads to run
    assert all(lat.verify_ms > 0 and lat.step_ms >= lat.verify_ms for lat in latency.values())


def test_build_tree_script(tmp_path, capsys):
    base_dir, heads_dir = save_tiny_checkpoint(tmp_path)
    acc_path, out = tmp_path / "acc.json", tmp_path / "tree.json"
    acc_path.write_text(json.dumps({"acc": ACC, "num_tokens": 100}))
    result = load_script("build_tree").main(
        [
            "--accuracy",
            str(acc_path),
            "--out",
            str(out),
            "--base",
            str(base_dir),
            "--heads",
            str(heads_dir),
            "--sizes",
            "2,4,8",
            "--repeats",
            "2",
            "--kv-length",
            "16",
            "--threads",
            "1",
        ]
    )
    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(result))
    assert written["num_nodes"] in (2, 4, 8) and len(written["paths"]) == written["num_nodes"] - 1
    assert written["expected_tau"] == pytest.approx(expected_tau(written["paths"], ACC))
    assert set(written["latency_ms"]) == {"1", "2", "4", "8"}
    assert load_tree(str(out)) == written["paths"]
    printed = capsys.readouterr().out
    assert "<- best" in printed and "exp. tau" in printed
    acc_path.write_text(json.dumps({"accuracy": ACC}))
    with pytest.raises(ValueError, match="no 'acc' key"):
        load_script("build_tree").main(["--accuracy", str(acc_path), "--out", str(out)])
