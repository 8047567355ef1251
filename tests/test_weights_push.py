"""New weights reach actors without a query per engine step: the weight server pushes each new
manifest to actors that asked once, and the actor fetches and verifies from it."""

from __future__ import annotations

import time

import torch

from dph_async.actors.weight_client import WeightClient
from dph_async.learner.publish import WeightServer
from dph_async.net import NetSecurity


def test_pushed_manifests_arrive_without_asking_and_fetch_matches():
    model = torch.nn.Linear(4, 3)
    server = WeightServer("tcp://127.0.0.1:0", NetSecurity(), bucket_bytes=64)
    client = WeightClient(server.address, NetSecurity(), actor_id=0)
    try:
        assert client.newest(-1) is None  # nothing published yet (asked once: now subscribed)
        client.refresh_s = 1e9  # from here on it never asks again: only pushes can bring news
        for version in (1, 2):
            with torch.no_grad():
                model.weight.add_(1.0)
            server.publish(model, version)
            deadline = time.monotonic() + 5
            while (ready := client.newest(version - 1)) is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert ready is not None and ready.version == version
            tensors = dict(client.fetch(ready))
            torch.testing.assert_close(tensors["weight"], model.weight.detach())
            torch.testing.assert_close(tensors["bias"], model.bias.detach())
            assert client.newest(version) is None  # nothing newer than what it has
    finally:
        client.close()
        server.close()
