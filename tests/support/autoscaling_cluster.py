"""Producers that ask a resource only an autoscaled node type offers, on Ray's fake autoscaling cluster.

Run by tests/distribute/test_placement.py as ``python autoscaling_cluster.py``,
in a process of its own: a process keeps the authentication mode of the first
Ray it joined, and this cluster's nodes (``ray start`` with Ray's fake
multi-node provider) run with token authentication off.

It starts a head that offers no CPU, whose autoscaler may launch one node
of type ``producers`` (1 CPU, 2 of ``tfray_test_producer``); reads one epoch
of a ``from_generators`` dataset whose 2 producers ask for
``tfray_test_producer``; and prints one JSON line: the head's node id, the
nodes launched, where each producer ran, and tfray's warnings meanwhile.
Bounded by an alarm, which stops the cluster too.
"""

import collections
import json
import logging
import os
import signal
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["CUDA_VISIBLE_DEVICES"] = ""
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks"))

import nodes  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

TIMEOUT_S = 150
RESOURCE = "tfray_test_producer"


def autoscaling_config(gcs_port):
    """Ray's fake multi-node provider: a head that offers no CPU, and one node type it may launch."""
    return {
        "cluster_name": "tfray-test",
        "max_workers": 1,
        "provider": {
            "type": "fake_multinode",
            "gcs_address": f"127.0.0.1:{gcs_port}",
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
        },
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0},
            "producers": {
                "resources": {"CPU": 1, RESOURCE: 2, "object_store_memory": 80 << 20},
                "node_config": {},
                "min_workers": 0,
                "max_workers": 1,
            },
        },
        "head_node_type": "ray.head.default",
        "auth": {},
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": 5.0,
        "docker": {},
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }


def noting_its_node(shard):
    import ray

    yield {"node": np.frombuffer(bytes.fromhex(ray.get_runtime_context().get_node_id()), np.uint8)[None]}


def timed_out(signum, frame):
    raise TimeoutError(f"not done within {TIMEOUT_S} s")


def main():
    signal.signal(signal.SIGALRM, timed_out)
    signal.alarm(TIMEOUT_S)
    port = nodes.free_port()
    with tempfile.TemporaryDirectory() as scratch:
        config = os.path.join(scratch, "autoscaling.json")
        with open(config, "w") as f:
            json.dump(autoscaling_config(port), f)
        head = nodes.Node(
            [0, 1],
            num_cpus=0,
            store_bytes=80 << 20,
            port=port,
            extra=[f"--autoscaling-config={config}"],
            env={"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"},
        )
        try:
            nodes.connect(head.address, 1)
            import ray

            import tfray
            from tfray._internal.sources import placement

            placement.CHECK_S = 0.3  # Said while the autoscaler launches the node.
            warnings = []
            handler = logging.Handler()
            handler.emit = lambda record: warnings.append(record.getMessage())
            logging.getLogger("tfray").addHandler(handler)
            (head_node,) = (n["NodeID"] for n in ray.nodes() if n["Alive"])
            ds = tfray.Dataset.from_generators(
                noting_its_node,
                2,
                element_spec={"node": tf.TensorSpec([1, 28], tf.uint8)},
                ray_remote_args={"num_cpus": 0, "resources": {RESOURCE: 1}},
            )
            counts = collections.Counter(bytes(b["node"].numpy()[0]).hex() for b in ds)
            launched = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != head_node]
            print(json.dumps({"head": head_node, "launched": launched, "counts": counts, "warnings": warnings}))
        finally:
            signal.alarm(0)
            import ray

            ray.shutdown()
            head.stop(timeout=5)  # Its fake nodes keep `ray start` from ending sooner on a SIGTERM.


if __name__ == "__main__":
    main()
