"""Test-only: a storage that fails on purpose, for the fault campaign and the failure tests.

Never active in production: it takes effect only when the environment
variable ``SPARK_STATE_FAULT_PLAN`` names a plan file. ``open_storage`` then
wraps every storage it opens, in every process that inherits the variable (a
driver and Spark's Python workers on the same machine), as
``TimeoutStorage(FaultStorage(backend, plan), plan.timeout_seconds)``, so
the faults work with every backend. ``FaultStorage`` can also be built
directly around any storage.

A plan is JSON::

    {"timeout_seconds": 5,                       # bound on every storage call (optional)
     "counters": "/dir",                         # where processes count calls (default: <plan file>.d)
     "protect_session": 1234,                    # never kill this session (the supervisor's)
     "rules": [{"op": "create", "path": "/state/checkpoints/", "nth": 2, "fault": "truncate"}]}

A rule counts the calls of its ``op`` (``create``, ``read``, ``size``,
``exists``, ``list``, ``delete``, or ``any``) whose ``<storage uri>/<path>``
(the URI without its ``?`` parameters) matches its ``path`` regular
expression (``re.search``), over all processes
that share the plan, and acts on the ``nth`` one (1-based), once:

- ``error``: raise ``InjectedStorageError`` naming the path; nothing happens;
- ``enospc``: raise ``StorageError`` for "No space left on device"; nothing happens;
- ``stall``: sleep ``stall_seconds`` (default an hour) before the call, past
  the timeout, which then raises ``StorageTimeoutError``;
- ``truncate`` (``create`` only): publish the first half of the data at the
  path, then raise ``InjectedStorageError``, as a store without atomic
  creates would after a failed upload: a truncated file at a commit path;
- ``kill`` (after the call succeeded): SIGKILL every process of the caller's
  session, so a driver started in a session of its own dies with its JVM
  and workers the instant a file (a blob, a checkpoint record) was written.

Fired rules are recorded as ``fired-<rule index>`` files in the counters
directory (their content: the process id, the operation and the path).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from spark_state.errors import ConfigError, StorageError
from spark_state.storage.base import ForwardingStorage, Storage

FAULT_PLAN_ENV = "SPARK_STATE_FAULT_PLAN"
"""Test-only: the path of a fault plan; unset in production."""
OPS = ("create", "read", "size", "exists", "list", "delete")
FAULTS = ("error", "enospc", "stall", "truncate", "kill")


class InjectedStorageError(StorageError):
    """A storage call failed because a fault plan said so (tests only)."""


@dataclass(frozen=True)
class FaultRule:
    """Act on the ``nth`` call of ``op`` whose ``<uri>/<path>`` matches ``path``; see the module docstring."""

    op: str
    path: str
    nth: int
    fault: str
    stall_seconds: float = 3600.0

    def __post_init__(self) -> None:
        if self.op not in OPS + ("any",):
            raise ConfigError(f"fault rule op {self.op!r} is not one of {OPS + ('any',)}")
        if self.fault not in FAULTS:
            raise ConfigError(f"fault {self.fault!r} is not one of {FAULTS}")
        if self.fault == "truncate" and self.op != "create":
            raise ConfigError("a truncate fault needs op 'create'")
        if not isinstance(self.nth, int) or self.nth < 1:
            raise ConfigError(f"fault rule nth must be an int >= 1, got {self.nth!r}")
        re.compile(self.path)

    def matches(self, op: str, where: str) -> bool:
        return (self.op == "any" or self.op == op) and re.search(self.path, where) is not None


@dataclass(frozen=True)
class FaultPlan:
    """Rules, the call timeout and the shared counters directory of one plan file."""

    rules: tuple[FaultRule, ...]
    counters: str
    timeout_seconds: float | None = None
    protect_session: int | None = None

    @classmethod
    def load(cls, path: str) -> FaultPlan:
        try:
            body = json.loads(Path(path).read_text())
            rules = tuple(FaultRule(**rule) for rule in body.get("rules", ()))
        except (OSError, ValueError, TypeError) as exc:
            raise ConfigError(f"fault plan {path} ({FAULT_PLAN_ENV}) is not readable: {exc}") from exc
        counters = body.get("counters") or f"{path}.d"
        os.makedirs(counters, exist_ok=True)
        return cls(rules, counters, body.get("timeout_seconds"), body.get("protect_session"))

    def fired(self) -> list[dict]:
        """What every fired rule recorded, by rule index."""
        result = []
        for name in sorted(os.listdir(self.counters)):
            if name.startswith("fired-"):
                result.append(json.loads(Path(self.counters, name).read_text()))
        return result

    def _count(self, index: int) -> int:
        """Add one to rule ``index``'s shared counter; return the new value."""
        fd = os.open(os.path.join(self.counters, f"count-{index}"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            raw = os.read(fd, 32)
            count = int(raw) + 1 if raw.strip() else 1
            os.lseek(fd, 0, os.SEEK_SET)
            os.ftruncate(fd, 0)
            os.write(fd, str(count).encode())
            return count
        finally:
            os.close(fd)

    def due(self, op: str, where: str) -> FaultRule | None:
        """The rule that fires on this call, if any (counting the call for every matching rule)."""
        chosen = None
        for index, rule in enumerate(self.rules):
            if rule.matches(op, where) and self._count(index) == rule.nth and chosen is None:
                record = {
                    "rule": index,
                    "fault": rule.fault,
                    "op": op,
                    "path": where,
                    "pid": os.getpid(),
                    "at": time.time(),
                }
                Path(self.counters, f"fired-{index}").write_text(json.dumps(record))
                chosen = rule
        return chosen


def kill_session(session: int | None = None, *, protect: int | None = None) -> None:
    """SIGSTOP, then SIGKILL, every process of ``session`` (default: this process's, this one last; Linux only).

    A driver started as a session leader has its JVM, Spark's Python daemon
    (which moves to a process group of its own) and its workers in its session.
    """
    own = session is None
    session = os.getsid(0) if session is None else session  # ``own``: this process's
    if session == protect or session <= 1 or (not own and session == os.getsid(0)):
        raise ConfigError(f"refusing to kill session {session}: it is protected")
    me = os.getpid()
    members = [pid for pid in session_members(session) if pid != me]
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for pid in members:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    if own:
        os.kill(me, signal.SIGKILL)


def session_members(session: int) -> list[int]:
    """The ids of the running processes of ``session``."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == session:
            members.append(int(entry))
    return members


class FaultStorage(ForwardingStorage):
    """Forwards to ``inner`` and acts on ``plan``'s rules; see the module docstring."""

    transparent = True

    def __init__(self, inner: Storage, plan: FaultPlan):
        super().__init__(inner)
        self.plan = plan

    def __repr__(self) -> str:
        return f"FaultStorage({self.inner!r})"

    def __eq__(self, other: object) -> bool:
        from spark_state.storage.timeouts import unwrapped

        return unwrapped(other) == unwrapped(self)

    def __hash__(self) -> int:
        return hash(self.inner)

    def __getattr__(self, name: str):
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _before(self, op: str, path: str) -> FaultRule | None:
        where = f"{self.uri.split('?', 1)[0]}/{path}"  # an s3:// store's parameters (endpoint...) are not matched
        rule = self.plan.due(op, where)
        if rule is None:
            return None
        if rule.fault == "error":
            raise InjectedStorageError(f"{op} of {path!r} in {self.uri} failed: injected fault")
        if rule.fault == "enospc":
            raise StorageError(
                f"{op} of {path!r} in {self.uri} failed: [Errno {errno.ENOSPC}] No space left on device "
                "(injected fault)"
            )
        if rule.fault == "stall":
            time.sleep(rule.stall_seconds)
        return rule

    def _after(self, rule: FaultRule | None) -> None:
        if rule is not None and rule.fault == "kill":
            kill_session(protect=self.plan.protect_session)

    def create(self, path: str, data: bytes, *, overwrite: bool = False) -> None:
        rule = self._before("create", path)
        if rule is not None and rule.fault == "truncate":
            self.inner.create(path, bytes(data)[: len(data) // 2], overwrite=overwrite)
            raise InjectedStorageError(
                f"create of {path!r} in {self.uri} failed after writing {len(data) // 2} of {len(data)} bytes: "
                "injected fault (a truncated file is left at the path)"
            )
        self.inner.create(path, data, overwrite=overwrite)
        self._after(rule)

    def read(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        rule = self._before("read", path)
        data = self.inner.read(path, offset, length)
        self._after(rule)
        return data

    def size(self, path: str) -> int:
        rule = self._before("size", path)
        result = self.inner.size(path)
        self._after(rule)
        return result

    def exists(self, path: str) -> bool:
        rule = self._before("exists", path)
        result = self.inner.exists(path)
        self._after(rule)
        return result

    def list(self, path: str = "") -> list[str]:
        rule = self._before("list", path)
        result = self.inner.list(path)
        self._after(rule)
        return result

    def delete(self, path: str) -> None:
        rule = self._before("delete", path)
        self.inner.delete(path)
        self._after(rule)


_PLANS: dict[str, FaultPlan] = {}


def plan_from_environment() -> FaultPlan | None:
    """The plan ``SPARK_STATE_FAULT_PLAN`` names (loaded once per process), or None when it is unset."""
    path = os.environ.get(FAULT_PLAN_ENV)
    if not path:
        return None
    if path not in _PLANS:
        _PLANS[path] = FaultPlan.load(path)
    return _PLANS[path]
