"""Membership, election and tracker code of 200 nodes over a virtual network, in trio virtual time.

Each simulated node runs the loop the daemon runs (wait for a message or the
next timer, feed the state machine, send what it asks) in its own trio task;
a virtual network delivers messages after a random latency, drops some, and
can be cut in two. trio's MockClock jumps over idle time, so minutes of
protocol time take seconds.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import random
from collections.abc import Callable

import trio
import trio.testing

from meshd.mesh.assignment import ModelSpec, assign, capacities
from meshd.mesh.membership import MemberState, SwimMessage
from meshd.mesh.node import MeshNode
from meshd.mesh.records import CapabilityRecord, ModelInfo, ServedRange
from meshd.mesh.routing import plan_route, stage_options
from wire.identity import NodeIdentity

N = 200
PROBE_PERIOD = 1.0  # SwimConfig().probe_interval
# Deliveries fall on a 5 ms grid, so one trio wakeup delivers many messages: trio's per-wakeup
# work, not the protocol, is most of what simulating costs.
TICK = 0.005


def on_grid(t: float) -> float:
    """The first grid point at or after t (never before it, whatever the rounding)."""
    tick = math.ceil(t / TICK)
    return tick * TICK if tick * TICK >= t else (tick + 1) * TICK


class VirtualNetwork:
    """Delivers each message after a random latency, drops some, and can be cut.

    trio runs ready tasks in a random order on purpose; drawing each sender's losses and
    latencies from its own generator, and ordering ties by sender, keeps a run reproducible.
    """

    def __init__(self, seed: int, latency: tuple[float, float] = (0.001, 0.010), loss: float = 0.0):
        self._seed = seed
        self._rngs: dict[str, random.Random] = {}
        self._latency = latency
        self.loss = loss
        # (src, dest) -> True when the link is cut
        self.cut: Callable[[str, str], bool] | None = None
        self._queue: list[tuple[float, str, int, str, SwimMessage]] = []
        self._sent: dict[str, int] = {}
        self._inboxes: dict[str, trio.MemorySendChannel] = {}
        self._wakeup: trio.CancelScope | None = None

    def attach(self, node_id: str) -> trio.MemoryReceiveChannel:
        send, receive = trio.open_memory_channel(math.inf)
        self._inboxes[node_id] = send
        self._rngs[node_id] = random.Random(f"{self._seed}-{node_id}")
        self._sent[node_id] = 0
        return receive

    def send(self, now: float, src: str, dest: str, message: SwimMessage) -> None:
        rng = self._rngs[src]
        if dest not in self._inboxes or rng.random() < self.loss or (self.cut and self.cut(src, dest)):
            return
        self._sent[src] += 1
        at = on_grid(now + rng.uniform(*self._latency))
        heapq.heappush(self._queue, (at, src, self._sent[src], dest, message))
        if self._wakeup is not None and at < self._wakeup.deadline:
            self._wakeup.deadline = at

    async def run(self) -> None:
        while True:
            with trio.CancelScope(deadline=self._queue[0][0] if self._queue else math.inf) as self._wakeup:
                await trio.sleep_forever()
            self._wakeup = None
            now = trio.current_time()
            while self._queue and self._queue[0][0] <= now:
                _, src, _, dest, message = heapq.heappop(self._queue)
                self._inboxes[dest].send_nowait((src, message))


async def drive(node: MeshNode, inbox: trio.MemoryReceiveChannel, network: VirtualNetwork, on_events) -> None:
    """What the daemon does around a MeshNode, minus the sockets."""
    while True:
        with trio.move_on_at(node.next_timer()):
            src, message = await inbox.receive()
            now = trio.current_time()
            node.handle_message(now, src, message)
            while True:
                try:
                    src, message = inbox.receive_nowait()
                except trio.WouldBlock:
                    break
                node.handle_message(now, src, message)
        now = trio.current_time()
        if now >= node.next_timer():
            node.handle_timer(now)
        for dest, message in node.messages_to_send():
            network.send(now, node.node_id, dest, message)
        on_events(node, node.events())


MODEL = ModelInfo(
    digest="sha256:demo", name="demo", n_layers=32, bytes_per_layer=200_000_000, kv_bytes_per_token=4096
)


class Mesh:
    def __init__(self, n: int, seed: int, loss: float = 0.0):
        self.rng = random.Random(seed)
        self.network = VirtualNetwork(seed, loss=loss)
        self.identities = [
            NodeIdentity.from_private_bytes(hashlib.sha256(b"sim-%d" % i).digest()) for i in range(n)
        ]
        self.ids = [identity.node_id for identity in self.identities]
        self.index = {node_id: i for i, node_id in enumerate(self.ids)}
        self.nodes: dict[str, MeshNode] = {}
        self.dead_declared: list[tuple[str, str, float]] = []

    async def start(self, nursery: trio.Nursery, stagger: float = 0.01) -> None:
        nursery.start_soon(self.network.run)
        for i, identity in enumerate(self.identities):
            now = trio.current_time()
            record = CapabilityRecord.create(
                identity,
                version=1,
                addresses=[f"10.0.{i // 256}.{i % 256}:7400"],
                reachability="public",
                memory_bytes=self.rng.choice([4, 8, 16]) << 30,
                seconds_per_layer=self.rng.uniform(0.0005, 0.004),
                models=[MODEL],
                started_at=now,
            )
            node = MeshNode(identity, record, now, rng=random.Random(self.rng.random()))
            if i:
                node.join(now, [self.ids[0]])  # node 0 is the seed
            self.nodes[node.node_id] = node
            nursery.start_soon(drive, node, self.network.attach(node.node_id), self.network, self._on_events)
            await trio.sleep(stagger)

    def _on_events(self, node: MeshNode, events) -> None:
        for event in events:
            if getattr(event, "kind", None) == "dead":
                self.dead_declared.append((node.node_id, event.node_id, trio.current_time()))

    def converged(self, group: list[str]) -> bool:
        """Every node of `group` sees exactly the group, alive, at their current records, and
        follows the same tracker, which is in the group."""
        members = set(group)
        tracker = self.nodes[group[0]].tracker
        if tracker is None or tracker.node_id not in members:
            return False
        # The cheap checks on everyone first: most calls fail here.
        if any(
            self.nodes[node_id].tracker != tracker
            or self.nodes[node_id].membership.live_count() != len(group)
            for node_id in group
        ):
            return False
        for node_id in group:
            membership = self.nodes[node_id].membership
            for other in group:
                if membership.state(other) is not MemberState.ALIVE:
                    return False
                if membership.record_of(other).version != self.nodes[other].record.version:
                    return False
        return True

    def claimants(self) -> list[str]:
        return [node_id for node_id, node in self.nodes.items() if node.record.tracker_term > 0]

    async def wait_converged(self, group: list[str], limit: float) -> float:
        """Virtual seconds until `group` converged; fails after `limit`."""
        start = trio.current_time()
        while not self.converged(group):
            assert trio.current_time() - start < limit, f"not converged after {limit} s"
            await trio.sleep(PROBE_PERIOD)
        return trio.current_time() - start


async def test_200_nodes_converge_within_bounded_periods_and_serve_a_model(
    autojump_clock: trio.testing.MockClock,
) -> None:
    mesh = Mesh(N, seed=1)
    async with trio.open_nursery() as nursery:
        await mesh.start(nursery)
        # Counted from the last node's start; the bound is in probe periods.
        elapsed = await mesh.wait_converged(mesh.ids, limit=20 * PROBE_PERIOD)
        print(f"\n{N} nodes converged {elapsed / PROBE_PERIOD:.1f} probe periods after the last joined")
        assert len(mesh.claimants()) == 1
        assert not mesh.dead_declared

        # The tracker places the model from its view; the nodes load and publish their ranges.
        tracker = mesh.nodes[mesh.nodes[mesh.ids[0]].tracker.node_id]
        spec = ModelSpec.from_info(MODEL, kv_tokens=4096)
        placement = assign(capacities(tracker.membership.live_records(), MODEL.digest), spec)
        # Everyone serves, but for a small node that found no partner to share a whole copy with.
        assert len(placement.stages) >= N - 1
        now = trio.current_time()
        for node_id, (start, end) in placement.ranges().items():
            mesh.nodes[node_id].update_record(
                now, served=[ServedRange(model=MODEL.digest, start=start, end=end)]
            )
        spread = await mesh.wait_converged(mesh.ids, limit=20 * PROBE_PERIOD)
        print(f"served ranges known to every node {spread / PROBE_PERIOD:.1f} probe periods later")
        # Any node routes from its own view.
        for asker in mesh.ids[::40]:
            view = mesh.nodes[asker].membership.live_records()
            route = plan_route(stage_options(view, MODEL.digest), MODEL.n_layers, asker=asker)
            assert route.stages[0].start == 0 and route.stages[-1].end == MODEL.n_layers
        nursery.cancel_scope.cancel()


async def test_no_live_node_declared_dead_with_5_percent_loss(autojump_clock: trio.testing.MockClock) -> None:
    mesh = Mesh(N, seed=2, loss=0.05)
    async with trio.open_nursery() as nursery:
        await mesh.start(nursery)
        elapsed = await mesh.wait_converged(mesh.ids, limit=30 * PROBE_PERIOD)
        await trio.sleep(60 * PROBE_PERIOD)
        refutations = sum(node.membership.refutations for node in mesh.nodes.values())
        print(
            f"\nwith 5% loss: converged after {elapsed:.1f} s; {refutations} suspicions refuted in 60 more s"
        )
        assert mesh.dead_declared == []
        tracker = mesh.nodes[mesh.ids[0]].tracker
        assert all(
            node.membership.live_count() == N and node.tracker == tracker for node in mesh.nodes.values()
        )
        nursery.cancel_scope.cancel()


async def test_partition_gives_one_tracker_per_side_and_healing_leaves_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    mesh = Mesh(N, seed=3)
    async with trio.open_nursery() as nursery:
        await mesh.start(nursery)
        await mesh.wait_converged(mesh.ids, limit=20 * PROBE_PERIOD)
        left, right = mesh.ids[: N // 2], mesh.ids[N // 2 :]
        side = {node_id: node_id in set(left) for node_id in mesh.ids}
        mesh.network.cut = lambda src, dest: side[src] != side[dest]
        cut_at = trio.current_time()
        await mesh.wait_converged(left, limit=60)
        await mesh.wait_converged(right, limit=60)
        split = trio.current_time() - cut_at
        trackers = {mesh.nodes[left[0]].tracker, mesh.nodes[right[0]].tracker}
        assert len(trackers) == 2
        assert sorted(side[node_id] for node_id in mesh.claimants()) == [False, True]

        mesh.network.cut = None
        healed = await mesh.wait_converged(mesh.ids, limit=60)
        print(f"\npartition: sides settled after {split:.0f} s; healed mesh converged after {healed:.0f} s")
        assert len(mesh.claimants()) == 1
        assert mesh.nodes[mesh.ids[0]].tracker == max(trackers)
        nursery.cancel_scope.cancel()
