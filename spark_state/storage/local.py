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

A store never leaves its root. Every path below the root is reached one
component at a time from a descriptor of its parent, never through a
symbolic link (``O_NOFOLLOW``; the root itself may be a link, as an
administrator may make it): an operation on a path through a link raises
``StoreLinkError`` and changes nothing, ``list`` leaves links out (with a
line in the log), and ``delete`` removes a link it is asked to delete, never
what it points to. So whoever can write into a store cannot make its owner
read, list or delete anything outside it. Files are created 0644 and
directories 0755, less what the umask takes: never writable by others.
"""

from __future__ import annotations

import builtins
import errno
import logging
import os
import stat
import uuid
from pathlib import Path
from urllib.parse import unquote, urlsplit

from spark_state.errors import (
    BlobExistsError,
    BlobNotFoundError,
    ConfigError,
    ShortReadError,
    StorageError,
    StoreLinkError,
)
from spark_state.storage.base import TEMP_PREFIX, Backend, Storage, check_path, check_range

_MAKE_DIR_ATTEMPTS = 10
"""How often ``create`` re-creates a directory that a concurrent ``delete`` pruned."""
FILE_MODE = 0o644
DIRECTORY_MODE = 0o755
_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_LOG = logging.getLogger(__name__)


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
        *parents, name = path.split("/")
        for _ in range(_MAKE_DIR_ATTEMPTS):
            try:
                directory = self._directory(path, parents, create=True)
            except FileNotFoundError:
                continue  # a concurrent delete pruned a directory just made
            try:
                tmp = self._write_temp(path, directory, data)
                if tmp is None:
                    continue  # its directory was pruned meanwhile
                try:
                    self._publish(path, directory, tmp, name, overwrite)
                    os.fsync(directory)
                except StorageError:
                    raise  # already typed (BlobExistsError is also an OSError)
                except OSError as err:
                    raise self._error("create", path, err) from err
                finally:
                    _remove_quietly(tmp, directory)
                return
            finally:
                os.close(directory)
        raise StorageError(
            f"create of {path!r} in {self.uri} failed: its directory was removed "
            f"{_MAKE_DIR_ATTEMPTS} times by concurrent deletes; stop deleting what is being written"
        )

    def read(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        check_path(path)
        check_range(offset, length)
        try:
            with os.fdopen(self._open_file(path), "rb") as file:
                size = os.fstat(file.fileno()).st_size
                end = size if length is None else offset + length
                if offset > size or end > size:
                    raise ShortReadError(
                        f"read at offset {offset}, length {length}, of {path!r} in {self.uri} is past "
                        f"its end ({size} bytes)"
                    )
                file.seek(offset)
                data = file.read(end - offset)
        except StorageError:
            raise
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
            info = self._lstat(path)
        except StorageError:
            raise
        except OSError as err:
            raise self._error("size", path, err) from err
        if stat.S_ISLNK(info.st_mode):
            raise self._link(path, path)
        if not stat.S_ISREG(info.st_mode):
            raise BlobNotFoundError(f"{path!r} is a directory, not a blob, in {self.uri}")
        return info.st_size

    def exists(self, path: str) -> bool:
        check_path(path)
        try:
            info = self._lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            return False
        except StorageError:
            raise
        except OSError as err:
            raise self._error("exists", path, err) from err
        if stat.S_ISLNK(info.st_mode):
            raise self._link(path, path)
        return True

    def list(self, path: str = "") -> list[str]:
        check_path(path, allow_root=True)
        try:
            directory = self._directory(path, path.split("/") if path else [], create=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except StorageError:
            raise
        except OSError as err:
            raise self._error("list", path, err) from err
        try:
            with os.scandir(directory) as entries:
                names = []
                for entry in entries:
                    if entry.name.startswith(TEMP_PREFIX):
                        continue
                    if entry.is_symlink():
                        _LOG.warning(
                            "%s holds a symbolic link at %r, which spark-state did not write and never "
                            "follows: it is left out of the listing; remove it",
                            self.uri,
                            f"{path}/{entry.name}" if path else entry.name,
                        )
                        continue
                    names.append(entry.name)
        except OSError as err:
            raise self._error("list", path, err) from err
        finally:
            os.close(directory)
        return sorted(names)

    def delete(self, path: str) -> None:
        check_path(path)
        *parents, name = path.split("/")
        try:
            directory = self._directory(path, parents, create=False)
        except (FileNotFoundError, NotADirectoryError):
            return
        except StorageError:
            raise
        except OSError as err:
            raise self._error("delete", path, err) from err
        try:
            info = os.stat(name, dir_fd=directory, follow_symlinks=False)
            if stat.S_ISDIR(info.st_mode):
                _remove_tree(directory, name)
            else:
                if stat.S_ISLNK(info.st_mode):
                    _LOG.warning("deleting the symbolic link %r in %s, not what it points to", path, self.uri)
                os.unlink(name, dir_fd=directory)
        except FileNotFoundError:
            pass
        except OSError as err:
            raise self._error("delete", path, err) from err
        finally:
            os.close(directory)
        self._prune_empty_parents(parents)

    def _directory(self, path: str, parts: builtins.list[str], *, create: bool) -> int:
        """A descriptor of directory ``root/parts...``, reached without following a link below the root; with
        ``create``, each missing level is made (0755 less the umask) and its parent fsynced. The caller closes it.

        ``StoreLinkError`` for a level that is a link; ``FileNotFoundError`` for a missing level (with
        ``create``: one a concurrent delete removed); ``NotADirectoryError`` for a level that is a file (with
        ``create``: ``BlobExistsError``).
        """
        if create:
            os.makedirs(self.root, mode=DIRECTORY_MODE, exist_ok=True)
        directory = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the root may be a link
        try:
            for depth, part in enumerate(parts):
                if create:
                    try:
                        os.mkdir(part, DIRECTORY_MODE, dir_fd=directory)
                    except FileExistsError:
                        pass
                    else:
                        os.fsync(directory)
                try:
                    child = os.open(part, _DIRECTORY, dir_fd=directory)
                except NotADirectoryError:
                    info = os.stat(part, dir_fd=directory, follow_symlinks=False)
                    level = "/".join(parts[: depth + 1])
                    if stat.S_ISLNK(info.st_mode):
                        raise self._link(path, level) from None
                    if create:
                        raise BlobExistsError(
                            f"cannot create blob {path!r} in {self.uri}: its parent {level!r} is a blob"
                        ) from None
                    raise
                os.close(directory)
                directory = child
        except BaseException:
            os.close(directory)
            raise
        return directory

    def _open_file(self, path: str) -> int:
        """A descriptor of the blob ``path``, opened for reading without following a link."""
        *parents, name = path.split("/")
        directory = self._directory(path, parents, create=False)
        try:
            return os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory)
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise self._link(path, path) from None
            raise
        finally:
            os.close(directory)

    def _lstat(self, path: str) -> os.stat_result:
        *parents, name = path.split("/")
        directory = self._directory(path, parents, create=False)
        try:
            return os.stat(name, dir_fd=directory, follow_symlinks=False)
        finally:
            os.close(directory)

    def _link(self, path: str, link: str) -> StoreLinkError:
        _LOG.warning(
            "%s holds a symbolic link at %r, which spark-state did not write and never follows", self.uri, link
        )
        return StoreLinkError(
            f"{path!r} in {self.uri} leads through the symbolic link {link!r}: a store never follows links inside "
            "it (one there may point anywhere). Nothing was read or changed; remove the link"
        )

    def _write_temp(self, path: str, directory: int, data: bytes) -> str | None:
        """Step 2: write ``data`` to a fresh temp file in ``directory``, fsync; its name, or None when the
        directory was removed meanwhile (the caller makes it again)."""
        tmp = f"{TEMP_PREFIX}{uuid.uuid4().hex}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(tmp, flags, FILE_MODE, dir_fd=directory)
        except FileNotFoundError:
            return None  # a concurrent delete pruned the directory after it was opened
        except OSError as err:
            raise self._error("create", path, err) from err
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
        except BaseException as err:
            _remove_quietly(tmp, directory)
            if isinstance(err, OSError):
                raise self._error("create", path, err) from err
            raise
        return tmp

    def _publish(self, path: str, directory: int, tmp: str, name: str, overwrite: bool) -> None:
        """Step 3: make the complete temp file visible as ``name`` in one atomic step."""
        try:
            if overwrite:
                os.replace(tmp, name, src_dir_fd=directory, dst_dir_fd=directory)
            else:
                os.link(tmp, name, src_dir_fd=directory, dst_dir_fd=directory, follow_symlinks=False)
        except IsADirectoryError:
            raise BlobExistsError(f"cannot create blob {path!r} in {self.uri}: it is a directory") from None
        except FileExistsError:
            info = os.stat(name, dir_fd=directory, follow_symlinks=False)
            what = "is a directory" if stat.S_ISDIR(info.st_mode) else "already exists"
            raise BlobExistsError(
                f"blob {path!r} {what} in {self.uri}; delete it or, for a blob, pass overwrite=True"
            ) from None

    def _prune_empty_parents(self, parents: builtins.list[str]) -> None:
        """Remove the directories ``parents`` names that are now empty, deepest first, never the root."""
        for depth in range(len(parents), 0, -1):
            try:
                directory = self._directory("/".join(parents), parents[: depth - 1], create=False)
            except (OSError, StorageError):
                return
            try:
                os.rmdir(parents[depth - 1], dir_fd=directory)
            except OSError:
                return  # not empty (or already gone): so are its ancestors, or another delete prunes them
            finally:
                os.close(directory)

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


def _remove_quietly(name: str, directory: int) -> None:
    """Remove a temp file that may already be gone (published by link+unlink, or by replace)."""
    try:
        os.unlink(name, dir_fd=directory)
    except FileNotFoundError:
        pass


def _remove_tree(parent: int, name: str) -> None:
    """Remove the directory ``name`` in ``parent`` and everything below it, descending by descriptors and never
    through a link (a link is removed, not followed). Entries a concurrent delete removed first are not errors,
    and a directory that a concurrent create filled again stays, with the new blob (see ``base.delete``)."""
    try:
        directory = os.open(name, _DIRECTORY, dir_fd=parent)
    except FileNotFoundError:
        return
    except NotADirectoryError:  # replaced by a file or a link meanwhile: remove that one entry
        os.unlink(name, dir_fd=parent)
        return
    try:
        with os.scandir(directory) as entries:
            children = [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in entries]
        for child, is_directory in children:
            try:
                if is_directory:
                    _remove_tree(directory, child)
                else:
                    os.unlink(child, dir_fd=directory)
            except FileNotFoundError:
                pass
    finally:
        os.close(directory)
    try:
        os.rmdir(name, dir_fd=parent)
    except FileNotFoundError:
        pass
    except OSError as err:
        if err.errno != errno.ENOTEMPTY:
            raise


def open_local(uri: str) -> LocalStorage:
    """A plain path (made absolute against this process's directory) or ``file:///abs/path``."""
    if "://" not in uri and not uri.lower().startswith("file:"):
        return LocalStorage(uri)
    parts = urlsplit(uri)
    if parts.netloc not in ("", "localhost") or not parts.path or parts.query or parts.fragment:
        raise ConfigError(f"invalid file URI {uri!r}: use file:///absolute/path (no host, query or fragment)")
    return LocalStorage(unquote(parts.path))


def local_identity(uri: str) -> str:
    """``file:///absolute/path``, without trailing '/' (a relative path is made absolute here)."""
    return Path(open_local(uri).root).as_uri()


BACKEND = Backend(("file",), open_local, "a plain path or file:///abs/path", bounded=False, identity=local_identity)
