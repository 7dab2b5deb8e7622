"""A port for the tests' launchers (torchrun's store, MASTER_PORT), picked below the kernel's ephemeral range.

A port from bind(0) lies in the ephemeral range (32768-60999 here), and once the probe closes the kernel may hand it
to any outgoing connection: gloo opens many, and with four test workers one took a port between the probe and
torchrun's listen (EADDRINUSE). Below that range only a listener takes a port. run.sub's 20000-29999 is left out too.
"""

import random
import socket

LOW, HIGH = 10000, 19999


def free_port() -> int:
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randint(LOW, HIGH)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {LOW}-{HIGH}")
