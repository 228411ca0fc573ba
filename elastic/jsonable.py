"""JSON that strict parsers read: no NaN or Infinity, which ``json.dumps`` writes by default."""

from __future__ import annotations

import json
import math
from typing import Any


def finite(obj: Any) -> Any:
    """``obj`` with every float that is no finite number as None, through dicts, lists and tuples."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def strict_dumps(obj: Any) -> str:
    """``json.dumps`` of ``finite(obj)``, refusing what would still not be JSON; anything it
    cannot encode goes as its ``str``."""
    return json.dumps(finite(obj), default=str, allow_nan=False)
