"""Keep Python's cycle collector off the heap an engine builds once and keeps.

An engine's start-up leaves ~300,000 objects that live as long as it does (torch, the
tokenizer, the model's modules, the plugins). Every oldest-generation collection walks
all of them and finds nothing: five such walks cost ~0.4 s of a 5 s start-up on a 2-core
Zen 4, and one that falls while serving stops the engine thread, GIL held, for ~0.2 s:
a step, and every stream's next token, 0.2 s late.

So the build runs with the collector paused, and what exists once it succeeds is frozen
(`gc.freeze`: moved where no collection looks). Reference counting still frees frozen
objects; only garbage *cycles* among them would stay. So only a process's first engine is
frozen (a server's, a script's): a later build (tests, notebooks, which drop engines)
unfreezes instead, handing an engine it dropped back to the collector, and freezes nothing;
a full collection at every such build would walk the whole heap each time (it made
engine-building tests ~1.5x slower). Data-parallel replicas are built inside one
`built_once`, so all of them are frozen together; `LLMEngine.shutdown` unfreezes.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
from typing import Iterator

_froze = [False]  # whether this process has frozen a build before


@contextlib.contextmanager
def built_once() -> Iterator[None]:
    """Run the block with the collector paused; if it succeeds and is this process's first
    build, freeze what exists. Nested blocks (replicas, ranks in the driver) are the outer
    one's. A block that raises freezes nothing. The collector is only touched where it was
    on: a caller that turned it off keeps it off, unfrozen."""
    if not gc.isenabled():
        yield
        return
    first = not _froze[0]
    if not first:
        gc.unfreeze()
    gc.disable()
    try:
        yield
        if first:
            gc.collect(0)  # the build's own short-lived cycles (all still the youngest while paused)
            gc.freeze()
            _froze[0] = True
            # exit as an unfrozen process would: the interpreter's last collection then
            # finalizes the engine's objects (extension modules check for leaks there)
            atexit.register(gc.unfreeze)
    finally:
        gc.enable()


def release() -> None:
    """Let the collector see the frozen heap again (an engine shut down)."""
    gc.unfreeze()
