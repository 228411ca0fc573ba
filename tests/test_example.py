"""The digits example trains to >= 95% test accuracy on a real Ray cluster."""

from __future__ import annotations

import pytest

import digits

pytestmark = pytest.mark.slow


def test_digits_reaches_95_percent(ray_cluster):
    acc = digits.main(["--no-progress", "--workers", "2", "--spares", "1", "--name", "digits-test"])
    assert acc >= 0.95


def test_docstring_starts_with_both_launch_commands():
    doc = digits.__doc__
    assert "python examples/digits.py" in doc
    assert "ray job submit --working-dir . -- python examples/digits.py" in doc
