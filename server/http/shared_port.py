"""The HTTP port that `--http-workers` front ends share: each listens on it in the port's
SO_REUSEPORT group, and Linux spreads new connections over the group's listening sockets.

The server process holds the port with a socket in the group that never listens (it takes no
connections), so the port stays the server's while front ends come and go. Before it joins the
group it checks that nothing listens on the port: a second server started on the port of one
that serves fails as it would without workers, rather than quietly taking a share of its
connections. (Two servers started within the same second can both pass the check; the port
takes SO_REUSEADDR, as the server's socket does without workers, so that connections of an
earlier server still in TIME_WAIT do not keep it from starting.)
"""

from __future__ import annotations

import socket


def reuse_port_socket(host: str, port: int, listen: bool) -> socket.socket:
    """A TCP socket on (host, port) in the port's SO_REUSEPORT group; IPv6 alone on an IPv6
    address, as the server's own socket without workers."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
        if listen:
            sock.listen(2048)
    except BaseException:
        sock.close()
        raise
    return sock


def reserve_port(host: str, port: int) -> socket.socket:
    """The server process's hold on (host, port): OSError (address in use) when anything listens
    on the port already. Port 0: a free port the system picks."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:  # no SO_REUSEPORT: fails beside a listener
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        probe.bind((host, port))
        port = probe.getsockname()[1]
    return reuse_port_socket(host, port, listen=False)
