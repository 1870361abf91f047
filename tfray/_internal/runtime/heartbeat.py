"""Lease renewal for dynamic sharding, on one thread of the runtime's."""

import logging
import threading
import weakref

from tfray._internal.runtime.service import Service

logger = logging.getLogger("tfray")

_IDLE_PERIOD_S = 1.0  # With no client, how often it looks for one.


class Heartbeat(Service):
    """Renews each client's leases every ``lease_s / 4`` on one daemon thread.

    A worker whose consumer is slow may not ask for work for a while; it is
    alive all the same, and must keep its units. A client has ``lease_s``
    and ``renew()``; it is dropped when its dataset goes.
    """

    name = "tfray-lease"

    def __init__(self):
        super().__init__()
        self._lock = threading.Lock()
        self._clients = weakref.WeakSet()  # Guarded by _lock.

    def add(self, client):
        with self._lock:
            self._clients.add(client)

    def _run(self):
        while not self._stop.is_set():
            with self._lock:
                clients = list(self._clients)
            period = min((c.lease_s for c in clients), default=4 * _IDLE_PERIOD_S) / 4
            for client in clients:
                try:
                    client.renew()
                except Exception:  # noqa: BLE001  One stale handle must not stop the others' renewal.
                    logger.debug("tfray: renewing a lease failed", exc_info=True)
            del clients  # A dropped dataset's client may go while this sleeps.
            self._stop.wait(period)
