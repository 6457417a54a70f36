"""The worker's codec process: saving off the forward path, and a second pair of hands for restores.

Saving: in ``wait_for_save`` the worker copies each completed chunk's blocks, every layer, into a shared-memory
file (whole blocks: plain memory copies, milliseconds) and hands the file to this process; vLLM goes on with the
next step while the process reads the blocks (:meth:`PagedLayout.gather`), undoes RoPE, encodes and puts the blob
in the store. Because the chunk is copied before ``wait_for_save`` returns, vLLM may free or reuse its blocks at
once: no block is held for a save (a sliding-window group frees blocks while its request still runs, so holding
the request's blocks would not protect them anyway). Copies waiting here are bounded (``max_bytes``): a chunk
that would exceed the bound is dropped, which is only a future cache miss, and reported. On shutdown the queue is
drained before the process exits, the saving thread then at normal priority (the shutdown waits for it, and vLLM
gives a worker only a few seconds: on CPUs kept busy, an idle-priority drain would store nothing in that time).

Faults never reach the engine: a codec process that fails to start, exits or is killed is started again on the next
save or restore, after a pause that doubles from :data:`RESTART_BACKOFF_S` to :data:`RESTART_BACKOFF_MAX_S` (what it had
queued is lost and counted); a message it can no longer receive is a dropped save or a restore the worker does
itself. While the store refuses saves (read-only, full, unreachable) a circuit breaker stops copying and encoding
chunks for :data:`BREAKER_S` seconds, doubling to :data:`BREAKER_MAX_S` while the refusals go on; a chunk already
stored, or refused within that time, is not copied or encoded again (docs/VLLM.md, "Faults").

Restoring: a restore of several chunks is split; the process decodes the second half (reading the entries from
the store itself) into a shared-memory file while the worker decodes the first half.

A process rather than a thread: encoding in a thread of the worker slowed the decode steps running beside it by
about a fifth on a 2-CPU machine (``benchmarks/vllm_ttft.py``), as the two threads handed Python's interpreter lock
back and forth around every small tensor operation of the forward pass. The process runs on the CPUs vLLM did not
bind the model's OpenMP threads to (see ``VLLM_CPU_NUM_OF_RESERVED_CPU`` in docs/VLLM.md); its saving thread runs
only when those CPUs have nothing else to do (Linux ``SCHED_IDLE``; elsewhere nice 19), so vLLM's own scheduler
and front end, which pace every step, go first, while restores (someone waits for them) run at normal priority.
(Measured on 2 CPUs: a matrix-multiplying process beside the engine slowed its decode steps by 19% at nice 19 and
by 7% under ``SCHED_IDLE``.) The two processes talk in JSON lines (the process's
stdin and a pipe of its own); tensors cross only as raw bytes in the shared-memory files.

    python -m kvtc.integrations.vllm.helper   # started by the worker, never by hand
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...progress import StageTimer
from ...textsafe import message
from .chunks import ChunkCodec, cpu_list, spare_cpus
from .paged import PagedLayout

logger = logging.getLogger("kvtc.vllm")

#: Bytes of copied chunks that may wait for the codec process (more are dropped: a future cache miss).
DEFAULT_MAX_PENDING_BYTES = 1 << 30
#: Scheduling niceness of the saving thread where SCHED_IDLE is not available.
NICE = 19
#: Seconds a restore waits for the process's half before the worker gives up on it (the request is recomputed).
RESTORE_TIMEOUT_S = 120.0
#: Seconds before a codec process that exited is started again; doubled after each start that fails, up to the max.
RESTART_BACKOFF_S = 1.0
RESTART_BACKOFF_MAX_S = 60.0
#: Seconds no chunk is copied or encoded after the store refused a save; doubled while refusals go on, up to the max.
BREAKER_S = 5.0
BREAKER_MAX_S = 60.0
#: Keys remembered as stored or refused (the oldest are forgotten first).
REMEMBERED_KEYS = 65536
#: Variables that bind OpenMP threads to CPUs: the process drops vLLM's (it picks its own CPUs).
_OMP_BINDING = ("OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")
_ALIGN = 64

SaveResult = Callable[[str, "int | None", dict, "str | None"], None]


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dt


def _views(buf: torch.Tensor, parts: Sequence[Sequence[Any]]) -> list[torch.Tensor]:
    """Tensors ``[offset, shape, dtype name]`` of a shared-memory byte buffer."""
    out = []
    for off, shape, name in parts:
        dt = _dtype(name)
        n = torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
        out.append(buf[off : off + n].view(dt).view(shape))
    return out


def _layout_of(tensors: Sequence[tuple[Sequence[int], torch.dtype]]) -> tuple[list[list[Any]], int]:
    """Aligned offsets of tensors ``(shape, dtype)`` packed in one buffer, and its size."""
    parts, off = [], 0
    for shape, dt in tensors:
        parts.append([off, list(shape), str(dt).removeprefix("torch.")])
        off += -(-torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size() // _ALIGN) * _ALIGN
    return parts, off


def _shared_file(path: str, size: int) -> torch.Tensor:
    """A new shared-memory file of ``size`` bytes, mapped (space is reserved now: no fault while writing)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, max(size, 1))
    finally:
        os.close(fd)
    return torch.from_file(path, shared=True, size=max(size, 1), dtype=torch.uint8)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class CodecProcess:
    """The worker's handle on its codec process.

    ``setup``: what the process encodes and decodes with (:meth:`ChunkCodec.setup`), sent at once so that the
    process loads the calibration and opens the store while the engine starts. ``on_saved(key, stored bytes or
    None, seconds, error)`` runs on a reader thread for every submitted chunk, once it is stored, refused or lost.
    """

    def __init__(self, setup: dict[str, Any], on_saved: SaveResult, max_bytes: int = DEFAULT_MAX_PENDING_BYTES):
        self.on_saved = on_saved
        self.max_bytes = max_bytes
        self.setup = setup
        self.dir = tempfile.mkdtemp(prefix="kvtc-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        self._lock = threading.Condition()
        self._send_lock = threading.Lock()
        self._pending: dict[str, tuple[int, str]] = {}  # save key -> (bytes, file)
        self._restores: dict[int, dict[str, Any]] = {}  # restore id -> reply
        self._count = 0
        self.dropped = 0
        #: saves not copied because the breaker was open or the key was already stored or refused
        self.skipped = 0
        #: times the process was started again after it exited
        self.restarts = 0
        self.alive = False
        self.has_layers = False
        self._layers: dict[str, Any] | None = None
        self._backoff = RESTART_BACKOFF_S
        self._next_start = 0.0
        self._breaker = BREAKER_S
        self._open_until = 0.0  # no chunk is copied before then (the store refused one)
        self._known: OrderedDict[str, float] = OrderedDict()  # key -> until when it is not saved again
        self._closing = False
        self.proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None
        self._start()

    def _start(self) -> None:
        """Start the process and send it the setup (and the layers, once known); a failure to start is logged and
        retried later (:meth:`revive`)."""
        env = {k: v for k, v in os.environ.items() if k not in _OMP_BINDING}
        env["OMP_NUM_THREADS"] = "1"
        read_fd, write_fd = os.pipe()
        cpus = ",".join(str(c) for c in sorted(spare_cpus())) or "-"
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvtc.integrations.vllm.helper", str(write_fd), cpus, str(NICE)],
                stdin=subprocess.PIPE,
                env=env,
                pass_fds=(write_fd,),
                text=True,
            )
        except OSError as e:
            os.close(read_fd)
            os.close(write_fd)
            self._failed_start(f"cannot start the codec process ({message(e)})")
            return
        os.close(write_fd)
        self.replies = os.fdopen(read_fd, "r")
        with self._lock:
            self.alive = True
        self._reader = threading.Thread(target=self._read_replies, name="kvtc-codec-replies", daemon=True)
        self._reader.start()
        if not self._send({"setup": self.setup}) or (self._layers is not None and not self._send(self._layers)):
            self._failed_start("the codec process exited as it started")

    def _failed_start(self, why: str) -> None:
        with self._lock:
            self.alive = False
            self._next_start = time.monotonic() + self._backoff
            wait, self._backoff = self._backoff, min(self._backoff * 2, RESTART_BACKOFF_MAX_S)
        logger.warning("KVTCConnector: %s; saves are dropped and loads recomputed, trying again in %.0f s", why, wait)

    def revive(self) -> bool:
        """Whether the process is running: a process that exited is started again once its pause is over."""
        with self._lock:
            if self.alive or self._closing or time.monotonic() < self._next_start:
                return self.alive
            self.restarts += 1
        if self._reader is not None:
            self._reader.join(timeout=5)  # the old process's replies are all read
        for pipe in (getattr(self.proc, "stdin", None), getattr(self, "replies", None)):
            try:  # the old process's pipes: closed, so that restarts leak no descriptors
                if pipe is not None:
                    pipe.close()
            except OSError:
                pass
        self._start()
        return self.alive

    def _send(self, msg: dict[str, Any]) -> bool:
        """Write one message to the process; False (nothing raised) when it is gone."""
        if self.proc is None or self.proc.stdin is None:
            return False
        try:
            with self._send_lock:
                self.proc.stdin.write(json.dumps(msg) + "\n")
                self.proc.stdin.flush()
            return True
        except (OSError, ValueError):  # a broken pipe, or its stdin already closed
            return False

    def _path(self) -> str:
        with self._lock:
            self._count += 1
            return os.path.join(self.dir, f"{self._count}.kv")

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def send_layers(self, pageds: list[PagedLayout], scales: list[tuple[float, float]]) -> None:
        """Each layer's paged layout (as probed) and scales, needed to read copied blocks; once (sent again to a
        process started again)."""
        self._layers = {"layers": ChunkCodec.layers_setup(pageds, scales)}
        self._send(self._layers)  # a process that is gone gets them when it is started again
        self.has_layers = True

    def _known_until(self, key: str) -> float | None:
        with self._lock:
            until = self._known.get(key)
            if until is not None and until <= time.monotonic():
                del self._known[key]
                return None
            return until

    def _remember(self, key: str, until: float) -> None:
        with self._lock:
            self._known[key] = until
            self._known.move_to_end(key)
            while len(self._known) > REMEMBERED_KEYS:
                self._known.popitem(last=False)

    # -- saving --------------------------------------------------------------------------------
    def submit(
        self,
        key: str,
        chunk: int,
        sources: list[tuple[PagedLayout, torch.Tensor, Sequence[int]]],
        token_ids: Sequence[int] = (),
    ) -> bool:
        """Copy the chunk's blocks (``(paged layout, layer cache, block ids)`` per layer) into a shared-memory file
        and queue it with its ``token_ids``; True without copying for a chunk already stored; False (dropped, nothing
        copied) when the store refused a save a moment ago (the breaker is open, or this chunk was refused), the queue
        is full or the process is gone."""
        known = self._known_until(key)
        if known is not None or time.monotonic() < self._open_until:
            with self._lock:
                self.skipped += 1
            return known == float("inf")
        if not self.revive():
            with self._lock:
                self.dropped += 1
            return False
        shapes = []
        for paged, cache, ids in sources:
            shape = list(cache.shape)
            shape[paged.block_axis()] = len(ids)
            shapes.append((shape, cache.dtype))
        parts, total = _layout_of(shapes)
        path = self._path()
        with self._lock:
            if not self.alive or (self._pending and sum(p[0] for p in self._pending.values()) + total > self.max_bytes):
                self.dropped += 1
                return False
            self._pending[key] = (total, path)
        try:
            buf = _shared_file(path, total)
            for (paged, cache, ids), out in zip(sources, _views(buf, parts)):
                paged.copy_blocks(cache, ids, out=out)
            del buf
            if not self._send({"save": key, "chunk": chunk, "file": path, "parts": parts, "tokens": list(token_ids)}):
                raise BrokenPipeError("the codec process is gone")
        except OSError as e:
            with self._lock:
                self._pending.pop(key, None)
                self.dropped += 1
            _unlink(path)
            logger.warning(
                "KVTCConnector: cannot hand chunk %d to the codec process (%s); it is not stored", chunk, message(e)
            )
            return False
        return True

    # -- restoring -----------------------------------------------------------------------------
    def request_restore(self, chunks: list[tuple[str, int]]) -> int | None:
        """Ask the process to decode ``(key, chunk)`` entries; a ticket for :meth:`restored` (None: it is gone)."""
        if not self.revive():
            return None
        with self._lock:
            self._count += 1
            ticket = self._count
        if not self._send({"restore": ticket, "chunks": [list(c) for c in chunks], "file": self._path()}):
            return None
        return ticket

    def restored(self, ticket: int, timeout: float = RESTORE_TIMEOUT_S) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoded ``(keys float32, values)`` ``[tokens, layers, heads, head_dim]`` of a restore request, or a
        :class:`RestoreError` naming the entry that could not be decoded."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while ticket not in self._restores:
                left = deadline - time.monotonic()
                if left <= 0 or not self.alive:
                    raise RestoreError(None, "the codec process did not answer")
                self._lock.wait(left)
            reply = self._restores.pop(ticket)
        if reply.get("error"):
            raise RestoreError(reply.get("bad"), reply["error"])
        path = reply["file"]
        try:
            buf = torch.from_file(path, shared=False, size=os.path.getsize(path), dtype=torch.uint8)
            keys, values = _views(buf, reply["parts"])
        finally:
            _unlink(path)
        return keys, values

    # -- replies -------------------------------------------------------------------------------
    def _read_replies(self) -> None:
        for line in self.replies:
            try:
                reply = json.loads(line)
            except ValueError:
                continue
            if "restore" in reply:
                with self._lock:
                    self._restores[int(reply["restore"])] = reply
                    self._lock.notify_all()
                continue
            key = reply.get("save")
            with self._lock:  # (re-entrant)
                entry = self._pending.get(key)
                if entry is not None:
                    self._settle(key, reply)
            if entry is not None:
                _unlink(entry[1])
                self.on_saved(key, reply.get("bytes"), reply.get("seconds", {}), reply.get("error"))
                self._settled([key])  # after its callback: a flush that returns has seen the chunk's word
        with self._lock:  # the process is gone: what it had not stored is lost
            self.alive = False
            lost = list(self._pending.items())
            if not self._closing:
                self._next_start = time.monotonic() + self._backoff
                self._backoff = min(self._backoff * 2, RESTART_BACKOFF_MAX_S)
            self._lock.notify_all()
        code = None
        if self.proc is not None:
            try:
                code = self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if lost or not self._closing:
            logger.warning(
                "KVTCConnector: the codec process exited (code %s); %d chunks it held are not stored; it is started "
                "again on the next save or load",
                code,
                len(lost),
            )
        for key, (_, path) in lost:
            _unlink(path)
            self.on_saved(key, None, {}, "the codec process exited")
        self._settled([key for key, _ in lost])

    def _settled(self, keys: list[str]) -> None:
        """Chunks whose word the caller has had (``on_saved``): no longer pending; a flush waiting on them returns."""
        with self._lock:
            for key in keys:
                self._pending.pop(key, None)
            self._lock.notify_all()

    def _settle(self, key: str, reply: dict[str, Any]) -> None:
        """Remember a stored chunk (not saved again) and one the store did not take (not before the breaker closes);
        open the breaker when the store takes nothing, reset it on a success."""
        now = time.monotonic()
        if reply.get("bytes") is not None:
            self._remember(key, float("inf"))
            with self._lock:
                self._breaker = BREAKER_S
                self._backoff = RESTART_BACKOFF_S  # the process works: a later exit starts the pauses over
        else:  # refused (read-only, full, unreachable, an entry over its size limit) or failed: the same next time
            with self._lock:
                self._open_until = now + self._breaker
                until, self._breaker = self._open_until, min(self._breaker * 2, BREAKER_MAX_S)
            self._remember(key, until)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted chunk is stored, refused or lost; False if ``timeout`` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._lock.wait(left)
        return True

    def hurry(self) -> None:
        """Raise the process's saving thread to normal priority for good: someone now waits for the queue."""
        self._send({"hurry": True})  # a process that is gone has nothing to hurry

    def close(self, timeout: float | None = None) -> bool:
        """Store what is queued (up to ``timeout`` seconds, at normal priority), then stop the process."""
        with self._lock:
            self._closing = True
        self.hurry()
        done = self.flush(timeout)
        if self.proc is not None:
            try:
                if self.proc.stdin is not None:
                    self.proc.stdin.close()
                self.proc.wait(timeout=10 if done else 1)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        if self._reader is not None:
            self._reader.join(timeout=5)
        shutil.rmtree(self.dir, ignore_errors=True)
        return done


