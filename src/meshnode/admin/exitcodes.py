"""Exit codes of the ``meshnode`` CLI (stable; scripts rely on them).

They live beside the admin client, below the CLI, because the client maps each
admin failure to its exit code (:func:`meshnode.admin.client.exit_code_for`);
:mod:`meshnode.cli.exitcodes` re-exports them for the command modules.
"""

EX_OK = 0
#: A check ran and said no (e.g. a signature did not verify).
EX_CHECK_FAILED = 1
#: The command line itself was wrong.
EX_USAGE = 2
#: The input data was not what the command needs (not JSON, not an envelope).
EX_DATAERR = 65
#: A file the command needs could not be read.
EX_NOINPUT = 66
#: The configuration is invalid (systemd: RestartPreventExitStatus=78).
EX_CONFIG = 78
#: The daemon is not running (no admin socket, or nothing listening on it).
EX_NOT_RUNNING = 69
#: The daemon failed the request (an admin API error not covered below).
EX_ERROR = 70
#: Try again later: the daemon is not ready, or did not answer in time.
EX_TEMPFAIL = 75
#: The daemon speaks another admin API version, or not our protocol at all.
EX_API_MISMATCH = 76
#: Not allowed: cannot open the admin socket, or the call needs a higher level.
EX_NOPERM = 77
EX_CANTCREAT = 73
"""An output file could not be created."""
