"""Exit codes of the ``meshnode`` CLI (stable; scripts rely on them)."""

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
