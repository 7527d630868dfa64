"""Exit codes of the ``meshnode`` CLI (stable; scripts rely on them).

One table, from sysexits(3), used by every command::

    code  name              meaning
    0     EX_OK             done
    1     EX_CHECK_FAILED   it ran and the answer is no: a signature did not verify, the
                            called agent answered ``failed``, the mesh refused (§12 error)
    64    EX_USAGE          the command line is wrong (argparse errors, conflicting options,
                            a parameter the daemon refused: InvalidParameter, InvalidRequest)
    65    EX_DATAERR        the input is not what the command needs (not JSON, not an
                            envelope), or names nothing the daemon knows (NotFound, Conflict)
    66    EX_NOINPUT        a file the command needs could not be read
    69    EX_NOT_RUNNING    unavailable: no daemon serves the admin socket, or it went away
    70    EX_ERROR          a true internal error (the daemon's Internal, or an error name
                            the CLI does not know)
    73    EX_CANTCREAT      an output file could not be created
    75    EX_TEMPFAIL       try again later: the daemon is not ready, or did not answer in time
    76    EX_API_MISMATCH   the daemon speaks another admin API version (or the method is unknown)
    77    EX_NOPERM         not allowed: cannot open the admin socket, or the call needs a higher level
    78    EX_CONFIG         the configuration is invalid, or the mesh refuses this node for good
                            (retired, unknown to it, its invite expired): a restart changes
                            nothing (systemd: RestartPreventExitStatus=78)
    79    EX_LOOP_BLOCKED   meshnode's own, past sysexits: the daemon runs but its event loop is
                            blocked now (a handler that does not yield); ``status`` printed the
                            last snapshot and who blocks, from the status socket
    130                     interrupted (Ctrl-C) while following something

:func:`meshnode.admin.client.exit_code_for` maps each admin failure to its row.
They live beside the admin client, below the CLI, because the client maps each
admin failure to its exit code; :mod:`meshnode.cli.exitcodes` re-exports them
for the command modules.
"""

EX_OK = 0
#: A check ran and said no (e.g. a signature did not verify, a call answered failed).
EX_CHECK_FAILED = 1
#: The command line itself was wrong (argparse exits with this too: see ``meshnode.cli``).
EX_USAGE = 64
#: The input data was not what the command needs (not JSON, not an envelope), or named nothing known.
EX_DATAERR = 65
#: A file the command needs could not be read.
EX_NOINPUT = 66
#: The configuration is invalid (systemd: RestartPreventExitStatus=78).
EX_CONFIG = 78
#: The daemon is not running (no admin socket, or nothing listening on it).
EX_NOT_RUNNING = 69
#: A true internal error (the daemon's Internal, or an admin error the CLI cannot classify).
EX_ERROR = 70
#: Try again later: the daemon is not ready, or did not answer in time.
EX_TEMPFAIL = 75
#: The daemon speaks another admin API version, or not our protocol at all.
EX_API_MISMATCH = 76
#: Not allowed: cannot open the admin socket, or the call needs a higher level.
EX_NOPERM = 77
#: The daemon's event loop is blocked now (``status`` answered from the status socket).
EX_LOOP_BLOCKED = 79
EX_CANTCREAT = 73
"""An output file could not be created."""
#: Interrupted by the user (128 + SIGINT) while following a task or a subscription.
EX_INTERRUPTED = 130
