"""Colours and ordering shared by every view, so an op class looks the same in the terminal,
the chart, the timeline and the dataflow diagrams."""
from __future__ import annotations

CLASS_ORDER = ["matmul", "attention", "pointwise", "reduction", "norm", "data_movement", "communication", "view", "other"]

# Muted, colour-blind-friendly hues (Okabe-Ito inspired); compute-bound classes are blues/purples,
# memory-bound classes warm, so the chart reads "how much is memory-bound" at a glance.
CLASS_COLORS = {
    "matmul": "#3b6ea8",
    "attention": "#7b61b0",
    "pointwise": "#e08a2e",
    "reduction": "#2f9e74",
    "norm": "#d1495b",
    "data_movement": "#8c6d46",
    "communication": "#4d4d4d",
    "view": "#9aa5b1",
    "other": "#b8a631",
}

CLASS_LABELS = {"data_movement": "data movement"}

# Candidates get their own palette (the timeline's highlight lane); chosen to stay apart from
# each other, not from the class colours, since the two never share a lane.
CANDIDATE_COLORS = ["#0072b2", "#d55e00", "#009e73", "#cc79a7", "#e69f00", "#56b4e9", "#8e44ad",
                    "#c0392b", "#16a085", "#7f8c8d"]


def class_color(cls) -> str:
    return CLASS_COLORS.get(str(cls), CLASS_COLORS["other"])


def class_label(cls) -> str:
    return CLASS_LABELS.get(str(cls), str(cls))


def candidate_color(index: int) -> str:
    return CANDIDATE_COLORS[index % len(CANDIDATE_COLORS)]


def ordered_classes(by_class: dict) -> list:
    """Known classes in the canonical order, then anything unexpected the analyser emitted."""
    keys = list(by_class or {})
    return [c for c in CLASS_ORDER if c in keys] + sorted(k for k in keys if k not in CLASS_ORDER)
