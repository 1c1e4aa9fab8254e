"""``LocalStorage``: blobs as files under a root directory; the embedded default.

``create`` follows Spark's ``CheckpointFileManager`` (write a temp file, then
publish it with one atomic step):

1. Create the blob's directory (fsyncing each parent of a new directory).
2. Write ``data`` to ``<dir>/.tmp-<uuid>`` in the same directory, flush, fsync.
3. Publish: ``os.link(tmp, final)`` when not overwriting (atomic, fails with
   EEXIST if ``final`` exists, so exactly one racing creator wins), else
   ``os.replace(tmp, final)`` (atomic replace). This is the only step at which
   the blob becomes visible.
4. fsync the directory, so that the published name survives a machine
   crash, then remove the temp name (after a link).

On any failure the temp file is removed; a crash of the process leaves only a
``.tmp-`` file, which listings skip and ``delete`` of an enclosing directory
removes. The filesystem must support hard links (local disks do; some network
or FUSE mounts do not, and ``create`` then fails with a ``StorageError``).

``delete`` removes the directories it leaves empty, up to (not including) the
root. A concurrent ``create`` in such a directory retries if the directory
vanishes under it.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import sys
import uuid
from pathlib import Path

from spark_state.errors import BlobExistsError, BlobNotFoundError, ShortReadError, StorageError
from spark_state.storage.base import TEMP_PREFIX, Storage, check_path, check_range

_MAKE_DIR_ATTEMPTS = 10
"""How often ``create`` re-creates a directory that a concurrent ``delete`` pruned."""


class LocalStorage(Storage):
    """Blobs as files below ``root`` (made absolute; created on the first write)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = os.path.abspath(os.fspath(root))
        self.uri = Path(self.root).as_uri()

    def __repr__(self) -> str:
        return f"LocalStorage({self.root!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LocalStorage) and other.root == self.root

    def __hash__(self) -> int:
        return hash((LocalStorage, self.root))

    def create(self, path: str, data: bytes, *, overwrite: bool = False) -> None:
        check_path(path)
        final = self._local(path)
        tmp = self._write_temp(path, data)
        try:
            self._publish(path, tmp, final, overwrite)
            _fsync_directory(os.path.dirname(final))
        except StorageError:
            raise  # already typed (BlobExistsError is also an OSError)
        except OSError as err:
            raise self._error("create", path, err) from err
        finally:
            _remove_quietly(tmp)

    def read(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        check_path(path)
        check_range(offset, length)
        try:
            with open(self._local(path), "rb") as file:
                size = os.fstat(file.fileno()).st_size
                end = size if length is None else offset + length
                if offset > size or end > size:
                    raise ShortReadError(
                        f"read at offset {offset}, length {length}, of {path!r} in {self.uri} is past "
                        f"its end ({size} bytes)"
                    )
                file.seek(offset)
                data = file.read(end - offset)
        except OSError as err:
            raise self._error("read", path, err) from err
        if len(data) != end - offset:
            raise ShortReadError(
                f"read at offset {offset}, length {length}, of {path!r} in {self.uri} returned "
                f"{len(data)} bytes; the file was truncated behind the storage's back"
            )
        return data

    def size(self, path: str) -> int:
        check_path(path)
        try:
            info = os.stat(self._local(path))
        except OSError as err:
            raise self._error("size", path, err) from err
        if not stat.S_ISREG(info.st_mode):
            raise BlobNotFoundError(f"{path!r} is a directory, not a blob, in {self.uri}")
        return info.st_size

    def exists(self, path: str) -> bool:
        check_path(path)
        try:
            os.stat(self._local(path))
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError as err:
            raise self._error("exists", path, err) from err
        return True

    def list(self, path: str = "") -> list[str]:
        check_path(path, allow_root=True)
        try:
            names = os.listdir(self._local(path))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as err:
            raise self._error("list", path, err) from err
        return sorted(name for name in names if not name.startswith(TEMP_PREFIX))

    def delete(self, path: str) -> None:
        check_path(path)
        target = self._local(path)
        try:
            info = os.lstat(target)
        except (FileNotFoundError, NotADirectoryError):
            return
        except OSError as err:
            raise self._error("delete", path, err) from err
        try:
            if stat.S_ISDIR(info.st_mode):
                _remove_tree(target)
            else:
                os.unlink(target)
        except FileNotFoundError:
            pass
        except OSError as err:
            raise self._error("delete", path, err) from err
        self._prune_empty_parents(path)

    def _local(self, path: str) -> str:
        return os.path.join(self.root, *path.split("/")) if path else self.root

    def _write_temp(self, path: str, data: bytes) -> str:
        """Steps 1-2: make the blob's directory, write ``data`` to a fresh temp file in it, fsync."""
        directory = os.path.dirname(self._local(path))
        for _ in range(_MAKE_DIR_ATTEMPTS):
            tmp = os.path.join(directory, f"{TEMP_PREFIX}{uuid.uuid4().hex}")
            try:
                self._make_directories(path)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            except StorageError:
                raise
            except FileNotFoundError:
                continue  # a concurrent delete pruned a directory we just made
            except OSError as err:
                raise self._error("create", path, err) from err
            try:
                with os.fdopen(fd, "wb") as file:
                    file.write(data)
                    file.flush()
                    os.fsync(file.fileno())
            except BaseException as err:
                _remove_quietly(tmp)
                if isinstance(err, OSError):
                    raise self._error("create", path, err) from err
                raise
            return tmp
        raise StorageError(
            f"create of {path!r} in {self.uri} failed: its directory was removed "
            f"{_MAKE_DIR_ATTEMPTS} times by concurrent deletes; stop deleting what is being written"
        )

    def _make_directories(self, path: str) -> None:
        """Create the parent directories of ``path`` below the root, fsyncing each new entry's parent.

        Raises ``FileNotFoundError`` when a concurrent delete prunes a directory
        between two steps; the caller retries.
        """
        parent = self.root
        os.makedirs(parent, exist_ok=True)
        for part in path.split("/")[:-1]:
            child = os.path.join(parent, part)
            try:
                os.mkdir(child)
            except FileExistsError:
                if not os.path.isdir(child):
                    blob = os.path.relpath(child, self.root).replace(os.sep, "/")
                    raise BlobExistsError(
                        f"cannot create blob {path!r} in {self.uri}: its parent {blob!r} is a blob"
                    ) from None
            except FileNotFoundError:
                raise
            except OSError as err:
                raise self._error("create", path, err) from err
            else:
                _fsync_directory(parent)
            parent = child

    def _publish(self, path: str, tmp: str, final: str, overwrite: bool) -> None:
        """Step 3: make the complete temp file visible at ``final`` in one atomic step."""
        try:
            if overwrite:
                os.replace(tmp, final)
            else:
                os.link(tmp, final)
        except IsADirectoryError:
            raise BlobExistsError(f"cannot create blob {path!r} in {self.uri}: it is a directory") from None
        except FileExistsError:
            what = "is a directory" if os.path.isdir(final) else "already exists"
            raise BlobExistsError(
                f"blob {path!r} {what} in {self.uri}; delete it or, for a blob, pass overwrite=True"
            ) from None

    def _prune_empty_parents(self, path: str) -> None:
        """Remove the directories above ``path`` that are now empty, deepest first, never the root."""
        parts = path.split("/")
        for depth in range(len(parts) - 1, 0, -1):
            try:
                os.rmdir(self._local("/".join(parts[:depth])))
            except OSError:
                return  # not empty (or already gone): so are its ancestors, or another delete prunes them

    def _error(self, op: str, path: str, err: OSError) -> StorageError:
        """Map an ``OSError`` from ``op`` on ``path`` to the typed error the contract promises."""
        if op == "create":
            if err.errno in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
                return StorageError(
                    f"create of {path!r} in {self.uri} failed ({err}); the filesystem must support "
                    "hard links and fsync: put the storage root on a local disk"
                )
        elif isinstance(err, (FileNotFoundError, NotADirectoryError)):
            return BlobNotFoundError(f"{path!r} does not exist in {self.uri}")
        elif isinstance(err, IsADirectoryError):
            return BlobNotFoundError(f"{path!r} is a directory, not a blob, in {self.uri}")
        return StorageError(f"{op} of {path!r} in {self.uri} failed: {err}")


def _fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_quietly(path: str) -> None:
    """Remove a temp file that may already be gone (published by link+unlink, or by replace)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _remove_tree(directory: str) -> None:
    """``shutil.rmtree``, except that entries a concurrent delete removed first are not errors, and a
    directory that a concurrent create filled again stays, with the new blob."""

    def ignore_missing(function, path, error) -> None:
        error = error[1] if isinstance(error, tuple) else error
        if isinstance(error, FileNotFoundError):
            return
        if function is os.rmdir and isinstance(error, OSError) and error.errno == errno.ENOTEMPTY:
            return  # a concurrent create put a blob here after the listing: it stays (see base.delete)
        raise error

    if sys.version_info >= (3, 12):
        shutil.rmtree(directory, onexc=ignore_missing)
    else:
        shutil.rmtree(directory, onerror=ignore_missing)
