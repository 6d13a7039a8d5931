"""Child processes that die with their parent (`jlora up`'s workers).

A supervisor that is SIGKILLed runs no cleanup, so its children must notice on their
own, and then clean up after themselves as on any SIGTERM (a worker drains, closes its
engine and unlinks its shared memory). Two mechanisms, both armed by the child:

1. the parent-death signal (Linux `prctl(PR_SET_PDEATHSIG)`): the kernel sends it the
   moment the parent goes. It is set after the child's exec, so the child then checks
   that the parent is still the one that started it (`PARENT_ENV`), and signals itself
   if not: the parent died before the signal was armed. The kernel sends it when the
   *thread* that forked the child exits, so a supervisor must start its children from a
   thread that lives as long as it does (`jlora up`: the main thread);
2. a watch thread, for systems without prctl and as a fallback: every `WATCH_INTERVAL`
   seconds it compares `os.getppid()` with the parent's pid, and signals its own
   process once they differ (the child was re-parented to init or a subreaper).

The parent asks for this by starting the child with `child_env()`; a process started
any other way (`jlora serve` from a shell) is left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping

log = logging.getLogger(__name__)

PARENT_ENV = "JLORA_PARENT_PID"  # the pid of the parent a child must not outlive
WATCH_INTERVAL = 1.0  # seconds between two looks at os.getppid()
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def child_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` for a child that must die with this process (it calls `die_with_parent`)."""
    return {**env, PARENT_ENV: str(os.getpid())}


def die_with_parent(signum: int = signal.SIGTERM) -> bool:
    """If this process was started with `child_env`, have `signum` sent to it when its
    parent goes (see the module docstring); True if so. Call it early, on any thread.
    The variable is removed from the environment, so this process's own children do
    not inherit a parent that is not theirs."""
    raw = os.environ.pop(PARENT_ENV, None)
    if raw is None or not raw.isdigit():
        return False
    parent = int(raw)
    _set_parent_death_signal(signum)
    if os.getppid() != parent:  # it died before the signal was armed
        _parent_gone(parent, signum)
    else:
        threading.Thread(
            target=_watch, args=(parent, signum), name="jlora-parent-watch", daemon=True
        ).start()
    return True


def _set_parent_death_signal(signum: int) -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_PDEATHSIG): %s", os.strerror(ctypes.get_errno()))
    except (OSError, AttributeError) as err:  # no libc or no prctl: the watch remains
        log.warning("no parent-death signal (%s); watching the parent instead", err)


def _watch(parent: int, signum: int) -> None:
    while os.getppid() == parent:
        time.sleep(WATCH_INTERVAL)
    _parent_gone(parent, signum)


def _parent_gone(parent: int, signum: int) -> None:
    print(
        f"jlora: parent process {parent} is gone; stopping (signal {signum})",
        file=sys.stderr,
        flush=True,
    )
    os.kill(os.getpid(), signum)
