"""One model over several processes (docs/architecture.md, "Several processes").

`--coordinator-address HOST:PORT --num-processes P --process-id I` (jax.distributed's names)
join P processes into one JAX runtime whose devices form the tensor-parallel mesh. Process 0
(the leader) runs the scheduler and the HTTP server; before each step it sends the step's
host arrays (StepArrays, pickled) to every follower over a TCP connection of its own, at
HOST:PORT+1, and each follower runs the same compiled program on them: the programs'
collectives then meet across processes (gloo on CPUs, NCCL on GPUs).

The connection is also how each side notices the other is gone, within a second, even while
its own device is stuck in a collective with the dead process: a leader that loses a
follower fails every request in flight and exits 1; a follower that loses its leader exits 1.
"""
from __future__ import annotations

import logging
import os
import pickle
import queue
import socket
import struct
import sys
import threading
import time

log = logging.getLogger("xlaserve")
HEADER = struct.Struct("!Q")
CONNECT_TIMEOUT_S = 300.0  # followers may start long before (or after) the leader
EXIT_GRACE_S = 2.0  # for the failed requests' answers to leave before the leader exits


class DistributedConfigError(ValueError):
    pass


def check(coordinator_address, num_processes, process_id) -> tuple[str, int] | None:
    """-> (host, port) of the coordinator, or None for one process; a bad combination is an
    error saying what is missing."""
    if not (isinstance(num_processes, int) and num_processes >= 1):
        raise DistributedConfigError(f"num_processes must be a positive integer, got "
                                     f"{num_processes!r}")
    if num_processes == 1:
        if coordinator_address or process_id:
            raise DistributedConfigError("--coordinator-address and --process-id need "
                                         "--num-processes of 2 or more")
        return None
    if not coordinator_address:
        raise DistributedConfigError(f"--num-processes {num_processes} needs "
                                     "--coordinator-address HOST:PORT (process 0's)")
    if not (isinstance(process_id, int) and 0 <= process_id < num_processes):
        raise DistributedConfigError(f"process_id must be in 0..{num_processes - 1}, got "
                                     f"{process_id!r}")
    host, _, port = str(coordinator_address).rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65535:
        raise DistributedConfigError(f"coordinator_address must be HOST:PORT, got "
                                     f"{coordinator_address!r}")
    return host, int(port)


def initialize(coordinator_address, num_processes: int, process_id: int):
    """Joins the JAX runtime of all processes (before anything starts JAX's backends) and
    connects the step channel. -> None (one process), a Leader or a Follower."""
    where = check(coordinator_address, num_processes, process_id)
    if where is None:
        return None
    import jax
    from jax._src import xla_bridge
    if xla_bridge.backends_are_initialized():
        raise DistributedConfigError("JAX's backends started before jax.distributed could "
                                     "be initialized; start the engine first")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address, num_processes, process_id)
    host, port = where
    if process_id == 0:
        return Leader(port + 1, num_processes - 1)
    return Follower(host, port + 1, process_id)


def agree(*sizes: int) -> tuple[int, ...]:
    """Each size's smallest value over the processes: every process must build the same
    programs over the same cache, whatever memory each found for itself."""
    import numpy as np
    from jax.experimental import multihost_utils
    every = multihost_utils.process_allgather(np.asarray(sizes, np.int64))
    return tuple(int(v) for v in np.asarray(every).reshape(-1, len(sizes)).min(axis=0))


