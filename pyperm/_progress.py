"""Optional tqdm progress bars for long library calls (off unless the caller asks)."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("pyperm")


def progress_bar(enabled: bool, total: int | None, desc: str, unit: str) -> Any:
    """A tqdm bar when ``enabled`` and tqdm is installed, else None (with a logged warning)."""
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        logger.warning("progress=True needs tqdm (pip install tqdm); continuing without a progress bar")
        return None
    return tqdm(total=total, desc=desc, unit=unit)
