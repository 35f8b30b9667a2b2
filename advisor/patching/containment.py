"""Whether one pattern holds another: the matcher finds the shorter pattern's program inside the longer
one's program graph (same ops, literals, shapes and dataflow, no intermediate of the shorter escaping).

Where both patterns occur at the same ops of a captured graph, the first substituted takes them and the
other is then found nowhere there. The trace gives such a site to the longer pattern (BART's embedding
scale `mul` -> `add` -> `layer_norm`, beside the residual `add` -> `layer_norm` of every layer; ConvNeXt's
layer scale `mul` -> residual `add` -> the next stage's `layer_norm`, beside the `mul` -> `add` of every
block), so the substitution order puts a pattern before those it holds (`workflows/kernels.py`).
"""
from __future__ import annotations

import json
from functools import lru_cache

from advisor.patching.match import Pattern, find
from advisor.patching.plan import PatternSpec
from advisor.patching.program import program_graph


def holds(outer: PatternSpec, inner: PatternSpec) -> bool:
    """Whether `inner` is found inside `outer`'s program, at some shape of each."""
    for program, _ in outer.shapes():
        graph = _graph(_key(program))
        if graph is None:
            continue
        for small, _ in inner.shapes():
            pattern = _pattern(_key(small))
            if pattern is not None and find(pattern, graph.graph) is not None:
                return True
    return False


def _key(program: dict) -> str:
    return json.dumps(program, sort_keys=True, default=str)


@lru_cache(maxsize=256)
def _graph(key: str):
    try:
        return program_graph(json.loads(key), "cpu")  # fake tensors: the device only has to be the same on both sides
    except Exception:  # a program that does not trace holds nothing here: the order stays as ranked
        return None


@lru_cache(maxsize=256)
def _pattern(key: str) -> Pattern | None:
    gm = _graph(key)
    if gm is None:
        return None
    try:
        return Pattern.build(json.loads(key), gm)
    except ValueError:  # not connected through dataflow: the capture never matches it either
        return None
