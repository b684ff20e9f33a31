"""`jremat.log_to_stderr`: turn on jremat's progress messages (the library is quiet by default).

Library modules log through `logging.getLogger(__name__)` under the "jremat" logger, which has
only a `NullHandler` until a program adds one: the CLI, the examples and the notebook call
`log_to_stderr()`; an application with its own logging setup gets jremat's records there.
"""

from __future__ import annotations

import logging
import sys

_FORMAT = "%(asctime)s jremat: %(message)s"


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is at the time of each record (pytest, notebooks and
    `contextlib.redirect_stderr` replace it)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ / setStream assign it
        pass


def log_to_stderr(level: int | str = logging.INFO) -> logging.Handler:
    """Print jremat's log records at `level` and above to stderr (`HH:MM:SS jremat: ...`).

    Idempotent: a second call changes the level of the handler the first added.

    Args:
      level: a `logging` level, as an int (`logging.INFO`) or its name ("DEBUG").

    Returns:
      The `logging.StreamHandler` attached to the "jremat" logger.

    Raises:
      ValueError: an unknown level name.

    Examples:
      >>> import logging, jremat
      >>> logger = logging.getLogger("jremat")
      >>> level_before = logger.level
      >>> handler = jremat.log_to_stderr("DEBUG")
      >>> handler.level == logging.DEBUG
      True
      >>> jremat.log_to_stderr() is handler, handler.level == logging.INFO  # the same handler
      (True, True)
      >>> logger.removeHandler(handler)  # quiet again
      >>> logger.setLevel(level_before)
    """
    logger = logging.getLogger("jremat")
    if isinstance(level, str):
        named = logging.getLevelName(level.upper())
        if not isinstance(named, int):
            raise ValueError(f"log_to_stderr: unknown level {level!r}; accepted: DEBUG, INFO, ...")
        level = named
    handler = next((h for h in logger.handlers if isinstance(h, _StderrHandler)), None)
    if handler is None:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
        logger.addHandler(handler)
    handler.setLevel(level)
    logger.setLevel(min(level, logger.level or level))
    return handler
