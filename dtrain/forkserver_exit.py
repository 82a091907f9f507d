"""Imported only by the workers' fork server (:data:`dtrain.workers.PRELOAD`): the server ends with ``os._exit``.

The server has imported torch, torch.distributed and torch._dynamo; the interpreter's teardown of those modules
takes 1.3-1.5 s of CPU, during which the process that started the server, and whatever reads its output through a
pipe, waits. The server holds no state worth a teardown (its children are gone when it ends, and it writes no
files), so the first exit handler ends it at once. Never import this anywhere else: the importing process would
skip its own exit handlers.
"""

from __future__ import annotations

import atexit
import os

atexit.register(os._exit, 0)
