"""The memory manager's invariants, asserted: pages conserved and singly owned, the
dependency rule (fastlibra: a KV block on the device only under its parent and its
adapter), nodes a request reads on the device, the host pool's bytes accounted."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jlora.engine.memory.pool import KV
from jlora.engine.memory.tree import DEVICE, HOST, TO_DEVICE

if TYPE_CHECKING:
    from jlora.engine.memory.manager import MemoryManager


def check_invariants(manager: MemoryManager) -> None:
    """AssertionError naming the first invariant `manager` breaks."""
    manager.pool.check()
    owned = manager.pool.owned()
    seen: set[int] = set()
    for kv in manager.tree.kv_nodes():
        if kv.where in (DEVICE, TO_DEVICE):
            assert owned.get(kv.page) == (KV, kv), f"node page {kv.page} not owned by it"
            assert kv.page not in seen
            seen.add(kv.page)
            if manager.policy == "fastlibra":  # a run swapping in lands parent first
                parents = (DEVICE, TO_DEVICE) if kv.where == TO_DEVICE else (DEVICE,)
                assert kv.parent is not None and kv.parent.where in parents, "invalid KV"
        else:
            assert kv.page == -1
        if kv.refs:
            assert kv.where == DEVICE, "a node read by a request is not on the device"
        assert (kv.where in (HOST, TO_DEVICE)) == (kv.host is not None)
    for lease in manager.leases:
        for page in lease.pages:
            assert owned.get(page) == (KV, lease.owner), f"lease page {page} not its own"
            assert page not in seen
            seen.add(page)
        for kv in lease.nodes:
            assert kv.refs > 0 and kv.where == DEVICE
    kv_pages = {p for p, (kind, _) in owned.items() if kind == KV}
    assert kv_pages == seen, f"KV pages without an owner: {sorted(kv_pages - seen)}"
    host = sum(kv.host.nbytes for kv in manager.tree.kv_nodes() if kv.host is not None)
    assert host + manager.pending_host_bytes() == manager.host_used, "host pool bytes drifted"
