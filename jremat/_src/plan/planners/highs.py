"""What the HiGHS-based planners share (`milp.py`, `milp_values.py`): HiGHS prints its banner
from C, past Python's `sys.stdout`."""

from __future__ import annotations

import contextlib
import os
import sys


@contextlib.contextmanager
def quiet_stdout():
    """Silence file descriptor 1 (HiGHS's C-level banner) for the duration of the block."""
    sys.stdout.flush()
    saved = os.dup(1)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 1)
        try:
            yield
        finally:
            os.dup2(saved, 1)
            os.close(saved)