class RestoreError(Exception):
    """The codec process could not decode an entry (``key``: the entry at fault, if one is)."""

    def __init__(self, key: str | None, message: str) -> None:
        super().__init__(message)
        self.key = key


# -- the process ---------------------------------------------------------------------------------------------
def _serve(reply_fd: int, cpus: str, nice: int) -> None:
    replies = os.fdopen(reply_fd, "w")
    os.dup2(2, 1)  # anything printed goes to stderr, never into the replies
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    try:
        if cpus != "-":
            os.sched_setaffinity(0, cpu_list(cpus))
    except (AttributeError, OSError, ValueError):
        pass
    torch.set_num_threads(1)
    write_lock = threading.Lock()

    def reply(msg: dict[str, Any]) -> None:
        with write_lock:
            replies.write(json.dumps(msg) + "\n")
            replies.flush()

    line = sys.stdin.readline()
    if not line:
        return
    codec = ChunkCodec.from_setup(json.loads(line)["setup"])
    codec.warm()  # while the engine starts: the first save or restore then costs what later ones do
    saves: queue.Queue[dict[str, Any] | None] = queue.Queue()

    def save_loop() -> None:
        try:  # this thread only: it runs when the CPU has nothing else to do (Linux SCHED_IDLE), else at nice 19
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (AttributeError, OSError):
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
            except (AttributeError, OSError):
                pass
        while (job := saves.get()) is not None:
            clock = StageTimer()
            out: dict[str, Any] = {"save": job["save"]}
            try:
                size = os.path.getsize(job["file"])
                buf = torch.from_file(job["file"], shared=False, size=size, dtype=torch.uint8)
                _unlink(job["file"])
                views = _views(buf, job["parts"])
                out["bytes"] = codec.save(job["save"], job["chunk"], views, clock, job.get("tokens"))
            except Exception as e:  # noqa: BLE001 - reported to the worker: a failed save is a future cache miss
                out["error"] = f"{type(e).__name__}: {e}"
            out["seconds"] = clock.seconds
            reply(out)

    saver = threading.Thread(target=save_loop, name="kvtc-save")
    saver.start()
    for line in sys.stdin:
        msg = json.loads(line)
        if "layers" in msg:
            codec.set_layers(msg["layers"])
        elif "save" in msg:
            saves.put(msg)
        elif "restore" in msg:
            reply(_restore(codec, msg))
        elif "hurry" in msg:
            _normal_priority(saver.native_id)
    saves.put(None)
    saver.join()
    codec.store.close()


def _normal_priority(tid: int | None) -> None:
    """Put thread ``tid`` of this process back to the normal policy (from ``SCHED_IDLE``; allowed without
    privileges) or, where it was niced instead, as close to nice 0 as this process may go."""
    if tid is None:
        return
    try:
        os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, tid, 0)
    except (AttributeError, OSError):  # lowering a nice value may need privileges: keep the one it has
        pass


def _restore(codec: ChunkCodec, msg: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"restore": msg["restore"], "file": msg["file"]}
    ks, vs = [], []
    for key, chunk in msg["chunks"]:
        try:
            blob = codec.store.get(key)
            if blob is None:
                raise LookupError("entry missing or corrupt in the store")
            k, v = codec.restore(blob, chunk)
        except Exception as e:  # noqa: BLE001 - reported to the worker: the request is recomputed
            out.update(error=f"{type(e).__name__}: {e}", bad=key)
            return out
        ks.append(k)
        vs.append(v)
    keys, values = torch.cat(ks), torch.cat(vs)
    parts, total = _layout_of([(keys.shape, keys.dtype), (values.shape, values.dtype)])
    buf = _shared_file(msg["file"], total)
    for src, dst in zip((keys, values), _views(buf, parts)):
        dst.copy_(src)
    out["parts"] = parts
    return out


if __name__ == "__main__":
    _serve(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))

__all__ = ["DEFAULT_MAX_PENDING_BYTES", "CodecProcess", "RestoreError"]
