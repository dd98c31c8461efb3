"""Which address a node publishes, and which addresses and records may go to which peer."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
from pydantic import ValidationError

import meshd.daemon.reachability
from meshd.cli.main import main
from meshd.daemon import MeshDaemon
from meshd.daemon.config import NodeConfig
from meshd.daemon.reachability import route_source
from meshd.mesh.addresses import fit_for_peer, observed_address
from meshd.mesh.membership import Alive, Gossip, Ping, Suspect, Sync, SyncEntry
from meshd.mesh.records import (
    CapabilityRecord,
    address_fits,
    host_of,
    is_loopback,
    is_unspecified,
    join_address,
    record_fits,
    split_address,
)
from meshd.net.peers import open_peers
from meshd.net.rpc import mesh_rpc
from wire.identity import NodeIdentity
from wire.meshrpc import DialBackReply, DialBackRequest, StatusReply, StatusRequest


def record(*addresses: str, relays: tuple[str, ...] = ()) -> CapabilityRecord:
    return CapabilityRecord.create(NodeIdentity.generate(), 1, addresses=list(addresses),
                                   relay_addresses=list(relays))


def test_addresses_split_and_join_with_ipv6_brackets() -> None:
    assert split_address("10.0.0.1:7000") == ("10.0.0.1", 7000)
    assert split_address("[::1]:7000") == ("::1", 7000)
    assert join_address("::1", 7000) == "[::1]:7000" and join_address("10.0.0.1", 1) == "10.0.0.1:1"
    for bad in ("10.0.0.1", ":7000", "host:0", "host:65536", "host:x", "[]:1"):
        assert split_address(bad) is None, bad
    assert host_of("ws://10.0.0.2:7000/") == "10.0.0.2" and host_of("10.0.0.2:5123") == "10.0.0.2"
    assert host_of("[::1]:5123") == "::1"
    assert is_unspecified("0.0.0.0") and is_unspecified("::") and not is_unspecified("10.0.0.1")
    assert is_loopback("127.0.0.1") and is_loopback("127.8.0.1") and is_loopback("::1")
    assert is_loopback("::ffff:127.0.0.1") and is_loopback("localhost") and not is_loopback("10.0.0.1")


def test_an_address_goes_to_a_peer_only_if_that_peer_can_dial_it() -> None:
    for peer in ("10.77.0.5", "127.0.0.1", "::1"):
        assert not address_fits("0.0.0.0:7000", peer)
        assert not address_fits("[::]:7000", peer)
        assert not address_fits("garbage", peer)
        assert address_fits("10.77.0.2:7000", peer)
    assert not address_fits("127.0.0.1:7000", "10.77.0.5")
    assert not address_fits("[::1]:7000", "10.77.0.5")
    assert address_fits("127.0.0.1:7000", "127.0.0.1") and address_fits("127.0.0.1:7000", "::1")
    # A circuit is as good as its relay's address.
    assert address_fits("10.77.0.9:7400/p2p-circuit/abc", "10.77.0.5")
    assert not address_fits("127.0.0.1:7400/p2p-circuit/abc", "10.77.0.5")


def test_a_record_is_withheld_whole_from_a_peer_it_would_misdirect() -> None:
    assert not record_fits(record("127.0.0.1:7000"), "10.77.0.5")
    assert record_fits(record("127.0.0.1:7000"), "127.0.0.1")
    assert not record_fits(record("0.0.0.0:7000"), "127.0.0.1")
    assert record_fits(record("10.77.0.2:7000"), "10.77.0.5")
    # Signed, so it cannot be trimmed: one loopback address among good ones withholds it.
    assert not record_fits(record("10.77.0.2:7000", "127.0.0.1:7000"), "10.77.0.5")
    assert not record_fits(record(relays=("127.0.0.1:7400/p2p-circuit/x",)), "10.77.0.5")
    # No address yet (a first node before any peer came, a node behind NAT without relays): harmless.
    assert record_fits(record(), "10.77.0.5")


def test_swim_messages_lose_only_the_records_the_peer_must_not_be_told() -> None:
    local, public = record("127.0.0.1:7001"), record("10.77.0.2:7000")
    suspect = Suspect(node=local.node_id, incarnation=1, accuser=public.node_id)
    ping = Ping(seq=1, version=1, gossip=[Alive(record=local), Alive(record=public), suspect])
    sent = fit_for_peer(ping, "10.77.0.5")
    assert isinstance(sent, Ping) and sent.seq == 1
    assert [u.record.node_id if isinstance(u, Alive) else u.kind for u in sent.gossip] == \
        [public.node_id, "suspect"]
    assert fit_for_peer(ping, "127.0.0.1") is ping
    sync = Sync(reply=True, entries=[SyncEntry(record=local, state="alive"), SyncEntry(record=public, state="alive")])
    trimmed = fit_for_peer(sync, "10.77.0.5")
    assert isinstance(trimmed, Sync) and [e.record.node_id for e in trimmed.entries] == [public.node_id]
    gossip = Gossip(version=1, gossip=[Alive(record=record("0.0.0.0:7000"))])
    assert fit_for_peer(gossip, "127.0.0.1").gossip == []  # type: ignore[attr-defined]


def test_what_a_seed_says_it_sees_is_published_only_if_it_is_an_address() -> None:
    assert observed_address("10.77.0.2", 7000, "10.77.0.1") == "10.77.0.2:7000"
    assert observed_address("fd00::2", 7000, "fd00::1") == "[fd00::2]:7000"
    assert observed_address("127.0.0.1", 7000, "127.0.0.1") == "127.0.0.1:7000"
    # A seed off loopback cannot have seen us on loopback; a lie or a bug, never published.
    assert observed_address("127.0.0.1", 7000, "10.77.0.1") is None
    for bad in ("0.0.0.0", "::", "", "evil.example", "10.77.0.2:7000", "1.2.3.4/p2p-circuit/x"):
        assert observed_address(bad, 7000, "10.77.0.1") is None, bad


def test_route_source_is_this_hosts_address_toward_a_peer() -> None:
    assert route_source("127.0.0.1") == "127.0.0.1"
    assert route_source("not-an-ip") is None


def test_a_dial_back_request_names_exactly_one_target() -> None:
    assert DialBackRequest(port=7000).port == 7000
    assert DialBackRequest(address="10.0.0.1:7000").address == "10.0.0.1:7000"
    for bad in ({}, {"port": 7000, "address": "10.0.0.1:7000"}, {"port": 0}, {"port": 65536},
                {"address": "x" * 400}):
        with pytest.raises(ValidationError):
            DialBackRequest(**bad)
    with pytest.raises(ValidationError):
        DialBackReply(reachable=True, observed="x" * 300)


@asynccontextmanager
async def daemon(config: NodeConfig) -> AsyncIterator[MeshDaemon]:
    async with trio.open_nursery() as nursery:
        node: MeshDaemon = await nursery.start(MeshDaemon(NodeIdentity.generate(), config).run)
        yield node
        nursery.cancel_scope.cancel()


async def test_a_volunteer_on_every_interface_publishes_where_its_seed_sees_it() -> None:
    with trio.fail_after(30):
        async with daemon(NodeConfig(listen=("0.0.0.0", 0))) as seed:
            # A first node on a wildcard knows no address until a peer reaches it.
            assert seed.address == "" and seed.local_address == f"127.0.0.1:{seed.port}"
            async with daemon(NodeConfig(listen=("0.0.0.0", 0), seeds=(seed.local_address,))) as volunteer:
                assert volunteer.address == f"127.0.0.1:{volunteer.port}"
                assert volunteer.mesh.record.reachability == "public"
                # and the seed learned its own from the volunteer that reached it
                assert seed.address == f"127.0.0.1:{seed.port}"
                async with open_peers(NodeIdentity.generate()) as peers:
                    # the volunteer's new record reaches the seed by gossip, a moment after it is signed
                    want = sorted([seed.address, volunteer.address])
                    for _ in range(200):
                        shown = await mesh_rpc(peers, seed.local_address, StatusRequest())
                        assert isinstance(shown, StatusReply)
                        if sorted(m.address for m in shown.members) == want:
                            break
                        await trio.sleep(0.05)
                    assert isinstance(shown, StatusReply)
                    assert sorted(m.address for m in shown.members) == want
                    # Nobody can aim a seed's dial-back at a third host.
                    refused = await mesh_rpc(peers, seed.local_address, DialBackRequest(address="10.9.9.9:80"))
                    assert isinstance(refused, DialBackReply) and not refused.reachable
                    assert "not where you dial from" in refused.detail and refused.observed == "127.0.0.1"
                    closed = await mesh_rpc(peers, seed.local_address, DialBackRequest(port=1))
                    assert isinstance(closed, DialBackReply) and not closed.reachable


async def test_advertise_is_published_as_given() -> None:
    with trio.fail_after(30):
        async with daemon(NodeConfig(listen=("0.0.0.0", 0), advertise="192.0.2.7:7000")) as node:
            assert node.address == "192.0.2.7:7000"


def reachability(node: MeshDaemon) -> str:
    return node.mesh.record.reachability


async def test_a_changed_address_is_published_with_its_own_dial_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """The seed's reply is the dial-back at the address it saw: a new one is published only when confirmed."""
    replies: list[DialBackReply] = []

    async def fake_rpc(peers: object, address: object, request: object, *args: object) -> DialBackReply:
        assert isinstance(request, DialBackRequest) and request.port is not None
        return replies.pop(0)

    with trio.fail_after(30):
        async with daemon(NodeConfig(listen=("0.0.0.0", 0))) as seed, \
                daemon(NodeConfig(listen=("0.0.0.0", 0), seeds=(seed.local_address,))) as node:
            port, version = node.port, node.mesh.record.version
            monkeypatch.setattr(meshd.daemon.reachability, "mesh_rpc", fake_rpc)
            replies.append(DialBackReply(reachable=True, observed="127.0.0.2"))
            await node._check_reachability()
            assert node.address == f"127.0.0.2:{port}" and reachability(node) == "public"
            assert node.mesh.record.version > version
            # The same answer again changes nothing: no new record to gossip.
            replies.append(DialBackReply(reachable=True, observed="127.0.0.2"))
            version = node.mesh.record.version
            await node._check_reachability()
            assert node.mesh.record.version == version
            # Not reachable where it is now seen: behind NAT, and the unconfirmed address is not taken.
            replies.append(DialBackReply(reachable=False, observed="127.0.0.3", detail="timed out"))
            await node._check_reachability()
            assert node.address == f"127.0.0.2:{port}" and reachability(node) == "nat"


