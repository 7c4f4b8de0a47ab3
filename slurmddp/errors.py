"""One-line user errors: what was wrong and what to do, exit status 2, no traceback."""

from __future__ import annotations

import sys
from typing import NoReturn

USAGE_ERROR = 2


def fail(message: str, *, prog: str = "slurmddp", status: int = USAGE_ERROR) -> NoReturn:
    """Print ``prog: error: message`` on stderr and exit with `status`."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(status)
