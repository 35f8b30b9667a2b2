"""Trace arguments decoded in one place (advisor.ops.args): every spelling the execution trace and
Kineto's concrete inputs use becomes a Python value, and arguments bind to their schema names."""
from __future__ import annotations

import math

import pytest

from advisor.ops.args import NONE, TensorArg, Unrecorded, bind, decode, encode, parse_concrete, reduced_dims


@pytest.mark.parametrize("raw, value", [
    (NONE, None), (3, 3), (-1, -1), (0.5, 0.5), (True, True), ("floor", "floor"), ("cuda:0", "cuda:0"),
    ([0, -1], [0, -1]), ([], []), ("-inf", -math.inf), ("inf", math.inf),
    ("<Generator>", Unrecorded("Generator")), ("<ComplexDouble>", Unrecorded("ComplexDouble")),
])
def test_decode_each_spelling(raw, value):
    assert decode(raw) == value
    if not isinstance(value, Unrecorded):
        assert encode(value) == raw  # what a program holds round-trips


def test_decode_nan_and_concrete_text():
    assert math.isnan(decode("nan")) and encode(math.nan) == "nan"
    assert parse_concrete("") is None and parse_concrete("[0, 1]") == [0, 1] and parse_concrete("False") is False
    assert parse_concrete("cpu") == "cpu"


def test_bind_by_schema_name_with_defaults():
    # x.sum(): the recorded overload has no dim, only a dtype that was None.
    a = bind("aten::sum", "aten::sum(Tensor self, *, ScalarType? dtype=None) -> Tensor", [("t", 4), ("s", NONE)])
    assert a == {"self": TensorArg(4), "dtype": None} and a.get("dim") is None
    a = bind("aten::sum", "aten::sum.dim_IntList(Tensor self, int[1]? dim, bool keepdim=False, *, "
             "ScalarType? dtype=None) -> Tensor", [("t", 0), ("s", [-1])])
    assert a == {"self": TensorArg(0), "dim": [-1], "keepdim": False, "dtype": None}


def test_bind_without_a_recorded_schema_picks_the_overload_that_fits():
    a = bind("aten::softmax", "", [("t", 1), ("s", -1), ("s", NONE)])
    assert a["dim"] == -1 and a["dtype"] is None
    assert bind("mylib::unknown", "", [("t", 1)]) is None


@pytest.mark.parametrize("dim, ndim, dims", [
    (None, 3, (0, 1, 2)), ([], 2, (0, 1)), (-1, 3, (2,)), ([0, -1], 3, (0, 2)), ([2, -1], 3, (2,)), (0, 1, (0,)),
    (None, 0, ()),
])
def test_reduced_dims(dim, ndim, dims):
    assert reduced_dims(dim, ndim) == dims


def test_reduced_dims_refuses_what_is_not_a_dim():
    with pytest.raises(ValueError):
        reduced_dims("<", 2)
