"""A daemon thread of the runtime's, with the start and stop the runtime calls."""

import threading


class Service:
    """Runs ``_run`` on a daemon thread named ``name`` until ``stop``.

    ``_run`` loops until ``self._stop`` is set, waiting at most a fraction of
    a second at a time (in native code without the GIL, or on the event), so
    that ``stop`` ends it before Python finalizes.
    """

    name = "tfray"

    def __init__(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)

    def start(self):
        self._thread.start()

    def stop(self, timeout):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self):
        raise NotImplementedError
