"""UDP socket setup for the datapath: the one place outside the kernels that knows socket options.

The batched I/O itself (recvmmsg/sendmmsg with GRO/GSO, no GIL) lives in
``netdam.kernels.udp_io``; this module opens and configures the sockets it works on.

Sources: ip(7) (``IP_MTU_DISCOVER``, multicast options), socket(7) (``SO_RCVBUF``,
``SO_RCVBUFFORCE``, ``SO_RXQ_OVFL``), udp(7) (``UDP_SEGMENT``, ``UDP_GRO``).
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import struct

# Option values from the Linux UAPI headers; Python's socket module does not export them all
# (3.11 lacks every one of these). Values are the same on every Linux architecture.
SOL_UDP = getattr(socket, "SOL_UDP", 17)
#: udp(7): send-side segmentation offload; cmsg or sockopt value = segment size (u16).
UDP_SEGMENT = 103
#: udp(7): receive-side coalescing; the segment size comes back in a cmsg (int).
UDP_GRO = 104
#: ip(7): path-MTU discovery mode; IP_PMTUDISC_DO = set DF, never fragment (EMSGSIZE instead).
IP_MTU_DISCOVER = 10
IP_PMTUDISC_DO = 2
IP_PMTUDISC_DONT = 0  # never set DF: fragment locally when needed
#: ip(7): the current path MTU of a connected socket.
IP_MTU = 14
#: ip(7): 0 = deliver only the groups this socket joined (default 1 = any joined on the host).
IP_MULTICAST_ALL = 49
#: socket(7): a u32 cmsg with the socket's cumulative count of dropped datagrams.
SO_RXQ_OVFL = 40
#: socket(7): like SO_RCVBUF/SO_SNDBUF but may exceed net.core.rmem_max/wmem_max (CAP_NET_ADMIN).
SO_RCVBUFFORCE = 33
SO_SNDBUFFORCE = 32

#: IPv4 + UDP header bytes: a datagram of MTU M carries at most M - 28 bytes of payload.
IP_UDP_OVERHEAD = 28
#: The multicast range nodes use on one machine (administratively scoped, RFC 2365).
MULTICAST_NET = ipaddress.IPv4Network("239.0.0.0/8")
#: The UDP ports of the multicast groups a cluster's hosts derive (api.ProcessGroup.group):
#: below the node ports' default block (which starts where this ends, cluster/launch.py
#: DEFAULT_BASE_PORT) and below the kernel's
#: ephemeral range (Linux's default 32768-60999, ip(7) ip_local_port_range), where only explicit
#: binds live. A node binds its group's port on the group address, and any socket bound to
#: port 0 on the wildcard address (a client's, or one that sent unbound) may hold the port
#: against it: drawn from 40000-59999, a node's bind met EADDRINUSE in a full suite run.
MULTICAST_PORTS = range(10000, 17744)


def open_udp_socket(
    bind: tuple[str, int],
    *,
    rcvbuf: int = 64 << 20,
    sndbuf: int = 16 << 20,
    gro: bool = True,
    reuse_addr: bool = False,
) -> socket.socket:
    """A non-blocking IPv4 UDP socket bound to *bind* (port 0: the kernel picks), set up for
    the batched datapath:

    - ``IP_MTU_DISCOVER = IP_PMTUDISC_DO``: datagrams are never fragmented; one larger than the
      path MTU fails with EMSGSIZE (ip(7)), which the send kernel counts and reports.
    - receive/send buffers of *rcvbuf*/*sndbuf* bytes: ``SO_RCVBUFFORCE`` first (allowed as
      root, exceeds ``net.core.rmem_max``), else ``SO_RCVBUF`` (capped by rmem_max). Read what
      was granted with ``granted_buffers``.
    - ``SO_RXQ_OVFL`` on: receives carry the socket's drop count (socket(7)).
    - ``UDP_GRO`` when *gro*: the kernel hands over runs of coalesced datagrams (udp(7)).
    - ``SO_REUSEADDR`` when *reuse_addr* (several multicast members on one group port).
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        if reuse_addr:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
        _set_buffer(sock, SO_RCVBUFFORCE, socket.SO_RCVBUF, rcvbuf)
        _set_buffer(sock, SO_SNDBUFFORCE, socket.SO_SNDBUF, sndbuf)
        sock.setsockopt(socket.SOL_SOCKET, SO_RXQ_OVFL, 1)
        if gro:
            try:
                sock.setsockopt(SOL_UDP, UDP_GRO, 1)
            except OSError as exc:
                raise OSError(
                    exc.errno,
                    f"this kernel refuses UDP_GRO ({exc.strerror}); Linux 5.0 or later is "
                    "needed, or open the socket with gro=False",
                ) from None
        sock.bind(bind)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def _set_buffer(sock: socket.socket, force_opt: int, opt: int, size: int) -> None:
    if size <= 0:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, force_opt, size)
    except PermissionError:
        # Not root (no CAP_NET_ADMIN): the plain option silently caps at rmem_max/wmem_max.
        sock.setsockopt(socket.SOL_SOCKET, opt, size)


def granted_buffers(sock: socket.socket) -> tuple[int, int]:
    """(receive, send) buffer limits in bytes as the kernel reports them with getsockopt.

    These are the kernel's values, which are *double* what was requested (socket(7): the
    kernel doubles the value to leave room for bookkeeping, and getsockopt returns the doubled
    value). They are the limits the kernel compares against the true size of queued buffers
    (payload plus per-skb overhead), so they are the honest "how much may be queued" figure.
    """
    rcv = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    snd = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    return int(rcv), int(snd)


def open_control_socket(address: str) -> socket.socket:
    """The management port beside a data port: plain, non-blocking, and allowed to fragment
    (IP_PMTUDISC_DONT): stats and COUNTERS replies (over 1 KiB; a switch's grows with its ports
    and regions) are management traffic, not the emulated wire, and must reach an operator on
    a 1500-byte network too."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DONT)
    sock.bind((address, 0))
    sock.setblocking(False)
    return sock


def pin_multicast_sender(sock: socket.socket, interface_ip: str = "127.0.0.1") -> None:
    """Send multicast through *interface_ip* only, TTL 1, looped back to local members.

    Unpinned multicast leaves by the default route (BRIEF section 3); ip(7) IP_MULTICAST_IF,
    IP_MULTICAST_TTL, IP_MULTICAST_LOOP.
    """
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(interface_ip))
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 1)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 1)


def _membership(group_ip: str, interface_ip: str) -> bytes:
    group = ipaddress.IPv4Address(group_ip)
    if not group.is_multicast:
        raise ValueError(
            f"{group_ip} is not a multicast address: use a group in {MULTICAST_NET} "
            "(administratively scoped, stays on this host with TTL 1)"
        )
    # struct ip_mreq {imr_multiaddr, imr_interface}: the interface address pins the join.
    return struct.pack("4s4s", group.packed, socket.inet_aton(interface_ip))


def join_multicast(sock: socket.socket, group_ip: str, interface_ip: str = "127.0.0.1") -> None:
    """Join *group_ip* on the interface holding *interface_ip* and pin sends there too.

    Sets ``IP_ADD_MEMBERSHIP`` with the interface address, ``IP_MULTICAST_IF``, TTL 1,
    ``IP_MULTICAST_LOOP`` on and ``IP_MULTICAST_ALL`` off (only the groups this socket joined
    reach it). To receive, the socket must be bound to the group's port on the group address
    or the wildcard (a socket bound to 127.0.0.1 never sees datagrams to 239.x): open it with
    ``open_udp_socket((group_ip, port), reuse_addr=True)``.
    """
    mreq = _membership(group_ip, interface_ip)
    pin_multicast_sender(sock, interface_ip)
    sock.setsockopt(socket.IPPROTO_IP, IP_MULTICAST_ALL, 0)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, mreq)


def leave_multicast(sock: socket.socket, group_ip: str, interface_ip: str = "127.0.0.1") -> None:
    """Leave *group_ip* on *interface_ip* (``IP_DROP_MEMBERSHIP``); leaving twice is harmless."""
    try:
        sock.setsockopt(
            socket.IPPROTO_IP, socket.IP_DROP_MEMBERSHIP, _membership(group_ip, interface_ip)
        )
    except OSError as exc:
        if exc.errno != errno.EADDRNOTAVAIL:  # not a member: nothing to leave
            raise


def max_payload(mtu: int) -> int:
    """UDP payload bytes one datagram may carry at IP MTU *mtu*."""
    return mtu - IP_UDP_OVERHEAD


def check_mtu_fits(mtu: int, datagram_bytes: int) -> None:
    """Raise ValueError naming ``--mtu`` when a *datagram_bytes* UDP payload needs a larger MTU."""
    if datagram_bytes > max_payload(mtu):
        raise ValueError(
            f"a {datagram_bytes}-byte datagram does not fit MTU {mtu} (at most "
            f"{max_payload(mtu)} bytes of UDP payload): use --mtu "
            f"{datagram_bytes + IP_UDP_OVERHEAD} or more, or send fewer elements per packet"
        )
