"""Imported only by the workers' fork server, last of :data:`dtrain.workers.PRELOAD`: SIGINT back to Python's
handler, and the server ends with ``os._exit``.

SIGINT: :mod:`dtrain.forkserver_start` ends the server quietly on a Ctrl-C during the preload; once the preload is
done, multiprocessing's fork server ignores SIGINT itself and its children restore the handler found here, Python's
own, which torch's workers expect (the elastic agent stops them with SIGINT).

Exit: the server has imported torch, torch.distributed and torch._dynamo; the interpreter's teardown of those
modules takes 1.3-1.5 s of CPU, during which the process that started the server, and whatever reads its output
through a pipe, waits. The server holds no state worth a teardown (its children are gone when it ends, and it
writes no files), so the first exit handler ends it at once. Never import this anywhere else: the importing process
would skip its own exit handlers.
"""

from __future__ import annotations

import atexit
import os
import signal

signal.signal(signal.SIGINT, signal.default_int_handler)
if hasattr(signal, "pthread_sigmask"):  # unblocked already, unless dtrain.forkserver_start could not be imported
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
atexit.register(os._exit, 0)
