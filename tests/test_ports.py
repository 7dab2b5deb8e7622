import socket
from pathlib import Path

from ports import free_port


def test_the_port_lies_below_the_kernels_ephemeral_range_and_can_be_listened_on():
    """The ephemeral range is where bind(0) and outgoing connections take ports; a pick there can be taken back."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    assert max(ports) < low and len(ports) > 1
    with socket.create_server(("", ports.pop())) as server:
        assert server.getsockname()[1] < low
