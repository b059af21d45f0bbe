"""The store a replica group advertises in a quorum is reachable from other nodes: a
loopback host (torchrun --standalone's MASTER_ADDR, a one-process group's own store) is
replaced by this node's host name, any other host is kept."""

from __future__ import annotations

import socket

import pytest

from kempnerforge.training.replicas.manager import advertised_host


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST", "127.0.0.1", "127.1.2.3", "::1"])
def test_a_loopback_store_is_advertised_by_this_nodes_host_name(host):
    assert advertised_host(host) == socket.gethostname()


@pytest.mark.parametrize("host", ["node-17", "node-17.cluster.example", "10.1.2.3", "fe80::1"])
def test_a_store_on_a_reachable_host_keeps_it(host):
    assert advertised_host(host) == host


def test_a_store_listens_on_every_interface_so_the_host_name_reaches_it():
    from torch._C._distributed_c10d import TCPStore

    server = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    client = TCPStore(advertised_host("localhost"), server.port, is_master=False)
    client.set("reached", "yes")
    assert server.get("reached") == b"yes"
