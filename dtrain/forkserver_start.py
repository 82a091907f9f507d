"""Imported only by the workers' fork server, first of :data:`dtrain.workers.PRELOAD`: a Ctrl-C while the server
imports torch ends it at once, quietly.

The server runs in the terminal's process group, so Ctrl-C reaches it as it reaches the launching process; Python's
own handler would raise KeyboardInterrupt inside the preload's imports and print their traceback. Here SIGINT ends
the server with status 130 and nothing printed; the launching process says the one line. The launching process
starts the server with SIGINT blocked (:func:`dtrain.workers.start_fork_server`), so that a Ctrl-C before this
module runs waits for this handler; unblocking it here delivers it. :mod:`dtrain.forkserver_exit`, last of the
preload, gives SIGINT back to Python's handler: the server then ignores it as multiprocessing's fork server does,
and its workers (torch's elastic agent stops them with SIGINT) get Python's handler. Never import this anywhere
else: the importing process would end silently on a Ctrl-C.
"""

from __future__ import annotations

import os
import signal


def _end_quietly(signum: int, frame: object) -> None:
    os._exit(128 + signum)


signal.signal(signal.SIGINT, _end_quietly)
if hasattr(signal, "pthread_sigmask"):
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
