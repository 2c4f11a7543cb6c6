"""The worker loop (ranks ≥ 1): follow the controller's commands in the role the current
layout gives this GPU slot."""

from __future__ import annotations

import logging

from libra_hpc.cluster.world import World

log = logging.getLogger(__name__)


def run_worker(world: World) -> None:
    while True:
        command = world.broadcast(None)
        if command["op"] == "stop":
            return
        if command["layout"] is not None:
            handle = world.apply(command["layout"])
            log.debug("step %d: now %s (group rank %d)", command["step"], handle.group.name, handle.rank)
        world.gather(world.probe())
