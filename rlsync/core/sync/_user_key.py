"""The key every rlsync process of one user on one host holds without anyone typing it: what proves a trainer to an
engine's HTTP routes (vLLM's weight-transfer routes answer anyone who reaches the server's port).

``user_key()`` is ``RLSYNC_SECRET`` where it is set (across hosts: give every process the same), else this user's key
file (``RLSYNC_KEY_FILE``, default ``$XDG_CONFIG_HOME/rlsync/key`` or ``~/.config/rlsync/key``), made on first use with
256 random bits, readable by its owner alone: like a notebook server's token file, it separates this user's processes
from other users' and from every other host, not from another process of the same user (which can read the engine's
memory anyway)."""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from rlsync.core._errors import ConfigError
from rlsync.core.sync._control import check_secret

KEY_FILE_ENV = "RLSYNC_KEY_FILE"


def key_file() -> Path:
    """Where this user's key lives (``RLSYNC_KEY_FILE``, else under the XDG config directory)."""
    if os.environ.get(KEY_FILE_ENV):
        return Path(os.environ[KEY_FILE_ENV])
    config = os.environ.get("XDG_CONFIG_HOME") or os.path.join(Path.home(), ".config")
    return Path(config) / "rlsync" / "key"


def user_key() -> bytes:
    """``RLSYNC_SECRET`` (at least 128 bits), else this user's key file, made if missing (mode 0600). A key file that
    another user owns, that others may read, or that holds a weak key is refused, naming the file."""
    secret = os.environ.get("RLSYNC_SECRET")
    if secret:
        check_secret(secret, "RLSYNC_SECRET")
        return secret.encode()
    path = key_file()
    if not path.exists():
        _make(path)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise ConfigError(f"rlsync's key file {path} must be a file of this user's that nobody else may read "
                              f"(chmod 600 {path}), or set RLSYNC_SECRET")
        key = os.read(fd, 4096).decode(errors="replace").strip()
    finally:
        os.close(fd)
    check_secret(key, f"the key in {path}")
    return key.encode()


def _make(path: Path) -> None:
    """A fresh key at ``path``, atomically: a process that makes it at the same time as another reads the winner's."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    draft = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, (secrets.token_urlsafe(32) + "\n").encode())
    finally:
        os.close(fd)
    try:
        os.link(draft, path)  # fails where another process made it first: its key stands
    except FileExistsError:
        pass
    finally:
        os.unlink(draft)
