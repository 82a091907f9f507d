"""Imported only by the workers' fork server, last of :data:`dtrain.workers.PRELOAD`: SIGINT back to Python's
handler, a worker whose launch has ended goes quietly, and the server ends with ``os._exit``.

SIGINT: :mod:`dtrain.forkserver_start` ends the server quietly on a Ctrl-C during the preload; once the preload is
done, multiprocessing's fork server ignores SIGINT itself and its children restore the handler found here, Python's
own, which torch's workers expect (the elastic agent stops them with SIGINT).

A launch that ended: a worker reads its arguments from the launching process after the server forks it, among them
the launch's named semaphores (its return queues, its finished event). Where the launching process has ended
meanwhile (a Ctrl-C as the ranks start), it has unlinked them, and opening one fails with ``FileNotFoundError``,
which the fork server's child prints with ``sys.excepthook`` before it exits. That worker has nothing to run and
nobody to report to: :func:`_quiet_hook`, the excepthook the server's children inherit, leaves that one error
unprinted, so the command's own line stays the last. Every other error is printed as before.

Exit: the server has imported torch, torch.distributed and torch._dynamo; the interpreter's teardown of those
modules takes 1.3-1.5 s of CPU, during which the process that started the server, and whatever reads its output
through a pipe, waits. The server holds no state worth a teardown (its children are gone when it ends, and it
writes no files), so the first exit handler ends it at once. Never import this anywhere else: the importing process
would skip its own exit handlers.
"""

from __future__ import annotations

import atexit
import functools
import os
import signal
import sys


def _launch_gone(value: BaseException) -> bool:
    """Whether ``value`` is a semaphore of the launch that could not be opened as a worker read its arguments:
    a ``FileNotFoundError`` raised in multiprocessing's ``SemLock.__setstate__``."""
    if not isinstance(value, FileNotFoundError):
        return False
    tb = value.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return False
    code = tb.tb_frame.f_code
    where = os.path.join("multiprocessing", "synchronize.py")
    return code.co_name == "__setstate__" and code.co_filename.endswith(where)


def _quiet_hook(kind, value, tb, previous) -> None:
    if value is not None and _launch_gone(value):
        return
    previous(kind, value, tb)


signal.signal(signal.SIGINT, signal.default_int_handler)
if hasattr(signal, "pthread_sigmask"):  # unblocked already, unless dtrain.forkserver_start could not be imported
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
sys.excepthook = functools.partial(_quiet_hook, previous=sys.excepthook)
atexit.register(os._exit, 0)
