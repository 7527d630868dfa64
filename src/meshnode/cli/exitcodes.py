"""Exit codes of the ``meshnode`` CLI: defined, with the table scripts rely on,
in :mod:`meshnode.admin.exitcodes` (the admin client maps failures to them, and
sits below the CLI)."""

from meshnode.admin.exitcodes import (
    EX_API_MISMATCH,
    EX_CANTCREAT,
    EX_CHECK_FAILED,
    EX_CONFIG,
    EX_DATAERR,
    EX_ERROR,
    EX_INTERRUPTED,
    EX_LOOP_BLOCKED,
    EX_NOINPUT,
    EX_NOPERM,
    EX_NOT_RUNNING,
    EX_OK,
    EX_TEMPFAIL,
    EX_USAGE,
)

__all__ = [
    "EX_API_MISMATCH",
    "EX_CANTCREAT",
    "EX_CHECK_FAILED",
    "EX_CONFIG",
    "EX_DATAERR",
    "EX_ERROR",
    "EX_INTERRUPTED",
    "EX_LOOP_BLOCKED",
    "EX_NOINPUT",
    "EX_NOPERM",
    "EX_NOT_RUNNING",
    "EX_OK",
    "EX_TEMPFAIL",
    "EX_USAGE",
]
