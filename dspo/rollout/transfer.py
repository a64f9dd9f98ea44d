"""How the policy's weights reach the engine process (`rollout.weight_transfer`; issue 28, point 3).

Two transports, one protocol (`WeightTransport`). After every round the trainer calls `send(weights or None,
completed_rounds, version, n)` for its n-th push (None: unchanged weights, a skipped step; the round count, which moves
the staleness bound, still travels) and then puts a `LoadWeights(n, progress)` command on the engine process's queue;
between two rounds the engine process calls `receive(sequence number, load, loaded_version)`, which loads the newest
weights into its engine if their version differs from what it holds, and returns their completed-round count. Neither
side waits for the other's round:

- `shared_memory` (default): `share_memory_()` host tensors allocated at the first push and written under a lock with
  a header [completed rounds, optimizer steps]. On a GPU box this is a device-to-host copy per push.
- `gloo` / `nccl`: a two-member process group (the trainer rank and its own engine process, rank 0 and 1) made
  directly over a TCPStore on 127.0.0.1, beside any training process group. The trainer announces each push on the
  store (its header), then broadcasts the tensors in name order, cast to the engine's dtype (`rollout.engine.dtype`);
  a receiver thread in the engine process takes them into staging buffers (allocated at the first push, after the
  engine: one copy of the policy in the engine's dtype, e.g. 15 GB for 7B in bf16, on the engine's GPU with `nccl`)
  while the engine generates, and the engine loads them between rounds. With `nccl` the tensors go GPU to GPU (the
  trainer's GPU to the engine's own, `rollout.engine_devices`): NCCL cannot join two processes on one GPU, so a
  colocated engine keeps `shared_memory` (CUDA IPC, the zero-copy path for that layout, is not written). Under FSDP
  the gathered tensors are on the host (`policy_weights` offloads each one as it is gathered), so `nccl` copies them
  back to the trainer's GPU first. `gloo` runs the same code on CPU, which is how it is tested here; `nccl` has not
  run (no GPU).

Faults (issue 38): every wait on the other side is bounded by its liveness. The shared-memory lock is taken in
`_POLL_S` slices, checking between them that the peer lives, so an engine process killed while it held the lock (an
out-of-memory kill during a reload) ends the trainer's `send` with an error instead of a hang, and an engine process
whose trainer was killed mid-send exits. Security (issue 39): the collective transports' TCPStore listens on a socket
dspo binds to 127.0.0.1 itself (torch's own would listen on every interface), its key names are HMACs of a per-run
secret (issue 53: any local process can list them), and each push header carries an HMAC of that secret, which the
engine process checks: a process on the same host cannot sign a push or predict the next one's key
(`dspo.rollout.store`). A trainer's broadcast waits in slices while its engine process lives, and a receiver thread
that fails ends the engine process at once (`on_failure`), so neither side waits out the group's 24 h timeout.

Departure from verl / TRL / prime-rl: they use vLLM's own NCCL communicator inside vLLM's workers; dspo's engine
process owns its engine in-process, so a torch process group between the two processes is enough and one code path
serves CPU (gloo) and GPU (nccl).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import secrets
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol, runtime_checkable

import torch

from dspo.rollout.faults import fault_point
from dspo.rollout.store import keyed_store, loopback_listener, push_key, sign, verified_header  # noqa: F401

log = logging.getLogger(__name__)

TRANSFERS = ("shared_memory", "gloo", "nccl")
_POLL_S = 0.5  # how often the engine process, waiting for announced weights, checks that its trainer still lives
# the engine's receiver waits for the next push through a whole update, validation and checkpoint; a side that dies
# closes its sockets, which ends the other side's wait at once, so the timeout only bounds a hung peer
_TIMEOUT = datetime.timedelta(hours=24)

Named = list[tuple[str, torch.Tensor]]
Loader = Callable[[Named, int], None]  # (named tensors, optimizer-step version) -> loads them into the engine
Alive = Callable[[], bool]  # whether the other side of the transfer still runs


@runtime_checkable
class WeightTransport(Protocol):
    """What both transports implement: the trainer's end (`allocate`, `connect_trainer`, `send`), the engine
    process's end (`connect_engine`, `receive`), and `close` on either. One object is made in the trainer and pickled
    into the engine process at spawn, so both ends share it."""

    def allocate(self, named: Named) -> None:
        """Trainer: buffers from the first weights (their names, shapes and dtypes), before the spawn."""

    def connect_trainer(self, peer_alive: Alive = ...) -> None:
        """Trainer, after the spawn: join the engine process (`peer_alive`: whether it still runs)."""

    def send(
        self, weights: Iterable[tuple[str, torch.Tensor]] | None, completed: int, version: int, sequence: int
    ) -> None:
        """Trainer: push number `sequence` (None: unchanged weights, the round count only)."""

    def connect_engine(self) -> None:
        """Engine process, at its start: join the trainer."""

    def receive(self, sequence: int, load: Loader, loaded_version: int | None) -> tuple[int, int]:
        """Engine process: (completed rounds, version) of push `sequence`, loaded through `load` if new."""

    def close(self) -> None:
        """Release buffers, threads and groups."""


class PeerGone(RuntimeError):
    """The other side of the transfer exited while this side waited for it."""


def parent_alive() -> Alive:
    """For the engine process: whether the trainer that started it still runs. The trainer's pid comes from the
    spawn itself (`multiprocessing.parent_process`), not from `os.getppid()` at the time of asking: a trainer that
    died while this process was still starting would otherwise never be missed (its orphan adopted by init)."""
    import multiprocessing

    parent = multiprocessing.parent_process()
    pid = parent.pid if parent is not None and parent.pid else os.getppid()
    return lambda: os.getppid() == pid


def _always() -> bool:
    return True


def check_transfer(kind: Any, colocated: bool = False, cuda: bool = True) -> str:
    """`rollout.weight_transfer`: its name when the callback is built, then (`colocated`: the engine process on its
    rank's own device; `cuda`: the trainer on a GPU) when the engine process is set up."""
    if kind not in TRANSFERS:
        raise ValueError(f"rollout.weight_transfer={kind!r}: use one of {', '.join(TRANSFERS)}")
    if kind == "nccl" and not cuda:
        raise ValueError(
            "rollout.weight_transfer=nccl needs the trainer on CUDA GPUs; on CPU use gloo or shared_memory"
        )
    if kind == "nccl" and colocated:
        raise ValueError(
            "rollout.weight_transfer=nccl with the engine process on its rank's own GPU: NCCL cannot join two "
            "processes on one GPU. Give the engines their own GPUs (rollout.engine_devices, docs/scaling.md) or use "
            "rollout.weight_transfer=shared_memory"
        )
    return kind


class SharedMemoryTransfer:
    """Host shared memory: written under a lock by the trainer, read under it by the engine process."""

    def __init__(self, ctx) -> None:
        self.lock = ctx.Lock()
        self.header = torch.zeros(2, dtype=torch.int64).share_memory_()  # [completed rounds, optimizer steps]
        self.shared: dict[str, torch.Tensor] = {}
        self.peer_alive: Alive = _always

    @contextlib.contextmanager
    def _locked(self, waiting: str) -> Iterator[None]:
        """The lock, taken in slices: a peer that died holding it (killed mid-load or mid-send) never releases it."""
        while not self.lock.acquire(timeout=_POLL_S):
            if not self.peer_alive():
                raise PeerGone(f"the other side of the weight transfer exited while this side waited to {waiting}")
        try:
            yield
        finally:
            self.lock.release()

    def __getstate__(self) -> dict:
        """At spawn: the lock and the buffers (the peer check is each side's own)."""
        return {"lock": self.lock, "header": self.header, "shared": self.shared}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.peer_alive = _always

    # trainer side
    def allocate(self, named: Named) -> None:
        """Before the engine process is spawned (the buffers travel with it)."""
        self.shared = {name: torch.empty(t.shape, dtype=t.dtype).share_memory_() for name, t in named}

    def connect_trainer(self, peer_alive: Alive = _always) -> None:
        """Nothing to connect (the buffers were shared at spawn); `peer_alive`: whether the engine process runs."""
        self.peer_alive = peer_alive

    def send(
        self, weights: Iterable[tuple[str, torch.Tensor]] | None, completed: int, version: int, sequence: int
    ) -> None:
        """Push number `sequence` (1, 2, ...; the engine process's `receive` waits for it by that number)."""
        with self._locked("send weights"):
            for index, (name, tensor) in enumerate(weights or ()):
                if name not in self.shared:
                    raise KeyError(f"push_weights: {name!r} was not in the first push (the policy's names changed)")
                self.shared[name].copy_(tensor.detach())
                if index == 0:
                    fault_point("trainer.mid_send")
            self.header.copy_(torch.tensor([completed, version]))

    # engine side
    def connect_engine(self) -> None:
        """Nothing to connect (see `connect_trainer`); the peer is the trainer that spawned this process."""
        self.peer_alive = parent_alive()

    def receive(self, sequence: int, load: Loader, loaded_version: int | None) -> tuple[int, int]:
        """(completed rounds, version) of the newest weights, loaded first if their version is not `loaded_version`."""
        with self._locked("receive weights"):  # the trainer writes these tensors under the same lock
            fault_point("engine.holding_weights")
            completed, version = (int(v) for v in self.header.tolist())
            if version != loaded_version:
                load(list(self.shared.items()), version)
        return completed, version

    def close(self) -> None:
        """The buffers are freed with the last reference."""


class CollectiveTransfer:
    """A two-member gloo or NCCL group between the trainer (rank 0) and its engine process (rank 1).

    Each push is announced on the host first (its header [completed rounds, version, changed] under the TCPStore key
    `dspo/push/<n>`), so the engine side never leaves a collective posted between pushes (an NCCL kernel waiting on
    the engine's GPU through a whole round would block any device-wide sync there); only a push with new weights
    then broadcasts them, in the layout of the first push, cast to `wire_dtype` (the engine's dtype) when given."""

    def __init__(self, backend: str, device: str = "cpu", wire_dtype: torch.dtype | None = None) -> None:
        self.backend, self.device = backend, device  # device: where the engine process keeps its staging buffers
        self.wire_dtype = wire_dtype
        self.layout: list[tuple[str, tuple, torch.dtype]] = []
        self.port = 0
        self.secret = ""  # per run, made at `allocate`; reaches the engine process through spawn's pipe only
        self.peer_alive: Alive = _always
        self._store = self._group = None

    def _make_group(self, rank: int, is_master: bool):
        import torch.distributed as dist

        if not is_master:
            self._store = keyed_store(dist.TCPStore("127.0.0.1", self.port, 2, False, timeout=_TIMEOUT), self.secret)
        if self.backend == "gloo":  # on the loopback interface: nothing listens beyond this machine
            options = dist.ProcessGroupGloo._Options()
            options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            options._timeout = _TIMEOUT
            return dist.ProcessGroupGloo(self._store, rank, 2, options)
        return self.group_type()(self._store, rank, 2, _TIMEOUT)

    def group_type(self):
        """The process-group class of an NCCL transfer (gloo is built with its options in `_make_group`)."""
        import torch.distributed as dist

        if not hasattr(dist, "ProcessGroupNCCL"):
            raise RuntimeError("rollout.weight_transfer=nccl: this torch build has no NCCL (a CPU build?); use gloo")
        return dist.ProcessGroupNCCL

    def _broadcast(self, tensor: torch.Tensor, peer_alive: Alive | None = None) -> None:
        """One broadcast; with `peer_alive` (the trainer's), waited for in slices while the peer lives: a peer alive
        but no longer receiving would otherwise hold it for the group's whole timeout (24 h)."""
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = 0
        work = self._group.broadcast([tensor], options)
        if peer_alive is not None and self.backend == "gloo":  # NCCL's wait() only orders streams: it returns
            while not work.is_completed():
                if not peer_alive():
                    raise PeerGone("the engine process exited while the trainer sent it weights")
                time.sleep(0.005)
        work.wait()

    def _wire(self, dtype: torch.dtype) -> torch.dtype:
        return self.wire_dtype if self.wire_dtype is not None and dtype.is_floating_point else dtype

    # trainer side
    def allocate(self, named: Named) -> None:
        """Record the layout and open the store (the engine process connects to it when it starts)."""
        import torch.distributed as dist

        self.layout = [(name, tuple(t.shape), t.dtype) for name, t in named]
        self.secret = secrets.token_hex(16)
        listener = loopback_listener()
        self.port = listener.getsockname()[1]
        listen = {"wait_for_workers": False, "master_listen_fd": listener.fileno()}
        store = dist.TCPStore("127.0.0.1", self.port, 2, True, timeout=_TIMEOUT, **listen)
        listener.detach()  # the store's server owns the socket now and closes it with the store
        self._store = keyed_store(store, self.secret)

    def connect_trainer(self, peer_alive: Alive = _always) -> None:
        """Join the group (the engine process's receiver thread is waiting for it)."""
        self.peer_alive = peer_alive
        self._group = self._make_group(0, is_master=True)

    def send(
        self, weights: Iterable[tuple[str, torch.Tensor]] | None, completed: int, version: int, sequence: int
    ) -> None:
        named = list(weights or ())
        if not self.peer_alive():  # NCCL would post the broadcast to a dead peer and stall the stream until close
            raise PeerGone("the engine process exited before the trainer sent it weights")
        if named and [(n, tuple(t.shape), t.dtype) for n, t in named] != self.layout:
            raise KeyError("push_weights: the policy's parameter names, shapes or dtypes changed since the first push")
        header = f"{completed},{version},{int(bool(named))}"
        self._store.set(push_key(self.secret, sequence), f"{header},{sign(self.secret, sequence, header)}")
        for index, (_, tensor) in enumerate(named):
            self._broadcast(self._on_wire(tensor.detach().to(self._wire(tensor.dtype)).contiguous()), self.peer_alive)
            if index == 0:
                fault_point("trainer.mid_send")

    def _on_wire(self, tensor: torch.Tensor) -> torch.Tensor:
        """gloo moves host tensors; NCCL device tensors (the trainer's own GPU)."""
        if self.backend == "gloo":
            return tensor.cpu()
        return tensor if tensor.is_cuda else tensor.cuda()

    # engine side
    def connect_engine(self) -> None:
        """Start the receiver thread: it joins the group, then takes every push into the staging buffers."""
        self._ready = threading.Condition()
        self._received, self._newest, self._failure = 0, (0, -1), None
        self._staging: dict[str, torch.Tensor] | None = None  # allocated at the first weights: after the engine
        self._trainer_alive = parent_alive()
        self._thread = threading.Thread(target=self._receive_forever, name="dspo-weights", daemon=True)
        self._thread.start()

    def _receive_forever(self) -> None:
        try:
            self._group = self._make_group(1, is_master=False)
            sequence = 0
            while True:
                sequence += 1
                key = push_key(self.secret, sequence)
                completed, version, changed = verified_header(self.secret, sequence, self._store.get(key).decode())
                fault_point("engine.receiver")
                self._store.delete_key(key)
                with self._ready:  # the engine loads from the staging buffers under the same condition
                    if changed:
                        self._receive_tensors()
                    self._newest = (completed, version)
                    self._received = sequence
                    self._ready.notify_all()
        except BaseException as error:  # noqa: BLE001 - reported at once (`on_failure`), else at the next receive
            with self._ready:
                self._failure = error
                self._ready.notify_all()
            # the engine process's: report and exit (dspo.rollout.engine_process_main)
            report = getattr(self, "on_failure", None)
            if report is not None:
                report("".join(traceback.format_exception(error)))

    def _receive_tensors(self) -> None:
        device = "cpu" if self.backend == "gloo" else self.device
        if self._staging is None:
            self._staging = {
                name: torch.empty(shape, dtype=self._wire(dtype), device=device) for name, shape, dtype in self.layout
            }
        for tensor in self._staging.values():
            self._broadcast(tensor)
        if self.backend == "nccl":  # NCCL's wait() orders streams only: the host waits here
            torch.cuda.current_stream().synchronize()

    def receive(self, sequence: int, load: Loader, loaded_version: int | None) -> tuple[int, int]:
        with self._ready:
            while not self._ready.wait_for(lambda: self._received >= sequence or self._failure is not None, _POLL_S):
                if not self._trainer_alive():
                    raise RuntimeError("the trainer is gone while the engine process waited for its weights")
            if self._failure is not None:
                raise RuntimeError(f"rollout.weight_transfer={self.backend}: receiving weights failed") from (
                    self._failure
                )
            completed, version = self._newest
            if version != loaded_version:
                load(list(self._staging.items()), version)
                if self.backend == "nccl":  # the engine's copies out of staging finish before the next push lands
                    torch.cuda.current_stream().synchronize()
        return completed, version

    def close(self) -> None:
        """Trainer side, after the engine process stopped: end the group and drop the store."""
        if self.backend == "nccl" and self._group is not None and hasattr(self._group, "abort"):
            try:
                self._group.abort()
            except Exception:  # noqa: BLE001 - the peer is gone; nothing is waiting on the group
                log.debug("aborting the NCCL weight-transfer group failed", exc_info=True)
        self._group = self._store = None

    def __getstate__(self) -> dict:
        """What the engine process gets at spawn: the layout, where to connect and the run's secret (not the store or
        the group)."""
        keep = ("backend", "device", "wire_dtype", "layout", "port", "secret")
        return {key: getattr(self, key) for key in keep}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.peer_alive = _always
        self._store = self._group = None


def make_transfer(kind: str, ctx, engine_device: str = "cpu", wire_dtype: torch.dtype | None = None) -> WeightTransport:
    """The trainer's end of `rollout.weight_transfer` (`wire_dtype`: the engine's dtype, for the collective ones)."""
    if kind == "shared_memory":
        return SharedMemoryTransfer(ctx)
    return CollectiveTransfer(kind, engine_device, wire_dtype)
