"""A P/D worker (serving/ray_serve/disagg.py) whose K/V stream can pause after its header,
so tests/test_ray_routing.py can cancel a request while its K/V is in transfer.

Imported by the Ray replicas (the test puts tests/ on their PYTHONPATH). `hold(True)`:
every KVTransfer.Prefill stream of this replica waits HOLD_S after its header (counted
in `held_transfers`) before it sends the pages; the data itself is unchanged."""

from __future__ import annotations

import threading
import time

from serving.disagg import service
from serving.ray_serve.disagg import PDWorker

HOLD_S = 5.0


class SlowTransferWorker(PDWorker):
    def __init__(self, *args, **kwargs):
        self.holding = threading.Event()
        self.held = self.ended = 0
        send_chunks = service.payload_chunks

        def chunks(payload, prefill_s, *rest, **kw):
            stream = send_chunks(payload, prefill_s, *rest, **kw)
            yield next(stream)  # the header: the decode side now waits for the pages
            if self.holding.is_set():
                self.held += 1
                time.sleep(HOLD_S)
                self.ended += 1  # the pages go now (if the puller is still there)
            yield from stream

        service.payload_chunks = chunks  # this replica's process only
        super().__init__(*args, **kwargs)

    def hold(self, on: bool) -> None:
        if on:
            self.holding.set()
        else:
            self.holding.clear()

    def held_transfers(self) -> int:
        return self.held

    def ended_held_transfers(self) -> int:
        return self.ended
