"""A Ray cluster on one host for the Ray tests: each node a raylet at its own loopback address with its own CPUs.

Ray's default node address is this host's routable one, and `ray.init` rewrites 127.0.0.1 to it: both kept on loopback,
where the raylets listen. What this cannot show: a second host (one kernel routes every loopback address; no firewall,
no real network latency)."""

import contextlib

import ray
import ray._private.ray_constants as ray_constants
from ray.cluster_utils import Cluster


@contextlib.contextmanager
def loopback_cluster(nodes: dict[str, int]):
    """A cluster of `nodes` ({address: CPUs}, the first the head, where this process joins); shut down after."""
    ray_constants.ENABLE_RAY_CLUSTER = False
    (head, head_cpus), *others = nodes.items()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"node_ip_address": head, "num_cpus": head_cpus, "include_dashboard": False},
    )
    try:
        for address, cpus in others:
            cluster.add_node(node_ip_address=address, num_cpus=cpus)
        ray.init(address=cluster.address)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        ray_constants.ENABLE_RAY_CLUSTER = True


def alive_actors() -> list:
    return [a for a in ray._private.state.actors().values() if a["State"] != "DEAD"]


def placed_groups() -> list:
    return [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]


def node_ids() -> dict[str, str]:
    """Each live node's address: its id."""
    return {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
