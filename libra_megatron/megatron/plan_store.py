"""A plan store shared by the planner processes of one node (issue 25, "each pool planned once").

Every rank of a pool used to plan the same pool: P*CP-fold redundant CPU work (64-128x at the shipped layouts).
``plan_pool`` is a pure function of (pool segments, config, token layout, head layout, step-time model), so a plan
can be keyed by the content of all of them (``PlanStore.digest``), and any process that needs that key may reuse
the plan another one made: ranks of the same pool, and also ranks of other TP ranks or pipeline stages whose pool
has the same segments and nodes.

Protocol, per digest, in one directory (a per-run directory in ``/dev/shm``, shared by the ranks of a node;
``LIBRA_PLAN_SHARE_DIR`` may point it at a filesystem all nodes share, which makes it once per pool per job):

* ``<d>.claim`` is created with ``O_CREAT | O_EXCL``: exactly one process wins the claim and plans; it writes
  ``"<host> <pid>"`` into it;
* the winner publishes ``<d>.plan`` (a pickled ``PoolPlan``; written to a temporary name, then renamed, so a
  reader never sees half a file) or ``<d>.err`` (the planning error's pickled exception and traceback text);
* every other process polls for one of the two. When the claimant is on this host and its process is gone,
  or nothing appears within the timeout, the poll fails with one line naming the pool and the cause; it never
  waits forever and never falls back to a plan of its own.

Files are removed by the process that wrote them once it has published ``keep`` newer plans (two windows of
plans by default: every rank of a pool reads a plan within the window it was submitted in), and all of them at
``close``.
"""
from __future__ import annotations

import collections
import hashlib
import os
import pickle
import socket
import time
from typing import Any, Optional, Tuple

__all__ = ["PlanStore", "PlanStoreError"]


_ABSENT = object()


class PlanStoreError(RuntimeError):
    """A shared plan will never arrive (its claimant died, or it timed out)."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


class PlanStore:
    """The shared directory of one run's plans. ``spec`` (config, layouts, timing) is hashed into every digest."""

    def __init__(self, directory: str, spec: Any, keep: int = 64):
        self.directory = str(directory)
        os.makedirs(self.directory, exist_ok=True)
        self._spec_digest = hashlib.blake2b(pickle.dumps(spec, protocol=4), digest_size=16).digest()
        self._host = socket.gethostname()
        self._written: "collections.deque[str]" = collections.deque()  # digests this process published
        self._keep = max(1, int(keep))

    # ------------------------------------------------------------------ names
    def digest(self, key: str) -> str:
        """The store's name of a pool: its segment key and this store's spec, hashed."""
        return hashlib.blake2b(self._spec_digest + key.encode(), digest_size=16).hexdigest()

    def _path(self, digest: str, suffix: str) -> str:
        return os.path.join(self.directory, f"{digest}.{suffix}")

    # ------------------------------------------------------------------ claimant side
    def claim(self, digest: str) -> bool:
        """True when this process won the pool and must plan it (and then ``publish`` or ``publish_error``)."""
        try:
            fd = os.open(self._path(digest, "claim"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(f"{self._host} {os.getpid()}")
        return True

    def publish(self, digest: str, plan: Any) -> None:
        self._write(digest, "plan", plan)

    def publish_error(self, digest: str, error: BaseException, text: str) -> None:
        """``error`` must pickle (``planner_process._error_payload`` makes it so)."""
        self._write(digest, "err", (error, text))

    def _write(self, digest: str, suffix: str, obj: Any) -> None:
        final = self._path(digest, suffix)
        tmp = f"{final}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            pickle.dump(obj, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, final)
        self._written.append(digest)
        while len(self._written) > self._keep:
            self._remove(self._written.popleft())

    # ------------------------------------------------------------------ reader side
    def poll(self, digest: str) -> Optional[Tuple[bool, Any]]:
        """(True, plan) or (False, (exception, text)) once published; None while the claimant is still planning.

        Raises ``PlanStoreError`` when the claimant is a process of this host that no longer exists."""
        for suffix, ok in (("plan", True), ("err", False)):
            try:
                with open(self._path(digest, suffix), "rb") as f:
                    return ok, pickle.load(f)
            except FileNotFoundError:
                continue
        owner = self._claimant(digest)
        if owner is _ABSENT:  # its claimant removed it (``keep`` newer plans published since): see ``claimed``
            return None
        if owner is not None and owner[0] == self._host and not _pid_alive(owner[1]):
            if os.path.exists(self._path(digest, "plan")) or os.path.exists(self._path(digest, "err")):
                return self.poll(digest)  # published just before it exited
            raise PlanStoreError(f"the planner process {owner[1]} that claimed this pool exited without a plan")
        return None

    def claimed(self, digest: str) -> bool:
        """Whether a claim exists (a claimant removes its old claims; a process that still needs the plan then
        claims it again and plans it itself: the same plan, planned twice, never a wait for nothing)."""
        return self._claimant(digest) is not _ABSENT

    def _claimant(self, digest: str):
        """(host, pid) of the claim, None while it is being written, ``_ABSENT`` when there is none."""
        try:
            with open(self._path(digest, "claim")) as f:
                host, pid = f.read().split()
            return host, int(pid)
        except FileNotFoundError:
            return _ABSENT
        except ValueError:  # created, its owner not written yet
            return None

    # ------------------------------------------------------------------ cleanup
    def _remove(self, digest: str) -> None:
        for suffix in ("plan", "err", "claim"):
            try:
                os.unlink(self._path(digest, suffix))
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Remove what this process published, and the directory once it is empty."""
        while self._written:
            self._remove(self._written.popleft())
        try:
            os.rmdir(self.directory)
        except OSError:  # other processes' files remain (they remove them, and the last one the directory)
            pass
