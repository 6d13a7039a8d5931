"""The usage-dependency tree of cached KV blocks (FastLibra §4.1-4.2).

A virtual root; under it one node per adapter *content* (depth 2, so a request first
matches its adapter); under an adapter node, one node per full KV block, keyed by the
block's tokens, so a root-to-node path spells a prompt prefix and siblings share the
prefix of their parent. The base model has its own adapter node (`BASE`).

A KV node's blocks live in one place at a time (`where`): on the device (`page`, one
page of the pool), in the host pool (`host`), or on the way between the two. The
dependency rule keeps every device-resident KV block usable: a KV node may be on the
device only while its parent is (for an adapter node: while the adapter is resident),
so swap-out takes device leaves and swap-in takes host nodes whose parent is on the
device. `refs` counts the running requests that read a node; a node with refs never
moves and is never dropped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterator

from jlora.engine.device_api import HostBlocks

DEVICE, HOST, TO_HOST, TO_DEVICE = "device", "host", "to_host", "to_device"
GONE = "gone"  # dropped from the tree (a swap still in flight finds it so)
BASE = ("base",)  # the adapter key of base-model requests


@dataclasses.dataclass(eq=False)
class Node:
    """A node of the tree (see the module docstring); hashed by identity."""

    key: Hashable  # an adapter node: its content key; a KV node: its block's tokens
    parent: Node | None
    kind: str  # "root" | "lora" | "kv"
    where: str = DEVICE
    page: int = -1  # a KV node on the device (or landing there): its page
    host: HostBlocks | None = None  # a KV node in the host pool: its blocks
    refs: int = 0
    reserved: int = 0  # queued requests waiting for a swap-in along this path
    visits: int = 0
    last_used: float = 0.0
    children: dict[Hashable, Node] = dataclasses.field(default_factory=dict)

    @property
    def depth(self) -> int:
        return 0 if self.parent is None else self.parent.depth + 1

    def path(self) -> Iterator[Node]:
        """This node and its ancestors below the root, nearest first."""
        node: Node | None = self
        while node is not None and node.kind != "root":
            yield node
            node = node.parent


class Tree:
    """The root and its adapter nodes; see the module docstring."""

    def __init__(self) -> None:
        self.root = Node(key=None, parent=None, kind="root")

    def adapter(self, key: Hashable) -> Node:
        """The adapter node for `key`, made on first use (on the device only if resident)."""
        node = self.root.children.get(key)
        if node is None:
            node = Node(key=key, parent=self.root, kind="lora", where=HOST)
            self.root.children[key] = node
        return node

    def adapters(self) -> list[Node]:
        return list(self.root.children.values())

    def match(self, adapter: Node, blocks: list[tuple[int, ...]]) -> list[Node]:
        """The KV nodes of the longest cached prefix of `blocks` under `adapter`, in order
        (wherever they are)."""
        nodes, node = [], adapter
        for tokens in blocks:
            child = node.children.get(tokens)
            if child is None:
                break
            nodes.append(child)
            node = child
        return nodes

    def add(self, parent: Node, tokens: tuple[int, ...], page: int, now: float) -> Node:
        assert tokens not in parent.children, "the block is cached already"
        node = Node(key=tokens, parent=parent, kind="kv", page=page, visits=1, last_used=now)
        parent.children[tokens] = node
        return node

    def remove(self, node: Node) -> None:
        """Take a KV node and its subtree out of the tree."""
        assert node.kind == "kv" and node.parent is not None
        del node.parent.children[node.key]

    def kv_nodes(self, under: Node | None = None) -> Iterator[Node]:
        """Every KV node (of one adapter node's subtree if given), parents before children."""
        stack = list((under or self.root).children.values())
        while stack:
            node = stack.pop()
            if node.kind == "kv":
                yield node
            stack.extend(node.children.values())

    def device_leaves(self) -> list[Node]:
        """KV nodes on the device (or on their way to it) that no request reads or waits
        for and no device node depends on: the swap-out candidates (a swap-in no one
        waits for any more is called off)."""
        return [
            node
            for node in self.kv_nodes()
            if node.where in (DEVICE, TO_DEVICE)
            and node.refs == 0
            and node.reserved == 0
            and not any(c.where in (DEVICE, TO_DEVICE) for c in node.children.values())
        ]

    def host_roots(self) -> list[Node]:
        """KV nodes in the host pool whose parent is on the device: the swap-in candidates."""
        return [
            node
            for node in self.kv_nodes()
            if node.where == HOST and node.parent is not None and node.parent.where == DEVICE
        ]

    def host_leaves(self) -> list[Node]:
        """KV nodes in the host pool with no children and no refs (a swap-in under way
        holds them): what the host pool drops first."""
        return [
            node
            for node in self.kv_nodes()
            if node.where == HOST and not node.children and node.refs == 0
        ]

    def cached_pages(self) -> int:
        """Device KV pages of the tree that no request reads."""
        return sum(1 for kv in self.kv_nodes() if kv.where in (DEVICE, TO_DEVICE) and kv.refs == 0)

    def invalid_kv_pages(self) -> int:
        """Device KV pages whose adapter is not on the device (FastLibra's invalid KV)."""
        return sum(
            1
            for adapter in self.adapters()
            if adapter.where != DEVICE
            for kv in self.kv_nodes(adapter)
            if kv.where in (DEVICE, TO_DEVICE)
        )


@dataclasses.dataclass(eq=False)
class Lease:
    """A request's KV: the cached prefix it reads (`nodes`, held) and its own pages."""

    owner: Hashable
    adapter: Node | None  # None under the "none" policy
    nodes: list[Node]
    pages: list[int]
    cached_tokens: int

    @property
    def table(self) -> list[int]:
        return [node.page for node in self.nodes] + self.pages


def leading(nodes: list[Node], where: str) -> list[Node]:
    """The first nodes of `nodes`, as long as they are all `where`."""
    run = []
    for node in nodes:
        if node.where != where:
            break
        run.append(node)
    return run
