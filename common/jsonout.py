"""Strict JSON for every line and file mfgserve writes for machines to read.

``json.dumps`` writes ``NaN`` / ``Infinity`` for non-finite floats, which is not JSON: strict
parsers (``jq``, JavaScript, Go) reject the whole line. :func:`dumps_strict` writes ``null``
for them instead and refuses anything else that is not JSON (``allow_nan=False``).
"""

from __future__ import annotations

import json
import math
from typing import Any


def finite_or_none(obj: Any) -> Any:
    """``obj`` with every non-finite float (NaN, +-inf) in nested dicts/lists replaced by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    return obj


def dumps_strict(obj: Any, **kwargs: Any) -> str:
    """``json.dumps`` that writes non-finite floats as ``null``: the output is always valid
    JSON. Other keyword arguments go to ``json.dumps``."""
    return json.dumps(finite_or_none(obj), allow_nan=False, **kwargs)
