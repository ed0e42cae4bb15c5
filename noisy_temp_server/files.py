"""Writing files so that a reader never sees a partial one."""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from pathlib import Path

__all__ = ["default_cache_dir", "sha256_file", "write_atomically"]

_HASH_CHUNK_BYTES = 1 << 22


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/noisy-temp-server`, or `~/.cache/noisy-temp-server`.

    The product's own folder: the only one it writes into besides the outputs it is told to
    write."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "noisy-temp-server"


def write_atomically(path: Path, data: bytes) -> None:
    """Write `data` to `path`: to a temporary file beside it, then renamed over it, so a reader
    sees the old file or the whole new one and a failed write leaves nothing behind.

    The data are flushed to the disk before the rename, so a crash leaves the old file or the
    new one; a writer killed before the rename may leave its temporary file
    (`.<name>.<pid>.<thread>.tmp`) behind. The folder must exist; any failure to write (no
    folder, a read-only or full disk) is an OSError. The file gets the umask's permissions, like
    any file Python creates (safetensors' own `save_file` makes its files 0600, which a server
    running as another user, as the Docker image does, could not read). Safe from several
    threads and processes at once: each writer stages under its own name, and the last rename
    wins.
    """
    path = Path(path)
    staging = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with staging.open("wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(staging, path)
    except BaseException:
        with contextlib.suppress(OSError):
            staging.unlink(missing_ok=True)
        raise


def sha256_file(path: Path) -> str:
    """Hex sha256 of the file at `path`, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()
