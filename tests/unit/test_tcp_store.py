"""Rendezvous stores listen on the host they were given, not on every interface (torch's TCPStore
master binds the wildcard address on its own), and still rendezvous real gloo groups."""

from __future__ import annotations

import os
import threading

import torch

from lorarl.common.tcp_store import client_store, master_store
from lorarl.weightsync.wire.collective import WeightTransferGroup, rendezvous_store
from lorarl.weightsync.wire.payload import PackedBucket
from tests.listeners import listening_addresses


def mine() -> set[tuple[str, int]]:
    return {(address, port) for address, port, _ in listening_addresses(os.getpid())}


def test_a_master_store_listens_on_its_host_only_and_serves_clients() -> None:
    store = master_store("127.0.0.1", 0, None, timeout_s=10)
    assert ("127.0.0.1", store.port) in mine()
    assert not {a for a in mine() if a[1] == store.port and a[0] != "127.0.0.1"}
    client = client_store("127.0.0.1", store.port, None, timeout_s=10)
    client.set("key", "value")
    assert store.get("key") == b"value"


def test_a_weight_transfer_group_opens_no_wildcard_listener() -> None:
    before = mine()
    store = rendezvous_store("127.0.0.1", timeout_s=30)
    received: list[torch.Tensor] = []
    errors: list[BaseException] = []
    data = torch.arange(64, dtype=torch.uint8)

    def receiver() -> None:
        try:
            group = WeightTransferGroup("gloo", "127.0.0.1", store.port, 1, 2, "listeners", timeout_s=30,
                                        local_address="127.0.0.1")
            for _, buffer, start, end in group.receive_pieces([data.numel()]):
                received.append(buffer[start:end].clone())
        except BaseException as e:  # reported below
            errors.append(e)

    thread = threading.Thread(target=receiver)
    thread.start()
    sender = WeightTransferGroup("gloo", "127.0.0.1", store.port, 0, 2, "listeners", timeout_s=30,
                                 local_address="127.0.0.1", store=store)
    opened = mine() - before  # the store and the gloo pairs, while the group is up
    sender.send([PackedBucket(index=0, buffer=data, specs=[])])
    thread.join(30)
    assert not errors, errors
    assert torch.equal(torch.cat(received), data)
    assert opened and all(address == "127.0.0.1" for address, _ in opened), opened
