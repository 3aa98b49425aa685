"""JSON files of the command line and the reproductions: indented, with NaN and infinities written as null.

``json.dumps`` writes NaN as the bare token ``NaN``, which strict parsers (JavaScript's,
``jq``) refuse; a missing value (``float("nan")``, pyperm's one spelling of it) becomes
``null`` instead, which every parser reads.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pyperm._staging import write_text

__all__ = ["write_json"]


def write_json(path: Path, obj: Any) -> Path:
    """Write ``obj`` to ``path`` as indented json (non-finite floats as null), staged beside it and renamed into
    place (:mod:`pyperm._staging`); returns ``path``."""
    return write_text(Path(path), json.dumps(_finite(obj), indent=2) + "\n")


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj
