"""Batched UDP I/O in numba: libc ``recvmmsg``/``sendmmsg`` with GRO/GSO, without the GIL.

Why this file exists: CPython has no recvmmsg/sendmmsg, and one datagram per syscall tops out
near 200 kpps here (BRIEF section 3). With Linux UDP GSO (``UDP_SEGMENT`` cmsg, udp(7)) one
``sendmsg`` carries a run of up to 64 equal-size datagrams laid back to back; with ``UDP_GRO``
(udp(7)) one ``recvmsg`` returns such a run coalesced, the segment size in a cmsg. Adding
``recvmmsg``/``sendmmsg`` (recvmmsg(2), sendmmsg(2)) moves several runs per syscall.

How libc is called: each syscall is a numba ``@intrinsic`` that declares the libc symbol *by
name* in the generated LLVM module (llvmlite resolves it against the running process, where
libc is always loaded). Unlike ctypes function pointers, no address is baked into the code, so
``cache=True`` works and a second process loads the kernels from the cache without compiling.
Every intrinsic returns the libc result, or ``-errno`` when it failed (errno is read right after
the call, in the same generated code, so nothing can clobber it).

Structures are built in preallocated ``int64`` numpy arrays (``arr.ctypes.data`` gives their
address in nopython mode); layouts are the x86-64/aarch64 Linux LP64 ones, little-endian:

- ``struct msghdr`` (56 B): name ptr, namelen u32 (+pad), iov ptr, iovlen, control ptr,
  controllen, flags i32 (+pad); ``struct mmsghdr`` adds ``msg_len`` u32 -> 64 B = 8 words.
- ``struct iovec`` (16 B): base, len.  ``struct cmsghdr``: len (size_t), level i32, type i32,
  data at +16; ``CMSG_SPACE(4)`` = 24 B = 3 words.
- ``struct sockaddr_in`` (16 B): family u16 (AF_INET = 2), port big-endian, address big-endian.
- ``struct pollfd`` (8 B): fd i32, events i16, revents i16.

Addresses in batches are ``ip << 16 | port`` as uint64 (``netdam.protocol.packet``).

The ``state`` array (int64, ``STATE_LEN`` entries) is shared by ``recv_batch_kernel`` and
``send_batch_kernel`` of one socket; the kernels only ever add to it or overwrite "last" fields:

====  =====================  ==================================================================
idx   name                   meaning
====  =====================  ==================================================================
0     ``ST_KERNEL_DROPS``    socket drops reported by ``SO_RXQ_OVFL`` (socket(7)): the kernel's
                             cumulative u32 counter as last seen (only sent once non-zero)
1     ``ST_RECV_ERRNO``      errno of the last failed receive (0 = none yet)
2     ``ST_RECV_ERRORS``     failed receive calls (EAGAIN excluded)
3     ``ST_SEND_ERRNO``      errno of the last failed send (0 = none yet)
4     ``ST_SEND_DROPPED``    datagrams given up after a permanent send error (EMSGSIZE, ...)
5     ``ST_TRUNCATED``       datagrams lost on receive: ``MSG_TRUNC`` or no room in the batch
6     ``ST_RECV_CALLS``      receive syscalls (recvmmsg + poll)
7     ``ST_SEND_CALLS``      send syscalls (sendmmsg + poll)
8     ``ST_SEND_WAITS``      times the send side waited for ``POLLOUT`` (EAGAIN/ENOBUFS)
9     ``ST_RX_DATAGRAMS``    datagrams received
10    ``ST_TX_DATAGRAMS``    datagrams sent
11    ``ST_GRO_RUNS``        receive messages that carried a ``UDP_GRO`` cmsg (coalesced runs)
12    ``ST_GSO_RUNS``        send messages that carried a ``UDP_SEGMENT`` cmsg
13    ``ST_RECV_FULL``       1 when the last receive stopped with datagrams perhaps still queued
                             (no room left for another run), 0 when it drained the socket
====  =====================  ==================================================================

Limits (kernel ``include/linux/udp.h`` and ``net/ipv4/udp.c``): a GSO message holds at most
``UDP_MAX_SEGMENTS`` = 64 segments (raised to 128 only in recent kernels, so 64 is the portable
bound), and the whole message is one IPv4 datagram before segmentation, so at most 65507 bytes
of payload (65535 - 20 - 8). Each segment must fit the path MTU (else EMSGSIZE with
``IP_PMTUDISC_DO``). A GRO run likewise holds at most 64 segments and 64 KiB.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from netdam.kernels.wire import rd32
from netdam.protocol.layout import H_SEQ

#: numba versions these intrinsics are known to work with: [low, high) (pyproject pins the same
#: range; tests/kernels/test_numba_version.py fails, naming it, on anything else).
NUMBA_TESTED = ((0, 59), (0, 69))

# ---------------------------------------------------------------- constants (man pages cited)

#: Indices into the shared ``state`` array (see the module docstring).
ST_KERNEL_DROPS = 0
ST_RECV_ERRNO = 1
ST_RECV_ERRORS = 2
ST_SEND_ERRNO = 3
ST_SEND_DROPPED = 4
ST_TRUNCATED = 5
ST_RECV_CALLS = 6
ST_SEND_CALLS = 7
ST_SEND_WAITS = 8
ST_RX_DATAGRAMS = 9
ST_TX_DATAGRAMS = 10
ST_GRO_RUNS = 11
ST_GSO_RUNS = 12
ST_RECV_FULL = 13
STATE_LEN = 16

#: Largest UDP payload of one IPv4 datagram, hence of one GSO message (65535 - 20 - 8).
MAX_UDP_PAYLOAD = 65507
#: Segments per GSO message / GRO run: UDP_MAX_SEGMENTS (64 on every kernel since 4.18).
MAX_SEGMENTS_PER_RUN = 64
#: Bytes one receive message may need: a whole GRO run (64 KiB).
RUN_BYTES = 1 << 16
#: Messages per recvmmsg/sendmmsg call.
MAX_MSGS = 64

# Words (int64) per structure.
_MMSG_W = 8  # struct mmsghdr
_IOV_W = 2  # struct iovec
_NAME_W = 2  # struct sockaddr_in
_CTRL_W = 8  # room for two CMSG_SPACE(4) = 24 B cmsgs (UDP_GRO + SO_RXQ_OVFL), 64 B
_SEND_CTRL_W = 3  # CMSG_SPACE(sizeof(u16)) = 24 B: one UDP_SEGMENT cmsg
#: int64 words of send scratch per message (mmsghdr + iovec + sockaddr_in + cmsg).
SEND_SCRATCH_WORDS_PER_MSG = _MMSG_W + _IOV_W + _NAME_W + _SEND_CTRL_W
#: int64 words of a message's iovecs in a gather send: a header and a body per datagram.
_GATHER_IOV_W = 2 * _IOV_W * MAX_SEGMENTS_PER_RUN
#: int64 words of gather-send scratch (send_gather_kernel): MAX_MSGS messages of up to 64
#: datagrams each.
GATHER_SCRATCH_WORDS = MAX_MSGS * (_MMSG_W + _GATHER_IOV_W + _NAME_W + _SEND_CTRL_W)

# <sys/socket.h>, <netinet/in.h>, <linux/udp.h>, <poll.h>, <errno.h> (x86-64/aarch64 Linux).
_AF_INET = 2
_SOL_SOCKET = 1
_SO_RXQ_OVFL = 40  # socket(7)
_SOL_UDP = 17
_UDP_SEGMENT = 103  # udp(7): send-side segment size, u16
_UDP_GRO = 104  # udp(7): receive-side segment size, int
_MSG_DONTWAIT = 0x40
_MSG_TRUNC = 0x20
POLLIN = 0x001
_POLLOUT = 0x004
_CLOCK_MONOTONIC = 1
_EINTR = 4
_EAGAIN = 11
_ENOBUFS = 105
#: Total time send_batch_kernel waits for POLLOUT before handing the rest back to the caller.
_SEND_WAIT_BUDGET_MS = 5
_SEND_WAIT_STEP_MS = 1

# ---------------------------------------------------------------- libc through intrinsics

_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_PTR = ir.IntType(8).as_pointer()


def _libc(builder: Any, name: str, ret: ir.Type, argtys: list[ir.Type]) -> Any:
    """Declare (once per module) the libc function *name*: resolved by symbol, so cacheable."""
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, argtys), name)


def _result_or_neg_errno(builder: Any, ret: Any) -> Any:
    """``ret`` widened to i64, or ``-errno`` when it is negative (libc's failure convention)."""
    errno_ptr = builder.call(_libc(builder, "__errno_location", _I32.as_pointer(), []), [])
    errno = builder.sext(builder.load(errno_ptr), _I64)
    wide = builder.sext(ret, _I64) if ret.type.width < 64 else ret
    failed = builder.icmp_signed("<", wide, ir.Constant(_I64, 0))
    return builder.select(failed, builder.neg(errno), wide)


@intrinsic
def _sys_recvmmsg(typingctx, fd, msgvec, vlen, flags):
    """int recvmmsg(int fd, struct mmsghdr *msgvec, unsigned vlen, int flags, NULL)."""
    sig = types.int64(types.int64, types.int64, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        fn = _libc(builder, "recvmmsg", _I32, [_I32, _PTR, _I32, _I32, _PTR])
        r = builder.call(
            fn,
            [
                builder.trunc(args[0], _I32),
                builder.inttoptr(args[1], _PTR),
                builder.trunc(args[2], _I32),
                builder.trunc(args[3], _I32),
                ir.Constant(_PTR, None),  # no timeout: recvmmsg(2) BUGS, we poll() instead
            ],
        )
        return _result_or_neg_errno(builder, r)

    return sig, codegen


@intrinsic
def _sys_sendmmsg(typingctx, fd, msgvec, vlen, flags):
    """int sendmmsg(int fd, struct mmsghdr *msgvec, unsigned vlen, int flags)."""
    sig = types.int64(types.int64, types.int64, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        fn = _libc(builder, "sendmmsg", _I32, [_I32, _PTR, _I32, _I32])
        r = builder.call(
            fn,
            [
                builder.trunc(args[0], _I32),
                builder.inttoptr(args[1], _PTR),
                builder.trunc(args[2], _I32),
                builder.trunc(args[3], _I32),
            ],
        )
        return _result_or_neg_errno(builder, r)

    return sig, codegen


@intrinsic
def sys_poll(typingctx, fds, nfds, timeout_ms):
    """int poll(struct pollfd *fds, nfds_t nfds, int timeout)."""
    sig = types.int64(types.int64, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        fn = _libc(builder, "poll", _I32, [_PTR, _I64, _I32])
        r = builder.call(
            fn, [builder.inttoptr(args[0], _PTR), args[1], builder.trunc(args[2], _I32)]
        )
        return _result_or_neg_errno(builder, r)

    return sig, codegen


@intrinsic
def _sys_clock_gettime(typingctx, clock, ts):
    """int clock_gettime(clockid_t clock, struct timespec *ts)."""
    sig = types.int64(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        fn = _libc(builder, "clock_gettime", _I32, [_I32, _PTR])
        r = builder.call(fn, [builder.trunc(args[0], _I32), builder.inttoptr(args[1], _PTR)])
        return _result_or_neg_errno(builder, r)

    return sig, codegen


@intrinsic
def _sys_clock_nanosleep(typingctx, clock, ts):
    """int clock_nanosleep(clockid_t clock, 0, const struct timespec *req, NULL): returns the
    error number itself (not -1/errno), so it is widened and negated here."""
    sig = types.int64(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        fn = _libc(builder, "clock_nanosleep", _I32, [_I32, _I32, _PTR, _PTR])
        r = builder.call(
            fn,
            [
                builder.trunc(args[0], _I32),
                ir.Constant(_I32, 0),
                builder.inttoptr(args[1], _PTR),
                ir.Constant(_PTR, None),
            ],
        )
        return builder.neg(builder.sext(r, _I64))

    return sig, codegen


# ---------------------------------------------------------------- small helpers


@njit(cache=True, nogil=True)
def clock_ns():
    """CLOCK_MONOTONIC in nanoseconds (the same clock as Python's time.monotonic_ns)."""
    ts = np.zeros(2, np.int64)
    _sys_clock_gettime(_CLOCK_MONOTONIC, ts.ctypes.data)
    return ts[0] * 1_000_000_000 + ts[1]


@njit(cache=True, nogil=True)
def _sleep_ns(ns):
    """Sleep *ns* nanoseconds (CLOCK_MONOTONIC); an interrupted sleep just returns early."""
    ts = np.zeros(2, np.int64)
    ts[0] = ns // 1_000_000_000
    ts[1] = ns % 1_000_000_000
    return _sys_clock_nanosleep(_CLOCK_MONOTONIC, ts.ctypes.data)


@njit(cache=True, nogil=True, inline="always")
def pollfd(fd, events):
    """A ``struct pollfd`` as one int64 word: fd (i32; one below 0 is ignored by poll), events."""
    return (np.int64(fd) & 0xFFFFFFFF) | (np.int64(events) << 32)


@njit(cache=True, nogil=True, inline="always")
def revents(word):
    """The revents poll(2) wrote into a pollfd word."""
    return (word >> 48) & 0xFFFF


@njit(cache=True, nogil=True)
def _poll_one(fd, events, timeout_ms):
    """poll(2) one fd; returns its revents (0 on timeout) or -errno."""
    pfd = np.zeros(1, np.int64)
    pfd[0] = pollfd(fd, events)
    r = sys_poll(pfd.ctypes.data, 1, timeout_ms)
    if r < 0:
        return r
    if r == 0:
        return 0
    return revents(pfd[0])


@njit(cache=True, nogil=True)
def _poll_in(fd, timeout_ms):
    """True when a datagram (or an error) is waiting within *timeout_ms* (0: don't wait)."""
    return _poll_one(fd, POLLIN, timeout_ms) > 0


@njit(cache=True, nogil=True)
def _poll_out(fd, timeout_ms):
    """True when the socket can take a send within *timeout_ms*."""
    return _poll_one(fd, _POLLOUT, timeout_ms) > 0


@njit(cache=True, nogil=True)
def _bswap16(v):
    return ((v & 0xFF) << 8) | ((v >> 8) & 0xFF)


@njit(cache=True, nogil=True)
def _bswap32(v):
    return (
        ((v & 0xFF) << 24)
        | (((v >> 8) & 0xFF) << 16)
        | (((v >> 16) & 0xFF) << 8)
        | ((v >> 24) & 0xFF)
    )


@njit(cache=True, nogil=True)
def _sockaddr_word(endpoint):
    """First 8 bytes of a sockaddr_in for ``ip << 16 | port`` (the other 8 are sin_zero)."""
    e = np.int64(endpoint)
    port = e & 0xFFFF
    ip = (e >> 16) & 0xFFFFFFFF
    return _AF_INET | (_bswap16(port) << 16) | (_bswap32(ip) << 32)


@njit(cache=True, nogil=True)
def _endpoint_of(word):
    """``ip << 16 | port`` (uint64) from the first word of a sockaddr_in."""
    port = _bswap16((word >> 16) & 0xFFFF)
    ip = _bswap32((word >> 32) & 0xFFFFFFFF)
    return np.uint64((ip << 16) | port)


# ---------------------------------------------------------------- receive


@njit(cache=True, nogil=True)
def recv_batch_kernel(fd, buf, offs, lens, srcs, max_n, timeout_ms, state):
    """Receive up to *max_n* datagrams into *buf*; return how many (0 on nothing or error).

    Datagram k is ``buf[offs[k]:offs[k] + lens[k]]`` from ``srcs[k]``. Each recvmmsg message
    gets its own 64 KiB slot of *buf*; a GRO run (``UDP_GRO`` cmsg) is split in place into its
    segments, back to back, so nothing is copied. Without the cmsg a message is one datagram.
    Receives repeat (non-blocking) while the last call filled every message it offered, *buf*
    has room for another 64 KiB run and the arrays for 64 more datagrams. When nothing is
    waiting at the first call it polls up to *timeout_ms* (0: return at once).

    Trusts its arguments: buf uint8 C-contiguous, offs int64, lens int32, srcs uint64, each at
    least *max_n* long; *state* int64 of STATE_LEN. Never raises; errors go to *state*.
    """
    cap_msgs = buf.shape[0] // RUN_BYTES
    if cap_msgs > MAX_MSGS:
        cap_msgs = MAX_MSGS
    if cap_msgs < 1 or max_n < 1:
        return 0
    mm = np.zeros(cap_msgs * _MMSG_W, np.int64)
    iov = np.zeros(cap_msgs * _IOV_W, np.int64)
    names = np.zeros(cap_msgs * _NAME_W, np.int64)
    ctrl = np.zeros(cap_msgs * _CTRL_W, np.int64)
    mm_p = mm.ctypes.data
    iov_p = iov.ctypes.data
    names_p = names.ctypes.data
    ctrl_p = ctrl.ctypes.data
    buf_p = buf.ctypes.data
    n = 0
    pos = 0
    waited = False
    state[ST_RECV_FULL] = 0
    while True:
        # Messages to offer: room in buf for whole runs, and in the arrays for 64 segments each.
        k = (buf.shape[0] - pos) // RUN_BYTES
        by_count = (max_n - n) // MAX_SEGMENTS_PER_RUN
        if by_count < k:
            k = by_count
        if k > cap_msgs:
            k = cap_msgs
        if k < 1:
            if n > 0:
                state[ST_RECV_FULL] = 1  # every message taken was full: more may wait
                break
            k = 1  # a small batch still takes one run; segments beyond max_n are counted lost
        for m in range(k):
            w = m * _MMSG_W
            mm[w + 0] = names_p + 8 * m * _NAME_W
            mm[w + 1] = 16  # sizeof(struct sockaddr_in); the kernel overwrites it
            mm[w + 2] = iov_p + 8 * m * _IOV_W
            mm[w + 3] = 1
            mm[w + 4] = ctrl_p + 8 * m * _CTRL_W
            mm[w + 5] = 8 * _CTRL_W
            mm[w + 6] = 0
            mm[w + 7] = 0
            iov[m * _IOV_W] = buf_p + pos + m * RUN_BYTES
            iov[m * _IOV_W + 1] = RUN_BYTES
        got = _sys_recvmmsg(fd, mm_p, k, _MSG_DONTWAIT)
        state[ST_RECV_CALLS] += 1
        if got < 0:
            err = -got
            if err == _EAGAIN:
                if n == 0 and timeout_ms > 0 and not waited:
                    waited = True
                    state[ST_RECV_CALLS] += 1
                    if _poll_one(fd, POLLIN, timeout_ms) > 0:
                        continue
                break
            if err != _EINTR:
                state[ST_RECV_ERRNO] = err
                state[ST_RECV_ERRORS] += 1
            break
        for m in range(got):
            w = m * _MMSG_W
            total = mm[w + 7] & 0xFFFFFFFF
            flags = mm[w + 6] & 0xFFFFFFFF
            base = pos + m * RUN_BYTES
            src = _endpoint_of(names[m * _NAME_W])
            if flags & _MSG_TRUNC:
                state[ST_TRUNCATED] += 1
                continue
            # Walk the cmsgs (cmsg(3)): CMSG_NXTHDR = align8(cmsg_len) past the header.
            seg = total
            clen = mm[w + 5]
            c = 0
            cb = m * _CTRL_W
            while c + 16 <= clen:
                word_len = ctrl[cb + c // 8]
                lt = ctrl[cb + c // 8 + 1]
                level = lt & 0xFFFFFFFF
                ctype = (lt >> 32) & 0xFFFFFFFF
                if word_len < 16:
                    break
                data = ctrl[cb + c // 8 + 2] & 0xFFFFFFFF
                if level == _SOL_UDP and ctype == _UDP_GRO:
                    if data > 0:
                        seg = data
                        state[ST_GRO_RUNS] += 1
                elif level == _SOL_SOCKET and ctype == _SO_RXQ_OVFL:
                    state[ST_KERNEL_DROPS] = data
                c += (word_len + 7) & ~7
            if total == 0:
                seg = 0
            off = base
            left = total
            while True:
                ln = seg if left > seg else left
                if n >= max_n:
                    state[ST_TRUNCATED] += 1
                else:
                    offs[n] = off
                    lens[n] = ln
                    srcs[n] = src
                    n += 1
                off += ln
                left -= ln
                if left <= 0:
                    break
        pos += got * RUN_BYTES
        if got < k:
            break  # the queue is (probably) empty: don't pay for a syscall that says EAGAIN
        if n >= max_n:
            state[ST_RECV_FULL] = 1
            break
    state[ST_RX_DATAGRAMS] += n
    return n


# ---------------------------------------------------------------- send


def new_send_scratch(max_msgs: int = MAX_MSGS) -> np.ndarray:
    """Scratch for ``send_batch_kernel``: room for *max_msgs* messages per sendmmsg call."""
    return np.zeros(max(1, max_msgs) * SEND_SCRATCH_WORDS_PER_MSG, np.int64)


def new_gather_scratch() -> np.ndarray:
    """Scratch for ``send_gather_kernel`` (kept by its caller: every call fills what it uses)."""
    return np.zeros(GATHER_SCRATCH_WORDS, np.int64)


def new_state() -> np.ndarray:
    """A zeroed ``state`` array for one socket."""
    return np.zeros(STATE_LEN, np.int64)


@njit(cache=True, nogil=True)
def _run_length(offs, lens, dsts, i, n):
    """Datagrams from i that one GSO message can carry: same destination, back to back in buf,
    and a run _gso_run allows."""
    m = i + 1
    while m < n and m - i < MAX_SEGMENTS_PER_RUN:
        if dsts[m] != dsts[i] or offs[m] != offs[m - 1] + lens[m - 1]:
            break
        m += 1
    return _gso_run(lens, 0, i, m)


@njit(cache=True, nogil=True)
def _gso_run(lens, extra, i, m):
    """Datagrams from i (before m) of sizes extra + lens[k] that one GSO message can carry: the
    same size (the last may be shorter), <= 64 segments and <= 65507 bytes in all."""
    seg = extra + np.int64(lens[i])
    total = seg
    j = i + 1
    if seg <= 0:
        return 1
    while j < m and j - i < MAX_SEGMENTS_PER_RUN:
        ln = extra + np.int64(lens[j])
        if ln > seg or ln <= 0 or total + ln > MAX_UDP_PAYLOAD:
            break
        total += ln
        j += 1
        if ln < seg:
            break  # only the last segment of a GSO message may be shorter (udp(7))
    return j - i


@njit(cache=True, nogil=True)
def _scratch_layout(cap, iov_words):
    """Where a send scratch of *cap* messages keeps each part (int64 words): the mmsghdrs from
    0, then *iov_words* of iovecs a message, the sockaddrs, the cmsgs."""
    iov_w = cap * _MMSG_W
    name_w = iov_w + cap * iov_words
    return iov_w, name_w, name_w + cap * _NAME_W


@njit(cache=True, nogil=True)
def _message(scratch, sp, w, name_w, iov_w, iov_count, ctrl_w, gso_size, dst):
    """Fill the mmsghdr at scratch[w:] for one sendmmsg message to *dst* (its sockaddr_in at
    scratch[name_w:]) of *iov_count* iovecs at scratch[iov_w:]; *gso_size* > 0 adds the
    UDP_SEGMENT cmsg at scratch[ctrl_w:] that makes it a GSO run. *sp*: scratch's address."""
    scratch[name_w] = _sockaddr_word(dst)
    scratch[name_w + 1] = 0
    scratch[w + 0] = sp + 8 * name_w
    scratch[w + 1] = 16  # sizeof(struct sockaddr_in)
    scratch[w + 2] = sp + 8 * iov_w
    scratch[w + 3] = iov_count
    if gso_size > 0:
        scratch[ctrl_w] = 18  # CMSG_LEN(sizeof(u16))
        scratch[ctrl_w + 1] = _SOL_UDP | (_UDP_SEGMENT << 32)
        scratch[ctrl_w + 2] = gso_size & 0xFFFF  # u16 (udp(7))
        scratch[w + 4] = sp + 8 * ctrl_w
        scratch[w + 5] = 8 * _SEND_CTRL_W  # CMSG_SPACE(sizeof(u16))
    else:
        scratch[w + 4] = 0
        scratch[w + 5] = 0
    scratch[w + 6] = 0
    scratch[w + 7] = 0


@njit(cache=True, nogil=True)
def send_batch_kernel(fd, buf, offs, lens, dsts, n, scratch, state):
    """Send datagrams 0..n-1 in order; return how many are done (sent, or dropped after a
    permanent error counted in *state*). Less than *n* means the socket stayed full for
    ``_SEND_WAIT_BUDGET_MS``: the caller keeps ``[done:n]`` and retries later.

    Consecutive datagrams to the same destination, of the same length (the last may be
    shorter) and back to back in *buf* go out as one GSO message (``UDP_SEGMENT`` cmsg);
    up to ``len(scratch) // SEND_SCRATCH_WORDS_PER_MSG`` messages go in one sendmmsg.
    Trusts its arguments: buf uint8 C-contiguous, offs int64, lens int32, dsts uint64,
    scratch int64 from new_send_scratch, state int64 of STATE_LEN. Never raises.
    """
    cap = scratch.shape[0] // SEND_SCRATCH_WORDS_PER_MSG
    if cap > MAX_MSGS:
        cap = MAX_MSGS
    if cap < 1 or n <= 0:
        return 0
    mm_w = 0
    iov_w, name_w, ctrl_w = _scratch_layout(cap, _IOV_W)
    sp = scratch.ctypes.data
    buf_p = buf.ctypes.data
    runs = np.zeros(cap, np.int64)
    i = 0
    waited_ms = 0
    while i < n:
        # Build up to cap messages starting at datagram i.
        k = 0
        j = i
        while j < n and k < cap:
            r = _run_length(offs, lens, dsts, j, n)
            total = np.int64(0)
            for q in range(j, j + r):
                total += np.int64(lens[q])
            scratch[iov_w + k * _IOV_W] = buf_p + offs[j]
            scratch[iov_w + k * _IOV_W + 1] = total
            _message(
                scratch,
                sp,
                mm_w + k * _MMSG_W,
                name_w + k * _NAME_W,
                iov_w + k * _IOV_W,
                1,
                ctrl_w + k * _SEND_CTRL_W,
                np.int64(lens[j]) if r > 1 else 0,
                dsts[j],
            )
            runs[k] = r
            k += 1
            j += r
        done, waited_ms = _post(fd, sp + 8 * mm_w, k, runs, state, waited_ms)
        if done < 0:
            break
        i += done
    return i


@njit(cache=True, nogil=True)
def _post(fd, mm_p, k, runs, state, waited_ms):
    """One sendmmsg of the *k* messages built at *mm_p* (message m carries runs[m] datagrams).
    Returns (datagrams done, ms waited so far): done is -1 once the socket stayed full for
    ``_SEND_WAIT_BUDGET_MS``, 0 after a wait for POLLOUT, and a message given up after a
    permanent error counts as done (counted in *state*)."""
    got = _sys_sendmmsg(fd, mm_p, k, _MSG_DONTWAIT)
    state[ST_SEND_CALLS] += 1
    if got > 0:
        done = 0
        for m in range(got):
            done += runs[m]
            state[ST_TX_DATAGRAMS] += runs[m]
            if runs[m] > 1:
                state[ST_GSO_RUNS] += 1
        return done, waited_ms  # a short count: the next call reports the failing message's error
    err = -got if got < 0 else _EAGAIN
    if err == _EAGAIN or err == _ENOBUFS or err == _EINTR:
        if waited_ms >= _SEND_WAIT_BUDGET_MS:
            return -1, waited_ms
        state[ST_SEND_WAITS] += 1
        state[ST_SEND_CALLS] += 1
        _poll_one(fd, _POLLOUT, _SEND_WAIT_STEP_MS)
        return 0, waited_ms + _SEND_WAIT_STEP_MS
    # Permanent for this message (EMSGSIZE, EINVAL, EPERM, ENETUNREACH, ...): drop it.
    state[ST_SEND_ERRNO] = err
    state[ST_SEND_DROPPED] += runs[0]
    return runs[0], waited_ms


@njit(cache=True, nogil=True)
def send_gather_kernel(fd, heads, head_len, body, body_offs, body_lens, dst, n, scratch, state):
    """Send datagrams 0..n-1 to *dst*, datagram k being ``heads[k * head_len:(k + 1) *
    head_len]`` followed by ``body[body_offs[k]:body_offs[k] + body_lens[k]]``, without laying
    them out in one buffer first: each message gathers its datagrams' pieces with an iovec per
    piece, and the kernel copies them once, into its socket buffers, as the NIC's DMA engine
    reads a registered buffer. Runs of equal-size datagrams go as GSO messages, like
    send_batch_kernel, whose return value and errors this shares.
    Trusts its arguments: heads and body uint8 C-contiguous, heads holding n headers, body_offs
    int64 and body_lens int32 of at least n with every range inside body, scratch int64 of
    GATHER_SCRATCH_WORDS (new_gather_scratch), state of STATE_LEN.
    """
    if n <= 0:
        return 0
    iov_w, name_w, ctrl_w = _scratch_layout(MAX_MSGS, _GATHER_IOV_W)
    sp = scratch.ctypes.data
    heads_p = heads.ctypes.data
    body_p = body.ctypes.data
    runs = np.zeros(MAX_MSGS, np.int64)
    i = 0
    waited_ms = 0
    while i < n:
        k = 0
        j = i
        while j < n and k < MAX_MSGS:
            r = _gso_run(body_lens, head_len, j, n)
            iv = iov_w + k * _GATHER_IOV_W
            for q in range(r):
                scratch[iv + 4 * q] = heads_p + (j + q) * head_len
                scratch[iv + 4 * q + 1] = head_len
                scratch[iv + 4 * q + 2] = body_p + body_offs[j + q]
                scratch[iv + 4 * q + 3] = body_lens[j + q]
            _message(
                scratch,
                sp,
                k * _MMSG_W,
                name_w + k * _NAME_W,
                iv,
                2 * r,
                ctrl_w + k * _SEND_CTRL_W,
                head_len + np.int64(body_lens[j]) if r > 1 else 0,
                dst,
            )
            runs[k] = r
            k += 1
            j += r
        done, waited_ms = _post(fd, sp, k, runs, state, waited_ms)
        if done < 0:
            break
        i += done
    return i


# ---------------------------------------------------------------- benchmark loops
# The hot loops of `netdam bench datapath` (netdam/tools/bench/datapath.py runs each in its own
# process). Times are CLOCK_MONOTONIC ns, shared by every process on the machine, so the parent
# can hand all of them one measurement window.

#: counts[] of _feed_run
FEED_SENT_IN_WINDOW = 0
FEED_SENT_TOTAL = 1
FEED_LEFT_BEHIND = 2
FEED_WRITTEN_OFF = 3
FEED_PROGRESS_BASE = 4  # set by the caller: progress[0] before the first call of a phase
#: Window pacing: how long delivery may stall before the feeder writes in-flight data off, and
#: how long it sleeps while the window is full.
_STALL_NS = 5_000_000
_PACE_SLEEP_NS = 20_000
#: counts[] of _relay_run
RELAY_RX = 0
RELAY_TX = 1
RELAY_LEFT_BEHIND = 2
RELAY_TX_IN_WINDOW = 3  # filled by the caller (netdam/tools/bench/datapath.py)
#: counts[] of _sink_run
SINK_RX_IN_WINDOW = 0
SINK_VERIFIED_IN_WINDOW = 1
SINK_MISMATCHES = 2
SINK_RX_TOTAL = 3
SINK_VERIFIED_TOTAL = 4
SINK_STALE = 5  # datagrams of an earlier phase (their seq tag is older): neither good nor bad
#: The benchmark's CHAIN_ADD seq is ``tag << SEQ_TAG_SHIFT | packet``: the tag names the phase
#: that sent it, so a sink can tell a late datagram of the previous phase (still queued in a
#: socket or in the loopback backlog when the next phase starts) from a wrong one.
SEQ_TAG_SHIFT = 24
COUNTS_LEN = 8


@njit(cache=True, nogil=True)
def _feed_run(
    fd, pkts, n_pkts, batch, scratch, state, t_start, t_end, counts, progress, window, i0
):
    """Resend datagrams [0, n_pkts) in batches of *batch* (n_pkts a multiple of batch) until
    *t_end*; count what was sent inside [t_start, t_end).

    *window* 0: as fast as the socket takes them (on loopback the sender is never paced: the
    receiver drops what does not fit). *window* > 0: at most *window* datagrams in flight, where
    delivered = ``progress[0]`` (the sink's running count, in shared memory) minus
    ``counts[FEED_PROGRESS_BASE]``; when delivery stalls for ``_STALL_NS`` the datagrams in
    flight are written off as lost, so a loss never stops the feeder. *counts* carries the
    state across calls, so a phase may be run in several calls (the caller samples CPU time
    between them); *i0* is where the previous call stopped in the packet list. Returns the
    next *i0*."""
    buf, offs, lens, dsts, _slot = pkts
    i = i0
    base = counts[FEED_PROGRESS_BASE]
    last_seen = progress[0]
    last_change = clock_ns()
    while True:
        now = clock_ns()
        if now >= t_end:
            break
        if window > 0:
            seen = progress[0]
            if seen != last_seen:
                last_seen = seen
                last_change = now
            in_flight = counts[FEED_SENT_TOTAL] - (seen - base) - counts[FEED_WRITTEN_OFF]
            if in_flight + batch > window:
                if now - last_change > _STALL_NS:  # loss: what is in flight will not arrive
                    counts[FEED_WRITTEN_OFF] += in_flight
                    last_change = now
                else:
                    _sleep_ns(_PACE_SLEEP_NS)
                continue
        done = send_batch_kernel(
            fd,
            buf,
            offs[i : i + batch],
            lens[i : i + batch],
            dsts[i : i + batch],
            batch,
            scratch,
            state,
        )
        counts[FEED_SENT_TOTAL] += done
        counts[FEED_LEFT_BEHIND] += batch - done
        if now >= t_start:
            counts[FEED_SENT_IN_WINDOW] += done
        i += batch
        if i >= n_pkts:
            i = 0
    return i


@njit(cache=True, nogil=True)
def _relay_run(fd, buf, offs, lens, srcs, dsts, max_n, scratch, state, dst, t_stop, counts):
    """Bare relay: receive a batch (GRO), send the same bytes on to *dst* (GSO), no other work,
    until *t_stop*. What the socket would not take within the send budget is dropped, counted."""
    while clock_ns() < t_stop:
        n = recv_batch_kernel(fd, buf, offs, lens, srcs, max_n, 10, state)
        if n == 0:
            continue
        for k in range(n):
            dsts[k] = dst
        done = send_batch_kernel(fd, buf, offs, lens, dsts, n, scratch, state)
        counts[RELAY_RX] += n
        counts[RELAY_TX] += done
        counts[RELAY_LEFT_BEHIND] += n - done
    return counts[RELAY_TX]


@njit(cache=True, nogil=True)
def _sink_run(fd, rx, buf64, max_n, state, check, phase, counts, progress):
    """Count datagrams until *t_stop*; with *verify*, a datagram counts as verified when it is
    *pkt_len* bytes, its seq (the header's, big-endian) carries *tag* above
    ``SEQ_TAG_SHIFT`` and its payload equals row ``seq & row mask`` of *expect64* bitwise.
    A datagram tagged with an earlier phase (1 <= its tag < *tag*) is counted as stale: it was
    sent before this phase began, so it says nothing about this phase's sums. Every other
    datagram is a mismatch. *buf64* is *buf* viewed as uint64; payloads must be 8-aligned in
    buf (runs start at 64 KiB boundaries; pkt_len and payload_off are multiples of 8).
    ``progress[0]`` (shared memory) gets the running count of received datagrams, for a
    window-paced feeder."""
    buf, offs, lens, srcs = rx
    expect64, pkt_len, payload_off, verify, tag = check
    t_start, t_end, t_stop = phase
    words = expect64.shape[1]
    rows = expect64.shape[0]
    row_mask = (np.int64(1) << SEQ_TAG_SHIFT) - 1
    while True:
        now = clock_ns()
        if now >= t_stop:
            break
        n = recv_batch_kernel(fd, buf, offs, lens, srcs, max_n, 10, state)
        if n == 0:
            continue
        now = clock_ns()
        inside = now >= t_start and now < t_end
        good = 0
        for k in range(n):
            if not verify:
                continue
            o = offs[k]
            seq = np.int64(-1)
            if lens[k] >= H_SEQ + 4:
                seq = np.int64(rd32(buf, o + H_SEQ))
                seq_tag = seq >> SEQ_TAG_SHIFT
                if seq_tag >= 1 and seq_tag < tag:
                    counts[SINK_STALE] += 1
                    continue
            ok = lens[k] == pkt_len and (o + payload_off) % 8 == 0 and (seq >> SEQ_TAG_SHIFT) == tag
            if ok:
                row = seq & row_mask
                if row >= rows:
                    ok = False
                else:
                    w0 = (o + payload_off) // 8
                    for w in range(words):
                        if buf64[w0 + w] != expect64[row, w]:
                            ok = False
                            break
            if ok:
                good += 1
            else:
                counts[SINK_MISMATCHES] += 1
        counts[SINK_RX_TOTAL] += n
        progress[0] += n
        counts[SINK_VERIFIED_TOTAL] += good
        if inside:
            counts[SINK_RX_IN_WINDOW] += n
            counts[SINK_VERIFIED_IN_WINDOW] += good
    return counts[SINK_RX_TOTAL]


# ---------------------------------------------------------------- checked entries for Python callers


def _check_io_arrays(
    buf: np.ndarray, offs: np.ndarray, lens: np.ndarray, addrs: np.ndarray, n: int
) -> None:
    if (
        buf.dtype != np.uint8
        or offs.dtype != np.int64
        or lens.dtype != np.int32
        or addrs.dtype != np.uint64
    ):
        raise ValueError(
            "batch arrays must be uint8 buffer, int64 offsets, int32 lengths, uint64 addresses"
        )
    if not 0 <= n <= min(offs.shape[0], lens.shape[0], addrs.shape[0]):
        raise ValueError(f"batch of {n} does not fit its arrays")


def recv_batch(
    fd: int,
    buf: np.ndarray,
    offs: np.ndarray,
    lens: np.ndarray,
    srcs: np.ndarray,
    max_n: int,
    timeout_ms: int,
    state: np.ndarray,
) -> int:
    """recvmmsg with GRO into *buf* (datagram k at buf[offs[k]:offs[k]+lens[k]] from srcs[k]);
    waits up to *timeout_ms* for the first; returns how many arrived."""
    _check_io_arrays(buf, offs, lens, srcs, max_n)
    if state.shape[0] < STATE_LEN:
        raise ValueError(f"I/O state needs {STATE_LEN} words (new_state())")
    return int(recv_batch_kernel(fd, buf, offs, lens, srcs, max_n, timeout_ms, state))


def send_batch(
    fd: int,
    buf: np.ndarray,
    offs: np.ndarray,
    lens: np.ndarray,
    dsts: np.ndarray,
    n: int,
    scratch: np.ndarray,
    state: np.ndarray,
) -> int:
    """sendmmsg (runs of equal-size datagrams to one destination as GSO); returns how many left."""
    _check_io_arrays(buf, offs, lens, dsts, n)
    if n and int(offs[n - 1]) + int(lens[n - 1]) > buf.shape[0]:
        raise ValueError("a datagram reaches past the send buffer")
    if scratch.shape[0] < MAX_MSGS * SEND_SCRATCH_WORDS_PER_MSG or state.shape[0] < STATE_LEN:
        raise ValueError("send scratch or I/O state too small (new_send_scratch(), new_state())")
    return int(send_batch_kernel(fd, buf, offs, lens, dsts, n, scratch, state))


def send_gather(
    fd: int,
    heads: np.ndarray,
    head_len: int,
    body: np.ndarray,
    body_offs: np.ndarray,
    body_lens: np.ndarray,
    dst: int,
    n: int,
    scratch: np.ndarray,
    state: np.ndarray,
) -> int:
    """send_gather_kernel, checked: datagram k is header k of *heads* then its slice of *body*
    (every slice inside *body*, every datagram within one UDP payload); returns how many are
    done (fewer than *n*: the socket stayed full, send the rest later). *scratch*:
    new_gather_scratch(), kept across calls."""
    for name, arr in (("heads", heads), ("body", body)):
        if arr.dtype != np.uint8 or arr.ndim != 1 or not arr.flags.c_contiguous:
            raise ValueError(f"{name} must be a C-contiguous uint8 array")
    if body_offs.dtype != np.int64 or body_lens.dtype != np.int32:
        raise ValueError("body offsets must be int64 and body lengths int32")
    if not 0 <= n <= min(body_offs.shape[0], body_lens.shape[0]) or n * head_len > heads.shape[0]:
        raise ValueError(f"{n} datagrams do not fit their header and body arrays")
    if head_len < 0 or state.shape[0] < STATE_LEN:
        raise ValueError(f"a header has {head_len} bytes; the I/O state needs {STATE_LEN} words")
    if scratch.dtype != np.int64 or scratch.ndim != 1 or scratch.shape[0] < GATHER_SCRATCH_WORDS:
        raise ValueError("gather scratch too small (new_gather_scratch())")
    if n:
        offs, lens = body_offs[:n], body_lens[:n].astype(np.int64)
        if int(offs.min()) < 0 or int(lens.min()) < 0 or int((offs + lens).max()) > body.shape[0]:
            raise ValueError("a datagram's body reaches outside the body array")
        if head_len + int(lens.max()) > MAX_UDP_PAYLOAD:
            raise ValueError(f"a datagram exceeds the largest UDP payload ({MAX_UDP_PAYLOAD} B)")
    return int(
        send_gather_kernel(
            fd,
            heads,
            np.int64(head_len),
            body,
            body_offs,
            body_lens,
            np.uint64(dst),
            n,
            scratch,
            state,
        )
    )


def feed_run(
    fd: int,
    pkts: Any,
    n_pkts: int,
    batch: int,
    scratch: np.ndarray,
    state: np.ndarray,
    t_start: int,
    t_end: int,
    counts: np.ndarray,
    progress: np.ndarray,
    window: int,
    i0: int,
) -> int:
    """Benchmark feeder (see _feed_run); *pkts* a TxQueue of the datagrams to cycle through."""
    _check_io_arrays(pkts.buf, pkts.off, pkts.len, pkts.dst, n_pkts)
    if counts.shape[0] < COUNTS_LEN or batch < 1:
        raise ValueError("feed_run: counts too short or batch < 1")
    return int(
        _feed_run(
            fd, pkts, n_pkts, batch, scratch, state, t_start, t_end, counts, progress, window, i0
        )
    )


def relay_run(
    fd: int,
    buf: np.ndarray,
    offs: np.ndarray,
    lens: np.ndarray,
    srcs: np.ndarray,
    dsts: np.ndarray,
    max_n: int,
    scratch: np.ndarray,
    state: np.ndarray,
    dst: Any,
    t_stop: int,
    counts: np.ndarray,
) -> None:
    """Benchmark relay that forwards without work (see _relay_run)."""
    _check_io_arrays(buf, offs, lens, srcs, max_n)
    if dsts.shape[0] < max_n or counts.shape[0] < COUNTS_LEN:
        raise ValueError("relay_run: destination or counts arrays too short")
    _relay_run(fd, buf, offs, lens, srcs, dsts, max_n, scratch, state, dst, t_stop, counts)


def sink_run(
    fd: int,
    rx: Any,
    buf64: np.ndarray,
    max_n: int,
    state: np.ndarray,
    check: Any,
    phase: Any,
    counts: np.ndarray,
    progress: np.ndarray,
) -> None:
    """Benchmark sink (see _sink_run); *rx* an RxBatch, *check* a SinkCheck, *phase* a TimeWindow."""
    _check_io_arrays(rx.buf, rx.off, rx.len, rx.src, max_n)
    if buf64.shape[0] * 8 > rx.buf.shape[0] or counts.shape[0] < COUNTS_LEN:
        raise ValueError("sink_run: buf64 must view the receive buffer; counts too short")
    _sink_run(fd, rx, buf64, max_n, state, check, phase, counts, progress)
