"""The weight-transfer store (issue 39, point 2): reachable from this host only, its keys under a per-run secret, each
push header signed with it. The whole gloo path (exact tensors, loopback-only sockets of both processes) is tested in
tests/rollout/test_worker.py."""

from __future__ import annotations

import datetime

import psutil
import pytest
import torch
import torch.distributed as dist

from dspo.rollout.transfer import CollectiveTransfer, keyed_store, sign, verified_header


@pytest.fixture()
def transfer():
    transfer = CollectiveTransfer("gloo")
    transfer.allocate([("w", torch.zeros(2))])
    yield transfer
    transfer.close()


def _client(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=2))


def test_the_store_listens_on_loopback_only(transfer):
    """torch's TCPStore as dspo made it before listened on every interface ([::]): any host could connect."""
    bound = [c.laddr.ip for c in psutil.Process().net_connections("inet") if c.laddr.port == transfer.port]
    assert bound and all(ip == "127.0.0.1" for ip in bound)


def test_a_client_without_the_runs_secret_finds_nothing_and_a_forged_push_is_refused(transfer):
    header = "3,7,1"
    transfer._store.set("dspo/push/1", f"{header},{sign(transfer.secret, 1, header)}")
    right = keyed_store(_client(transfer.port), transfer.secret)
    assert verified_header(transfer.secret, 1, right.get("dspo/push/1").decode()) == (3, 7, 1)
    wrong = keyed_store(_client(transfer.port), "0" * 32)
    with pytest.raises(dist.DistStoreError):  # the key is not there under another secret: the wait times out
        wrong.get("dspo/push/1")
    forged = f"{header},{sign('0' * 32, 1, header)}"
    with pytest.raises(PermissionError, match="weight push 1 was refused"):
        verified_header(transfer.secret, 1, forged)
    with pytest.raises(PermissionError):  # a signed header replayed as another push
        verified_header(transfer.secret, 2, right.get("dspo/push/1").decode())


def test_each_run_has_its_own_secret_and_it_travels_to_the_engine_process_only_at_spawn(transfer):
    other = CollectiveTransfer("gloo")
    other.allocate([("w", torch.zeros(2))])
    try:
        assert len(transfer.secret) == 32 and transfer.secret != other.secret
        state = transfer.__getstate__()
        assert state["secret"] == transfer.secret and "_store" not in state
    finally:
        other.close()


def test_both_transports_implement_the_weight_transport_protocol(transfer):
    import multiprocessing

    from dspo.rollout.transfer import SharedMemoryTransfer, WeightTransport, make_transfer

    shared = make_transfer("shared_memory", multiprocessing.get_context("spawn"))
    assert isinstance(shared, SharedMemoryTransfer) and isinstance(shared, WeightTransport)
    assert isinstance(transfer, WeightTransport)
    protocol = {name for name in vars(WeightTransport) if not name.startswith("_")}
    assert protocol == {"allocate", "connect_trainer", "send", "connect_engine", "receive", "close"}
