"""speculation.tree.choices: one judge of a static tree shape (engine.json, the operator, the
engine), each rule seen refusing the shape that breaks it and only that one."""
import pytest
from hypothesis import given, settings, strategies as st
from specfleet_api.tree_shape import TREE_CHOICE_LENGTH_MAX, TREE_CHOICE_RANK_MAX, TREE_CHOICES_MAX, shape_problems

MEDUSA = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
W = "speculation.tree.choices"


@pytest.mark.parametrize("choices, branching, depth", [
    ([], 1, 0), ((), 1, 1), ([[0]], 1, 0), ([[0], [0, 0], [0, 0, 0]], 1, 3), (MEDUSA, 3, 0), (MEDUSA, 3, 3),
    ((((0,), (1,), (1, 0))), 2, 2), ([[r] for r in range(TREE_CHOICE_RANK_MAX + 1)], TREE_CHOICE_RANK_MAX + 1, 1),
    ([[0] * n for n in range(1, TREE_CHOICE_LENGTH_MAX + 1)], 1, 0),
])
def test_valid_shapes_pass(choices, branching, depth):
    assert shape_problems(choices, branching, depth) == []


@pytest.mark.parametrize("choices, branching, depth, problem", [
    ([[0], [1]], 1, 0, f"{W}[1] [1]: rank 1 is not below speculation.tree.branching (1)"),
    (MEDUSA, 2, 0, f"{W}[2] [2]: rank 2 is not below speculation.tree.branching (2)"),
    ([[0], [0, 0], [0, 0, 0]], 1, 2, f"{W}[2] [0, 0, 0]: 3 ranks, longer than speculation.tree.depth (2)"),
    ([[0], [1], [0]], 2, 0, f"{W}[2] [0]: listed twice (first as {W}[0])"),
    ([[0], [1, 0]], 2, 0, f"{W}[1] [1, 0]: its prefix [1] is not listed"),
    ([[0], [0, 0, 0]], 1, 0, f"{W}[1] [0, 0, 0]: its prefix [0, 0] is not listed"),
    ([[1, 0, 0]], 2, 0, f"{W}[0] [1, 0, 0]: its prefixes [1], [1, 0] are not listed"),
    ([[0], [2]], 3, 0, f"{W}[1] [2]: its sibling [1] is not listed (siblings are tried in rank order)"),
    ([[0], [0, 2]], 3, 0, f"{W}[1] [0, 2]: its siblings [0, 0], [0, 1] are not listed (siblings are tried in rank "
                          "order)"),
    ([[0], [-1]], 2, 0, f"{W}[1] [-1]: rank -1 is not between 0 and {TREE_CHOICE_RANK_MAX}"),
    ([[0], []], 1, 0, f"{W}[1] []: a path holds 1 to {TREE_CHOICE_LENGTH_MAX} ranks, got 0"),
    ([[0] * n for n in range(1, TREE_CHOICE_LENGTH_MAX + 2)], 1, 0,
     f"{W}[16] {[0] * 17}: a path holds 1 to {TREE_CHOICE_LENGTH_MAX} ranks, got 17"),
])
def test_each_rule_refuses_its_shape_naming_the_path(choices, branching, depth, problem):
    assert shape_problems(choices, branching, depth) == [problem]


def test_a_rank_past_the_bounds_is_named_once_not_as_a_branching_problem_too():
    assert shape_problems([[r] for r in range(TREE_CHOICE_RANK_MAX + 1)] + [[9]], 8, 0) == [
        f"{W}[8] [9]: rank 9 is not between 0 and {TREE_CHOICE_RANK_MAX}"]


def test_at_most_64_paths():
    # 8 roots, and 8 children under each of the first 7
    full = [[r] for r in range(8)] + [[p, r] for p in range(7) for r in range(8)]
    assert len(full) == TREE_CHOICES_MAX and shape_problems(full, 8, 0) == []
    assert shape_problems(full + [[7, 0]], 8, 0) == [f"{W} holds at most {TREE_CHOICES_MAX} paths, got 65"]


def test_the_engine_may_name_its_own_argument():
    assert shape_problems(((0,), (2,)), 3, 0, where="tree_choices") == [
        "tree_choices[1] [2]: its sibling [1] is not listed (siblings are tried in rank order)"]


def closed(paths):
    """`paths` with every proper prefix and every lower sibling added: a valid shape's nodes."""
    out = set()
    for path in paths:
        for n in range(1, len(path) + 1):
            out |= {path[:n - 1] + (r,) for r in range(path[n - 1] + 1)}
    return sorted(out, key=lambda p: (len(p), p))


paths = st.lists(st.tuples(st.integers(0, 3)) | st.lists(st.integers(0, 3), min_size=1, max_size=4).map(tuple),
                 min_size=1, max_size=5)


@settings(max_examples=200, deadline=None)
@given(paths, st.data())
def test_a_node_may_go_exactly_when_nothing_listed_needs_it(drawn, data):
    """In a valid shape, dropping a node keeps it valid iff the node is no listed path's prefix
    and no listed node's lower sibling: the definition, checked against the judge."""
    shape = closed(drawn)
    branching, depth = max(r for p in shape for r in p) + 1, max(map(len, shape))
    assert shape_problems(shape, branching, depth) == []
    gone = data.draw(st.sampled_from(shape))
    rest = [p for p in shape if p != gone]
    needed = any(p[:len(gone)] == gone and len(p) > len(gone) for p in rest) or \
        any(len(p) == len(gone) and p[:-1] == gone[:-1] and p[-1] > gone[-1] for p in rest)
    assert (shape_problems(rest, branching, depth) == []) == (not needed)
    assert shape_problems(shape + [gone], branching, depth) == [f"{W}[{len(shape)}] {list(gone)}: listed twice "
                                                                f"(first as {W}[{shape.index(gone)}])"]
