"""The swaps' copies over the host-device link, on one background thread.

The memory manager decides what moves (manager.py); a `Transfers` runs each copy (a
callable of the device engine's: `kv_to_host`, `kv_to_device`, which take the link's
time) on its thread and hands what landed back to the scheduler's thread, which
installs it (`landed`, or `wait` when nothing else can run). It also keeps the link's
rate (the emulated one when the engine throttles its link, else measured over the
copies that landed) and the prefill's, for the swap-or-drop choice: a block leaving the
device is worth keeping on the host only if bringing it back over the link is quicker
than computing its tokens again (`worth_keeping`).
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from jlora.engine.memory.tree import Node

DEFAULT_LINK_BYTES_PER_S = 16e9  # until a copy has been timed (about PCIe 4.0 x16)
Landed = tuple[Node, str, object]  # the node, where it was going, the copy's result


class Transfers:
    """See the module docstring. `link_bytes_per_s`: the emulated link's rate (0: measure
    it); `page_bytes`: what one copy carries, a KV block of `block_size` tokens."""

    def __init__(self, link_bytes_per_s: float, page_bytes: int, block_size: int) -> None:
        self._rate = link_bytes_per_s
        self._measured = link_bytes_per_s <= 0
        self._page_bytes = page_bytes
        self._block_size = block_size
        self._prefill_s_per_token = 0.0  # measured (`observe_prefill`); 0: not yet
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jlora-kv-swap")
        self._done: queue.SimpleQueue[tuple[Node, str, object, float]] = queue.SimpleQueue()
        self.in_flight = 0

    @property
    def bytes_per_s(self) -> float:
        """The link's rate, as far as it is known."""
        return self._rate or DEFAULT_LINK_BYTES_PER_S

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill computed `tokens` tokens in `seconds` (a moving average per token)."""
        if tokens <= 0 or seconds <= 0:
            return
        rate = seconds / tokens
        previous = self._prefill_s_per_token
        self._prefill_s_per_token = rate if not previous else 0.8 * previous + 0.2 * rate

    def worth_keeping(self) -> bool:
        """Whether a block is worth keeping on the host: its copy back (one page over the
        link) is quicker than a prefill computing its tokens again. The swap-out itself
        overlaps with the steps, so only the way back is weighed; before a prefill has
        been timed, it is."""
        back_s = self._page_bytes / self.bytes_per_s
        prefill_s = self._prefill_s_per_token * self._block_size
        return not self._prefill_s_per_token or back_s < prefill_s

    def submit(self, kv: Node, direction: str, copy: Callable[[], object]) -> None:
        """Run `copy` (moving `kv` towards `direction`) on the thread; its result, or the
        exception it raised, lands later."""
        done, start = self._done, time.perf_counter()

        def run() -> None:
            try:
                result = copy()
            except BaseException as error:  # noqa: BLE001 (handed to the scheduler thread)
                result = error
            done.put((kv, direction, result, time.perf_counter() - start))

        self.in_flight += 1
        self._executor.submit(run)

    def landed(self) -> list[Landed]:
        """The copies that landed since the last call, in order (never blocks)."""
        landed = []
        while True:
            try:
                landed.append(self._take(self._done.get_nowait()))
            except queue.Empty:
                return landed

    def wait(self, timeout: float) -> Landed | None:
        """Block until a copy lands (or the timeout): it, or None."""
        if not self.in_flight:
            return None
        try:
            return self._take(self._done.get(timeout=timeout))
        except queue.Empty:
            return None

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    def _take(self, item: tuple[Node, str, object, float]) -> Landed:
        kv, direction, result, seconds = item
        self.in_flight -= 1
        if self._measured and seconds > 0 and not isinstance(result, BaseException):
            rate = self._page_bytes / seconds
            self._rate = rate if self._rate <= 0 else 0.8 * self._rate + 0.2 * rate
        return kv, direction, result
