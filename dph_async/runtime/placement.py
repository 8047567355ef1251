"""Where the processes of a run go on a Ray cluster (docs/decisions.md, "Several hosts").

The head is the driver's node: the run directory, the model and the data are on its filesystem, so
the learner and every stage that reads or writes them stay there. Actors go to the nodes that
`scripts/cluster.sh worker` labels for them, spread out; a cluster without such labels (a local run,
a plain Ray cluster) spreads them over all nodes.
"""

from __future__ import annotations

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import NODE_ID_LABEL_KEY, PlacementGroup, placement_group, remove_placement_group

# The label `scripts/cluster.sh worker` gives its nodes. When a cluster has such nodes, actors run only
# there, and the head's cores stay with the learner and the replay.
ACTOR_NODE_LABEL = ("dph-role", "actor")


def home_node() -> str:
    """The driver's Ray node: the run directory, the model and the data are on its filesystem."""
    return ray.get_runtime_context().get_node_id()


def on_home_node() -> dict:
    """Ray options that keep a task or actor on the driver's node (it reads or writes the run directory)."""
    return {"label_selector": {NODE_ID_LABEL_KEY: home_node()}}


def learner_placement(ranks: int = 1, timeout_s: float = 300.0) -> PlacementGroup:
    """A placement group with one bundle per learner rank, all on the driver's node: rank 0 hosts the
    replay and writes checkpoints into the run directory."""
    pg = placement_group([{"CPU": 1}] * ranks, strategy="STRICT_PACK",
                         bundle_label_selector=[{NODE_ID_LABEL_KEY: home_node()}] * ranks)
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except GetTimeoutError:
        remove_placement_group(pg)
        raise RuntimeError(f"the learner needs {ranks} CPU(s) on the driver's node, and Ray found none free within "
                           f"{timeout_s:.0f}s (`ray status` shows what each node has)") from None
    return pg


def actor_placement() -> dict:
    """Ray options for actors: spread over the nodes labelled for actors, or over all nodes if none is."""
    key, value = ACTOR_NODE_LABEL
    labelled = any(n["Alive"] and n.get("Labels", {}).get(key) == value for n in ray.nodes())
    return {"scheduling_strategy": "SPREAD", **({"label_selector": {key: value}} if labelled else {})}
