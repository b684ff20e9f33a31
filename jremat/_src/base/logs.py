"""`jremat.log_to_stderr`: turn on jremat's progress messages (the library is quiet by default).

Library modules log through `logging.getLogger(__name__)` under the "jremat" logger, which has
only a `NullHandler` until a program adds one: the CLI, the examples and the notebook call
`log_to_stderr()`; an application with its own logging setup gets jremat's records there.
"""

from __future__ import annotations

import logging
import sys

_FORMAT = "%(asctime)s jremat: %(message)s"


def log_to_stderr(level: int | str = logging.INFO) -> logging.Handler:
    """Print jremat's log records at `level` and above to stderr (`HH:MM:SS jremat: ...`).

    Idempotent: a second call changes the level of the handler the first added.

    Args:
      level: a `logging` level, as an int (`logging.INFO`) or its name ("DEBUG").

    Returns:
      The `logging.StreamHandler` attached to the "jremat" logger.

    Raises:
      ValueError: an unknown level name.
    """
    logger = logging.getLogger("jremat")
    if isinstance(level, str):
        named = logging.getLevelName(level.upper())
        if not isinstance(named, int):
            raise ValueError(f"log_to_stderr: unknown level {level!r}; accepted: DEBUG, INFO, ...")
        level = named
    handler = next((h for h in logger.handlers if getattr(h, "_jremat_stderr", False)), None)
    if handler is None:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
        handler._jremat_stderr = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    handler.setLevel(level)
    logger.setLevel(min(level, logger.level or level))
    return handler
