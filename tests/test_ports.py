import socket
from pathlib import Path

import pytest
from ports import HIGH, free_port

RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def test_the_port_lies_below_the_kernels_ephemeral_range_and_can_be_listened_on():
    """The ephemeral range is where bind(0) and outgoing connections take ports; a pick there can be taken back."""
    if not RANGE.exists() or int(RANGE.read_text().split()[0]) <= HIGH:
        pytest.skip("this kernel's ephemeral range starts at or below the tests' ports (or is not in /proc)")
    low = int(RANGE.read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    assert max(ports) < low and len(ports) > 1
    with socket.create_server(("", ports.pop())) as server:
        assert server.getsockname()[1] < low