async def test_a_first_node_keeps_the_first_address_off_loopback_its_peers_show_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    sources = {"10.77.0.5": "10.77.0.1", "10.88.0.5": "10.88.0.1", "127.0.0.1": "127.0.0.1"}
    monkeypatch.setattr(meshd.daemon.reachability, "route_source", sources.get)
    with trio.fail_after(30):
        async with daemon(NodeConfig(listen=("0.0.0.0", 0))) as seed:
            port = seed.port
            seed._learn_address("127.0.0.1:40000")
            assert seed.address == f"127.0.0.1:{port}"  # better than nothing while only local peers came
            seed._learn_address("10.77.0.5:40000")
            assert seed.address == f"10.77.0.1:{port}"
            # Final: another peer (a stranger on another network) cannot move it, nor can loopback.
            seed._learn_address("10.88.0.5:40000")
            seed._learn_address("127.0.0.1:40001")
            seed._learn_address("ws://10.77.0.5:7000/")
            assert seed.address == f"10.77.0.1:{port}"
        # A node told its host, or given --advertise, never learns from peers.
        async with daemon(NodeConfig(listen=("127.0.0.1", 0))) as fixed:
            fixed._learn_address("10.77.0.5:40000")
            assert fixed.address == f"127.0.0.1:{fixed.port}"


@pytest.mark.parametrize("advertise", ["0.0.0.0:7000", "[::]:7000", "10.0.0.1:0", "10.0.0.1"])
def test_join_refuses_an_advertised_address_nobody_can_dial(advertise: str, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    # in-process: argparse refuses it before anything starts (a subprocess spent seconds on imports)
    with pytest.raises(SystemExit) as exited:
        main(["join", "--no-model", "--advertise", advertise, "--state-dir", str(tmp_path / "state")])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1 and "--advertise" in err, err
    assert not (tmp_path / "state").exists()
