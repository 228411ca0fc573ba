"""The benchmarks' JSON lines: one per figure, a number or null with a word why, and valid JSON."""

from __future__ import annotations

import io
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))


@pytest.fixture
def lines(monkeypatch):
    import common

    out = io.StringIO()
    monkeypatch.setattr(common, "_FIGURES", out)
    def strict(constant):  # json.loads takes NaN and Infinity, which no other JSON reader does
        pytest.fail(f"not JSON: {constant}")

    return lambda: [json.loads(line, parse_constant=strict) for line in out.getvalue().splitlines()]


def test_a_figure_is_a_number_or_null_with_a_word_why(lines):
    from common import emit

    emit("a", 1.5, "s", n=3)
    emit("b", None, "bytes")  # a null with no word read like a result
    emit("c", float("nan"), "ratio", caveat="kept")
    emit("d", None, "ratio", value_note="no ratio: a lost time is not positive")
    a, b, c, d = lines()
    assert a == {"figure": "a", "value": 1.5, "unit": "s", "n": 3}
    assert b["value"] is None and "not measured" in b["value_note"]
    assert c["value"] is None and "not a finite number (nan)" in c["value_note"] and c["caveat"] == "kept"
    assert d["value_note"] == "no ratio: a lost time is not positive"


def test_a_detail_that_is_no_finite_number_goes_out_as_null_not_invalid_json(lines):
    from common import emit

    emit("e", 2.0, "ratio", per_round=[1.0, float("nan")], nested={"x": float("inf")})
    (e,) = lines()
    assert e["per_round"] == [1.0, None] and e["nested"] == {"x": None}
