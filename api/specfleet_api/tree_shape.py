"""speculation.tree.choices: a static draft-tree shape (Medusa's and EAGLE's "choices", vLLM's
speculative_token_tree), judged here once for engine.json, the operator and the engine. Torch-free.

A path is the sibling ranks from the root: (0,) is the root's first (most likely) child, (1,) its
second, (0, 2) the third child of (0,). A shape is the paths of the nodes a step may verify at
most; the cost-aware policy still picks its budget below it. A valid shape is prefix-closed (a
node's parent is listed) and sibling-contiguous (rank r > 0 needs rank r - 1 beside it):
verification tries siblings in rank order and sampling draws them without replacement, so a
skipped rank would break the exact rejection sampling.
"""

from __future__ import annotations

from collections.abc import Sequence

from .enums import TREE_BRANCHING_MAX, TREE_DEPTH_MAX

#: The CRD's bounds (checked by a test): paths in a shape, ranks in a path, and the highest rank.
TREE_CHOICES_MAX = 64
TREE_CHOICE_LENGTH_MAX = TREE_DEPTH_MAX
TREE_CHOICE_RANK_MAX = TREE_BRANCHING_MAX - 1

Shape = tuple[tuple[int, ...], ...]


def shape_problems(choices: Sequence[Sequence[int]], branching: int, depth: int,
                   where: str = "speculation.tree.choices", k_max: int = 0) -> list[str]:
    """Every way `choices` is not a shape the engine may verify under the caps `branching`
    (children per node) and `depth` (levels; 0: no cap), and `k_max` (speculation.kMax, the most
    levels a step drafts; 0: not checked), one message per path and rule, each naming the path as
    `where[i] [ranks]`; [] when valid (an empty shape is: no static shape).

    >>> shape_problems([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]], branching=3, depth=0)
    []
    >>> for p in shape_problems([[0], [0, 1], [1, 0, 0], [3], [0]], branching=3, depth=2): print(p)
    speculation.tree.choices[1] [0, 1]: its sibling [0, 0] is not listed (siblings are tried in rank order)
    speculation.tree.choices[2] [1, 0, 0]: 3 ranks, longer than speculation.tree.depth (2)
    speculation.tree.choices[2] [1, 0, 0]: its prefixes [1], [1, 0] are not listed
    speculation.tree.choices[3] [3]: rank 3 is not below speculation.tree.branching (3)
    speculation.tree.choices[3] [3]: its siblings [1], [2] are not listed (siblings are tried in rank order)
    speculation.tree.choices[4] [0]: listed twice (first as speculation.tree.choices[0])
    >>> shape_problems([[0], [0, 0], [0, 0, 0]], branching=1, depth=0, k_max=2)
    ['speculation.tree.choices[2] [0, 0, 0]: 3 ranks, deeper than speculation.kMax (2): a step drafts at most kMax levels, so its last node would never be drafted']
    """
    out = []
    if len(choices) > TREE_CHOICES_MAX:
        out.append(f"{where} holds at most {TREE_CHOICES_MAX} paths, got {len(choices)}")
    paths = [tuple(p) for p in choices]
    first = {}
    for i, path in enumerate(paths):
        first.setdefault(path, i)
    for i, path in enumerate(paths):
        name = f"{where}[{i}] {list(path)}"
        if not 1 <= len(path) <= TREE_CHOICE_LENGTH_MAX:
            out.append(f"{name}: a path holds 1 to {TREE_CHOICE_LENGTH_MAX} ranks, got {len(path)}")
        wild = next((r for r in path if not 0 <= r <= TREE_CHOICE_RANK_MAX), None)
        if wild is not None:
            out.append(f"{name}: rank {wild} is not between 0 and {TREE_CHOICE_RANK_MAX}")
        over = next((r for r in path if branching <= r <= TREE_CHOICE_RANK_MAX), None)
        if over is not None:
            out.append(f"{name}: rank {over} is not below speculation.tree.branching ({branching})")
        if depth > 0 and len(path) > depth:
            out.append(f"{name}: {len(path)} ranks, longer than speculation.tree.depth ({depth})")
        elif k_max > 0 and len(path) > k_max:
            out.append(f"{name}: {len(path)} ranks, deeper than speculation.kMax ({k_max}): a step drafts at "
                       f"most kMax levels, so its last node would never be drafted")
        if first[path] != i:
            out.append(f"{name}: listed twice (first as {where}[{first[path]}])")
            continue
        missing = [list(path[:n]) for n in range(1, len(path)) if path[:n] not in first]
        if missing:
            out.append(f"{name}: its prefix{'es' * (len(missing) > 1)} {', '.join(map(str, missing))} "
                       f"{'are' if len(missing) > 1 else 'is'} not listed")
        if path and path[-1] > 0:
            gaps = [list(path[:-1] + (r,)) for r in range(min(path[-1], TREE_CHOICE_RANK_MAX + 1))
                    if path[:-1] + (r,) not in first]
            if gaps:
                out.append(f"{name}: its sibling{'s' * (len(gaps) > 1)} {', '.join(map(str, gaps))} "
                           f"{'are' if len(gaps) > 1 else 'is'} not listed (siblings are tried in rank order)")
    return out