def _send(conn: socket.socket, message) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    conn.sendall(HEADER.pack(len(data)) + data)


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    chunks = []
    while n:
        chunk = conn.recv(min(n, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _recv(conn: socket.socket):
    """-> the next message, or None when the other side is gone."""
    header = _recv_exact(conn, HEADER.size)
    if header is None:
        return None
    data = _recv_exact(conn, HEADER.unpack(header)[0])
    return None if data is None else pickle.loads(data)


def exit_now(code: int, message: str) -> None:
    """Leaves at once: a thread may be inside a collective that will never finish."""
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)


class Leader:
    """Process 0's side: one connection per follower, accepted at start-up."""
    is_leader = True

    def __init__(self, port: int, num_followers: int):
        self.on_lost: list = []  # callables(reason), on a watcher thread
        self._lost = threading.Event()
        self._lock = threading.Lock()
        server = socket.create_server(("", port), reuse_port=False)
        server.settimeout(CONNECT_TIMEOUT_S)
        self._conns: dict[int, socket.socket] = {}
        try:
            while len(self._conns) < num_followers:
                conn, _ = server.accept()
                conn.settimeout(None)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._conns[_recv(conn)] = conn  # a follower says its process id first
        except socket.timeout:
            raise DistributedConfigError(f"{len(self._conns)} of {num_followers} followers "
                                         f"connected to port {port} in "
                                         f"{CONNECT_TIMEOUT_S:.0f} s") from None
        finally:
            server.close()
        for pid, conn in self._conns.items():
            threading.Thread(target=self._watch, args=(pid, conn), daemon=True,
                             name=f"xlaserve-follower-{pid}").start()
        log.info("leader: %d followers connected (processes %s)", num_followers,
                 ", ".join(map(str, sorted(self._conns))))

    def _watch(self, pid: int, conn: socket.socket) -> None:
        try:
            gone = conn.recv(1) == b""
        except OSError:
            gone = True
        if gone:
            self._follower_lost(f"process {pid} (a follower) is gone")

    def _follower_lost(self, reason: str) -> None:
        if self._lost.is_set():
            return
        self._lost.set()
        log.error("%s: every request in flight fails and this process exits", reason)
        for callback in self.on_lost:
            try:
                callback(reason)
            except Exception:  # noqa: BLE001 - the exit below still happens
                log.exception("failing the requests in flight failed")
        time.sleep(EXIT_GRACE_S)
        exit_now(1, f"error: {reason}; exiting")

    def send_step(self, arrays) -> None:
        """Before the leader dispatches a step: every follower gets its host arrays."""
        if self._lost.is_set():
            raise RuntimeError("a follower process is gone")
        with self._lock:
            for pid, conn in self._conns.items():
                try:
                    _send(conn, ("step", arrays))
                except OSError as e:
                    threading.Thread(target=self._follower_lost, daemon=True,
                                     args=(f"process {pid} (a follower) is gone: {e}",)).start()
                    raise RuntimeError(f"process {pid} (a follower) is gone: {e}") from e

    def stop(self) -> None:
        """An orderly end: followers leave their loop and exit 0."""
        with self._lock:
            for conn in self._conns.values():
                try:
                    _send(conn, ("stop", None))
                except OSError:
                    pass


class Follower:
    """A follower's side: runs each step the leader sends until it says stop."""
    is_leader = False

    def __init__(self, host: str, port: int, process_id: int):
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while True:
            try:
                self._conn = socket.create_connection((host, port), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise DistributedConfigError(f"process 0 did not answer at {host}:{port} "
                                                 f"in {CONNECT_TIMEOUT_S:.0f} s") from None
                time.sleep(0.2)
        self._conn.settimeout(None)
        self._conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _send(self._conn, process_id)
        self.process_id = process_id
        self._steps: queue.Queue = queue.Queue()

    def _read(self) -> None:
        """Reader thread: steps into the queue; the leader gone without a stop -> exit 1."""
        while True:
            try:
                message = _recv(self._conn)
            except OSError:
                message = None
            if message is None:
                exit_now(1, f"error: process 0 (the leader) is gone; process "
                            f"{self.process_id} exits")
            self._steps.put(message)
            if message[0] == "stop":
                return

    def serve(self, runner) -> int:
        """Runs every step the leader sends on `runner` (the same compiled programs, so the
        collectives meet); -> 0 once the leader stops."""
        threading.Thread(target=self._read, daemon=True, name="xlaserve-steps").start()
        log.info("follower %d: running the leader's steps", self.process_id)
        while True:
            kind, arrays = self._steps.get()
            if kind == "stop":
                log.info("follower %d: the leader stopped", self.process_id)
                return 0
            runner.fetch(runner.dispatch(arrays))
