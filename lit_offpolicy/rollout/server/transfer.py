"""Which transport carries the weights to each server (``VLLMServerSpec.transfer``), and its senders.

``shm``: shared memory (``shm_sender``), for servers on the trainer's host; ``tcp``: a TCP connection
(``tcp_sender``), any host; ``auto``: shared memory for the servers the run launched and for given
URLs whose host is this machine (a loopback address, or one of its interfaces' addresses), TCP for
the others. Both go through the same vLLM plugin (``vllm_plugin.receiver``): the server needs no
option of its own for either.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlparse

import psutil

from lit_offpolicy.rollout.server.pool import Server
from lit_offpolicy.rollout.server.shm_sender import ShmSegment, ShmWeightSender
from lit_offpolicy.rollout.server.tcp_sender import TcpWeightSender

TRANSFERS = ("auto", "shm", "tcp")


def connect_senders(
    servers: list[Server], transfer: str, host: str, timeout_s: float, others: list[Server] = ()
) -> None:
    """Give each server its ``sender`` by ``transfer`` (closing one it had: the server's worker takes
    the new one); the shared-memory ones share one segment, the one ``others``' senders use if any."""
    senders = [other.sender for other in others if isinstance(other.sender, ShmWeightSender)]
    held = [sender.segment for sender in senders if sender.segment.senders]
    segment = held[0] if held else ShmSegment()
    try:
        for server in servers:
            if server.sender is not None:
                server.sender.close()
            if transfer == "shm" or (transfer == "auto" and on_this_host(server)):
                server.sender = ShmWeightSender(server.client, segment, timeout_s)
            else:
                server.sender = TcpWeightSender(server.client, host, timeout_s)
    finally:
        if not segment.senders:
            segment.close()


def on_this_host(server: Server) -> bool:
    """Launched by this run, or its URL's host resolves to a loopback address or to one of this
    machine's interfaces' addresses."""
    if server.launched is not None:
        return True
    try:
        resolved = {
            info[4][0].split("%")[0] for info in socket.getaddrinfo(urlparse(server.url).hostname, None)
        }
    except OSError:
        return False
    local = {entry.address.split("%")[0] for entries in psutil.net_if_addrs().values() for entry in entries}
    return any(ipaddress.ip_address(address).is_loopback or address in local for address in resolved)
