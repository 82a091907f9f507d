"""A Ctrl-C in the launching process that Python would drop.

Python's SIGINT handler raises ``KeyboardInterrupt`` wherever the main thread is, and where that is a callback
whose exceptions Python only prints (a weakref callback of ``importlib``'s module locks, while torch imports), the
interrupt is printed as "Exception ignored" with its traceback and lost: the launch then goes on, and its workers'
fork server, which the same Ctrl-C ended, is started again. :func:`note_interrupts` keeps a record of every SIGINT
beside raising, and takes such a dropped interrupt from Python's hook for what callbacks raise
(``sys.unraisablehook``) before it is printed, so the command ends in one line; and
:func:`raise_noted_interrupt`, called where the launch is about to start its workers, raises the one that was
dropped.
"""

from __future__ import annotations

import functools
import signal
import sys

__all__ = ["note_interrupts", "raise_noted_interrupt"]

_noted: list[int] = []


def _on_interrupt(signum: int, frame: object) -> None:
    _noted.append(signum)
    raise KeyboardInterrupt


def _dropped(unraisable, previous) -> None:
    """Python's hook for what a callback raised: a ``KeyboardInterrupt`` is noted, not printed; the rest goes to the
    hook there was before."""
    if isinstance(unraisable.exc_value, KeyboardInterrupt):
        _noted.append(signal.SIGINT)
        return
    previous(unraisable)


def note_interrupts() -> None:
    """Note every SIGINT from now on (and raise ``KeyboardInterrupt`` as Python's handler does), where SIGINT has
    Python's handler; a handler of the caller's own stays. A ``KeyboardInterrupt`` that a callback raises and Python
    would print and drop is noted instead, silently."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_interrupt)
        sys.unraisablehook = functools.partial(_dropped, previous=sys.unraisablehook)


def raise_noted_interrupt() -> None:
    """Raise ``KeyboardInterrupt`` if a SIGINT came since :func:`note_interrupts`, even one that was dropped."""
    if _noted:
        raise KeyboardInterrupt
