"""Ray nodes on this machine, each its own ``ray start`` pinned to its own cores.

A stand-in for a cluster: each node has its own raylet and object store
and runs on the cores ``taskset`` gives it, so work placed on a node uses
those cores only. A node started here is stopped here (its process group),
never by ``ray stop``, which would stop every Ray on the machine.

Nodes start with token authentication off (``RAY_AUTH_MODE=disabled``,
which this process sets for its own driver too): a local stand-in, not a
cluster to secure.
"""

import os
import signal
import socket
import subprocess
import sys
import time

BIN = os.path.dirname(sys.executable)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    """One ``ray start --block`` process (its raylet, store and workers), pinned to ``cores``.

    Args:
        cores: the CPU numbers it runs on, e.g. ``[1]``.
        num_cpus: the CPUs it offers Ray (0: a node that offers none).
        store_bytes: its object store's size.
        head: the address ``host:port`` of the head to join, or None to be the head.
        resources: custom resources it offers, or None.
        env: more environment for its processes (its workers inherit it).
        extra: more arguments for ``ray start``.
        port: the head's port (None: a free one).
    """

    def __init__(self, cores, *, num_cpus, store_bytes, head=None, resources=None, env=None, extra=(), port=None):
        self.cores = list(cores)
        self.port = (port or free_port()) if head is None else None
        self.address = head or f"127.0.0.1:{self.port}"
        args = [
            "taskset", "-c", ",".join(map(str, self.cores)),
            os.path.join(BIN, "ray"), "start", "--block",
            f"--num-cpus={num_cpus}",
            f"--object-store-memory={store_bytes}",
            f"--dashboard-agent-listen-port={free_port()}",
            "--min-worker-port=0", "--max-worker-port=0",
            "--disable-usage-stats",
        ]  # fmt: skip
        if head is None:
            args += [
                "--head", f"--port={self.port}",
                f"--ray-client-server-port={free_port()}",
                "--include-dashboard=false",
            ]  # fmt: skip
        else:
            args.append(f"--address={head}")
        args += list(extra)
        if resources:
            import json

            args.append(f"--resources={json.dumps(resources)}")
        environment = dict(os.environ, RAY_AUTH_MODE="disabled", **(env or {}))
        self._process = subprocess.Popen(
            args,
            env=environment,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # Its own process group, stopped as one.
        )

    @property
    def pgid(self):
        """The process group of the node's processes (its own session)."""
        return self._process.pid

    def stop(self, timeout=30):
        """Stops the node's processes (raylet, store, workers; the GCS for a head)."""
        if self._process.poll() is not None:
            return
        os.killpg(self._process.pid, signal.SIGTERM)
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait()
        if self.port is not None:
            _forget_head(self.port)


def _forget_head(port):
    """Removes Ray's record of the head at ``port`` as the current cluster, if it is.

    ``ray start --head`` records its address for a later ``ray.init()`` with
    none to connect to; killed, it leaves the record behind, and the next
    program's ``ray.init()`` would wait on a head that is gone.
    """
    try:
        from ray._common.utils import get_ray_address_file
    except ImportError:  # Older Ray.
        from ray._private.utils import get_ray_address_file
    path = get_ray_address_file(None)
    try:
        with open(path) as f:
            recorded = f.read().strip()
        if recorded.endswith(f":{port}"):
            os.remove(path)
    except OSError:
        pass


def connect(address, nodes, timeout=120):
    """``ray.init(address)`` once ``nodes`` nodes are alive; this process's auth off as the nodes'."""
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray

    deadline = time.monotonic() + timeout
    while True:
        try:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
            break
        except (ConnectionError, RuntimeError):
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)
    while sum(1 for n in ray.nodes() if n["Alive"]) < nodes:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{nodes} Ray nodes not alive after {timeout} s")
        time.sleep(0.5)
