from pathlib import Path

import pytest
import torch

from medusa.tree import TreeSpec, buffers_from_parents, build_buffers, chain, load_tree

# The hand-drawn tree (node numbers in canonical order):
#            0 (root)
#          /   \
#     1 [0]     2 [1]
#     /   \        \
# 3 [0,0] 4 [0,1]  5 [1,0]
#    |
# 6 [0,0,0]
HAND_TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def test_hand_drawn_seven_node_tree():
    b = build_buffers(TreeSpec(HAND_TREE, num_heads=3), num_heads=3)
    assert b.num_nodes == 7
    assert b.depth.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert b.parent.tolist() == [0, 0, 0, 1, 1, 2, 3]
    # flat candidates: [root, head0 top-2, head1 top-2, head2 top-1]
    assert b.topk_per_head == (2, 2, 1)
    assert b.candidate_index.tolist() == [0, 1, 2, 3, 4, 3, 5]
    # leaves 4, 5, 6; paths padded with the sentinel 7
    assert b.leaf_paths.tolist() == [[0, 1, 4, 7], [0, 2, 5, 7], [0, 1, 3, 6]]
    visible = {i: set(torch.nonzero(b.visible[i]).flatten().tolist()) for i in range(7)}
    assert visible == {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 1, 4}, 5: {0, 2, 5}, 6: {0, 1, 3, 6}}
    bias = b.attention_bias(torch.float32, torch.device("cpu"))
    assert bias[6, 3] == 0 and bias[6, 2] == torch.finfo(torch.float32).min and bias[4, 3] < 0
    # the bias lands on the buffers' device (the CUDA regression, a CPU tensor filled by a CUDA mask, is caught by
    # test_greedy.py::test_cuda_greedy_identity on a GPU)
    assert b.to("meta").attention_bias(torch.float32, torch.device("meta")).device.type == "meta"


def test_spec_is_reordered_canonically():
    shuffled = [[0, 0, 0], [1, 0], [0], [0, 1], [1], [0, 0]]
    assert TreeSpec(shuffled).to_list() == HAND_TREE


@pytest.mark.parametrize(
    "paths, message",
    [
        ([[1]], "gap in ranks"),
        ([[0], [0, 2], [0, 1]], "gap in ranks"),
        ([[0, 0]], "no parent"),
        ([[0], [0]], "duplicate"),
        ([[0], []], "non-empty"),
        ([[0], [-1]], "non-negative"),
        ("0,1", "list of rank paths"),
    ],
)
def test_invalid_specs_are_named(paths, message):
    with pytest.raises(ValueError, match=message):
        TreeSpec(paths)


def test_depth_beyond_heads_is_named():
    with pytest.raises(ValueError, match="only 2 heads"):
        TreeSpec(chain(3), num_heads=2)


def test_root_only_tree():
    b = build_buffers(TreeSpec([]), num_heads=1)
    assert b.num_nodes == 1 and b.leaf_paths.tolist() == [[0]]


def test_shipped_tree_files_are_valid():
    from medusa.tree import TREES_DIR

    for path in TREES_DIR.glob("*.json"):
        assert load_tree(path), path


def test_shipped_trees_are_package_data_found_by_name_from_anywhere(tmp_path, monkeypatch):
    """Shipped trees live inside the package (so a wheel carries them); a name finds them whatever the working
    directory, and a path to a user's file still works."""
    import medusa
    from medusa.tree import TREES_DIR

    assert TREES_DIR.parent == Path(medusa.__file__).parent
    names = sorted(p.stem for p in TREES_DIR.glob("*.json"))
    assert {"smollm2-135m-cpu", "smollm2-135m-cpu-bf16", "smollm2-135m-h100-bf16"} <= set(names)
    monkeypatch.chdir(tmp_path)
    for name in names:
        assert load_tree(name) == load_tree(TREES_DIR / f"{name}.json"), name
    (tmp_path / "mine.json").write_text('{"paths": [[0], [1], [0, 0]]}')
    assert load_tree("mine.json") == load_tree(tmp_path / "mine.json") == [[0], [1], [0, 0]]


def test_unknown_tree_name_lists_alternatives():
    with pytest.raises(FileNotFoundError, match="not found"):
        load_tree("no-such-tree")


# ------------------------------------------------------------------ trees from a parent array (per-step trees)
# root 0; 1 and 2 under the root; 3 under 1; 4 under 3
HAND_PARENT = [0, 0, 0, 1, 3]
HAND_DEPTH = [0, 1, 1, 2, 3]
HAND_VISIBLE = [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]]
HAND_LEAF_PATHS = [[0, 2, 5, 5], [0, 1, 3, 4]]  # leaves in node order, padded with N = 5


def test_buffers_from_parents_hand_drawn_tree():
    tree = buffers_from_parents(torch.tensor(HAND_PARENT))
    assert tree.num_nodes == 5
    assert tree.visible.long().tolist() == HAND_VISIBLE
    assert tree.leaf_paths.tolist() == HAND_LEAF_PATHS
    assert tree.max_depth == 3
    assert tree.parent.tolist() == HAND_PARENT and tree.depth.tolist() == HAND_DEPTH


def test_buffers_from_parents_root_only():
    tree = buffers_from_parents([0])
    assert tree.num_nodes == 1 and tree.leaf_paths.tolist() == [[0]] and tree.visible.tolist() == [[True]]


@pytest.mark.parametrize(
    "paths",
    [
        chain(3),
        [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]],
        [[0], [1], [0, 0], [0, 1], [1, 0], [1, 1], [0, 0, 0], [1, 0, 0]],
    ],
)
def test_buffers_from_parents_match_the_static_builder(paths):
    static = build_buffers(TreeSpec(paths))
    dynamic = buffers_from_parents(static.parent)
    assert dynamic.num_nodes == static.num_nodes
    for name in ("visible", "depth", "parent", "leaf_paths"):
        assert torch.equal(getattr(dynamic, name), getattr(static, name)), name


def test_buffers_from_parents_are_built_once_per_shape_and_refuse_a_bad_order():
    assert buffers_from_parents([0, 0, 1]) is buffers_from_parents(torch.tensor([0, 0, 1]))
    for bad in ([], [1, 0], [0, 2, 0], [0, 0, 2]):
        with pytest.raises(ValueError, match="parents must start with the root"):
            buffers_from_parents(bad)
