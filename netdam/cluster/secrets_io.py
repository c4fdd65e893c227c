"""Where a process's admin key comes from, and how key-bearing files are written.

The admin key authorizes every control opcode of a cluster (SPEC.md section 8), so it never
travels on a command line, which every local user reads in ``ps`` and ``/proc/PID/cmdline``:
a node or switch reads it from a file only its owner can read (``--admin-key-file``) or from
a descriptor its parent hands it (``--admin-key-fd``, a pipe). Files that hold keys (cluster
files, the pool's state) are created mode 0600, before a byte is written.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from netdam.protocol.errors import NetdamError

#: Mode bits that let anyone but the owner read or change a key file.
_NOT_OWNER = stat.S_IRWXG | stat.S_IRWXO


class KeyFileError(NetdamError, ValueError):
    """A key file or descriptor that cannot be used; the message names the fix."""


def parse_key(text: str, where: str, bits: int = 32) -> int:
    """A *bits*-bit key written as hex (0x...) or decimal, surrounding whitespace ignored."""
    value = text.strip()
    try:
        key = int(value, 0)
    except ValueError:
        raise KeyFileError(
            f"{where} holds {value[:20]!r}, not a key: write one number, e.g. 0x1a2b3c4d"
        ) from None
    if not 0 < key < 1 << bits:
        raise KeyFileError(f"{where} holds {key}: a key is 1..2^{bits}-1")
    return key


def read_key_file(path: Path, what: str = "admin key", bits: int = 32) -> int:
    """The key in *path*, which must be a regular file no one but its owner can read (*what*
    names the key in errors: the admin key, 32 bits; a pool tenant credential, 64)."""
    check_private(path, what)
    return parse_key(path.read_text(), f"{what} file {path}", bits)


def check_private(path: Path, what: str) -> None:
    """*path* is a regular file no one but its owner can read (*what* names it in errors)."""
    try:
        info = path.stat()
    except FileNotFoundError:
        raise KeyFileError(
            f"{what} file {path} not found: write the key there (mode 0600)"
        ) from None
    if not stat.S_ISREG(info.st_mode):
        raise KeyFileError(f"{what} file {path} is not a regular file")
    if info.st_mode & _NOT_OWNER:
        raise KeyFileError(
            f"{what} file {path} is readable by others (mode {stat.S_IMODE(info.st_mode):04o}): "
            f"run `chmod 600 {path}`"
        )


def parse_admin_keys(text: str, where: str) -> tuple[int, bytes]:
    """The admin key and, when given after it, the 128-bit admin tag key as 32 hex digits
    (SPEC.md 2.6, "Control tags"; b"" without one): what ``--admin-key-file`` and
    ``--admin-key-fd`` hold."""
    words = text.split()
    if len(words) not in (1, 2):
        raise KeyFileError(
            f"{where} holds {len(words)} words: write the admin key, optionally followed by the "
            "admin tag key as 32 hex digits, e.g. `0x1a2b3c4d 00112233445566778899aabbccddeeff`"
        )
    key = parse_key(words[0], where)
    if len(words) == 1:
        return key, b""
    try:
        tag_key = bytes.fromhex(words[1])
    except ValueError:
        tag_key = b""
    if len(tag_key) != 16 or not any(tag_key):
        raise KeyFileError(
            f"{where}: the admin tag key after the admin key must be 32 hex digits, not all zero"
        )
    return key, tag_key


def read_admin_key_file(path: Path) -> tuple[int, bytes]:
    """The admin key and admin tag key (b"" when absent) of ``--admin-key-file`` *path*."""
    check_private(path, "admin key")
    return parse_admin_keys(path.read_text(), f"admin key file {path}")


def read_key_fd(fd: int) -> tuple[int, bytes]:
    """The admin key and admin tag key (b"" when absent) written into inherited descriptor
    *fd* (read to its end, then closed)."""
    chunks = []
    try:
        while chunk := os.read(fd, 64):
            chunks.append(chunk)
            if sum(map(len, chunks)) > 128:
                break
    except OSError as exc:
        raise KeyFileError(
            f"--admin-key-fd {fd}: {exc.strerror}: pass a descriptor this process inherited"
        ) from None
    finally:
        try:
            os.close(fd)
        except OSError:
            pass
    return parse_admin_keys(b"".join(chunks).decode("ascii", "replace"), f"--admin-key-fd {fd}")


def key_pipe(key: int, tag_key: bytes = b"") -> int:
    """A pipe whose read end holds the admin *key* and admin *tag_key* for a child
    (``pass_fds``); returns the read end. The write end is closed once written: the child reads
    to the end of it."""
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, f"0x{key:08x} {tag_key.hex()}\n".encode())
    finally:
        os.close(write_end)
    return read_end


def write_private(path: Path, text: str) -> None:
    """Write *text* to *path* atomically, the file mode 0600 from its creation on (a file that
    holds keys is never readable by others, not even between create and chmod)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(
            tmp, 0o600
        )  # an existing tmp kept its old mode: O_CREAT's mode applies to new files
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_tag_key_file(path: Path) -> bytes:
    """A tagged region's 16-byte tag key from *path* (0600), written as 0x and 32 hex digits,
    the key's bytes in order (`netdam pool alloc --save-tag-key` writes one)."""
    return read_key_file(path, what="tag key", bits=128).to_bytes(16, "big")


def tag_key_text(key: bytes) -> str:
    """What read_tag_key_file reads back as *key*."""
    return f"0x{key.hex()}\n"
