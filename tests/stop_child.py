"""A process that waits on a `StopFlag` the way the agent, supervisor and engine main loops do.

It prints "ready", waits for SIGTERM, prints "stopped", and starts over, so one process
serves hundreds of trials. The waits cycle through very short and long timeouts: the
short ones keep the main thread inside `wait` when the signal lands, the moment where a
handler calling `threading.Event.set()` deadlocks on the lock the waiter holds.
"""
from __future__ import annotations

import signal
import sys

from weightcache_agent.serve.stop import StopFlag

TIMEOUTS = (0.0001, 0.0, 0.5, 0.001)


def main() -> None:
    stop = StopFlag().on_signals(signal.SIGTERM)
    trial = 0
    while True:
        timeout = TIMEOUTS[trial % len(TIMEOUTS)]
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        while not stop.wait(timeout):
            pass
        stop._set = False  # re-arm for the next trial; a real main loop exits here
        trial += 1
        sys.stdout.write("stopped\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
