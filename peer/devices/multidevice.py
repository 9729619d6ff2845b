"""A peer of several devices: ``torchrun --nproc-per-node N -m potluck peer --join ADDRESS``.

The N processes (one per GPU, or N CPU processes) are *one* peer of the swarm. Rank 0, the
**leader**, is the peer the others see: it joins the DHT, serves gRPC, takes part in the outer
all-reduce and reports. Ranks 1..N-1, the **helpers**, only compute: each holds a replica of the
leader's stage worker (or, with ``--devices shard``, its share of one: :mod:`potluck.peer.devices.sharding`)
and does what the leader's commands say, sent over a gloo group::

    Setup(run config, shard)   once, when the leader has joined the run
    Build(stage, bounds)       a fresh stage worker at theta_0 (the start, starting over)
    Load(steps_done) + theta   the leader's parameters changed outside the inner loop: an outer step,
                               a recovered snapshot; theta follows on the device group (sharded: on
                               the host group, and each rank copies out its rows)
    Phase(step)                an inner phase begins: one Rows per inner step follows
    Rows(batch)                the leader's batch of the step; every rank trains on its slice of it
    Gather                     sharded: each rank sends its rows; the leader assembles theta on its host
    Eval(inputs)               sharded: each rank runs the same forward passes (their all-gathers pair up)
    Stop(reason)               the leader is done

Every rank runs the same :class:`~potluck.peer.training.stage.StageWorker` code for an inner step: forward and
backward on its ``batch_size / N`` rows, then the mean of the gradients (and of the loss, for the
report) over the device group, then the same AdamW step. Identical parameters and identical averaged
gradients give identical parameters, so the ranks stay in lockstep without moving parameters during
a phase; each Load re-broadcasts theta from the leader all the same. The whole group trains the batch
one device would, so the peer's throughput in its record (batch per step time) is the group's.

A helper's phase ends after H steps, like the leader's; if the leader stops earlier, the next
command it sends (Load, Phase or Stop) ends the helper's phase where it stands.

Ending: the leader sends Stop whatever ends its peer (the run is over, a signal, an error). A helper
ignores SIGINT and SIGTERM (torchrun forwards them to every rank): it ends with its leader, so a
collective never loses a member while the leader shuts down in order. Should the leader die
instead, its sockets close and a helper waiting on it fails at once (gloo: "connection closed by
peer"); torchrun then ends the group. Collectives in lockstep (gradients, theta) time out after
``LOCKSTEP_TIMEOUT``; a helper's wait for the next command has no useful bound, since the leader
may wait for a round for hours.

Multi-device peers train ``pipeline.stages = 1`` runs only: a pipeline run is refused at startup.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import signal
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from potluck.peer.devices import sharding
from potluck.peer.outer.diloco import flatten_params, load_flat
from potluck.peer.training.data import Dataset
from potluck.peer.training.stage import Batch, StageWorker
from potluck.protos.config.runconfig import RunConfig
from potluck.protos.config.section import ConfigError
from potluck.protos.runtime.log import get_logger, set_context
from potluck.protos.runtime.warmup import warm_up

log = get_logger(__name__)

LOCKSTEP_TIMEOUT = datetime.timedelta(minutes=10)  # rendezvous, gradients, theta: every rank is there at once
COMMAND_TIMEOUT = datetime.timedelta(days=7)  # a helper waiting for its leader (liveness comes from the sockets)
BUCKET = 1 << 24  # gradient elements per all-reduce
HASHES_ENV = "POTLUCK_DEVICE_HASHES"  # tests: a folder where each rank writes its parameters' hash at each load


@dataclass(frozen=True)
class Launch:
    """This process's place in a torchrun launch (its environment)."""

    rank: int
    world: int
    local_rank: int

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Launch | None:
        """None when this is a single process (``WORLD_SIZE`` unset or 1): nothing changes then."""
        try:
            world = int(env.get("WORLD_SIZE") or 1)
            if world <= 1:
                return None
            rank = int(env["RANK"])
            return cls(rank, world, int(env.get("LOCAL_RANK", rank)))
        except (KeyError, ValueError) as err:
            raise ConfigError(f"WORLD_SIZE is set but RANK/LOCAL_RANK are not usable ({err!r}): start a "
                              "multi-device peer with torchrun --nproc-per-node N -m potluck peer ...") from None


def device_for(choice: str, local_rank: int) -> torch.device:
    """A rank's device: ``cuda:LOCAL_RANK`` on a GPU box, the CPU otherwise (or when asked for)."""
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if choice not in ("auto", "cuda"):
        raise ConfigError(f"--device {choice!r}: each process of a torchrun peer takes cuda:LOCAL_RANK; "
                          "say --device cuda (or cpu), and CUDA_VISIBLE_DEVICES to choose the GPUs")
    if not torch.cuda.is_available():
        raise ConfigError("--device cuda requested but torch sees no CUDA device")
    if local_rank >= torch.cuda.device_count():
        raise ConfigError(f"local rank {local_rank} has no GPU: torch sees {torch.cuda.device_count()}; "
                          "start at most that many processes per node")
    return torch.device("cuda", local_rank)


# ---------------------------------------------------------------------- the leader's commands


@dataclass(frozen=True)
class Setup:
    rc: RunConfig
    shard: bool = False


@dataclass(frozen=True)
class Build:
    stage: int
    bounds: tuple[int, int]


@dataclass(frozen=True)
class Load:
    steps_done: int
    numel: int


@dataclass(frozen=True)
class Phase:
    step: int


@dataclass(frozen=True)
class Rows:
    batch: Batch


@dataclass(frozen=True)
class Gather:
    pass


@dataclass(frozen=True)
class Eval:
    inputs: list[torch.Tensor]


@dataclass(frozen=True)
class Stop:
    reason: str


Command = Setup | Build | Load | Phase | Rows | Gather | Eval | Stop


class PhaseEnded(Exception):
    """The leader sent something other than the next batch: its inner phase ended early."""

    def __init__(self, command: Command) -> None:
        super().__init__(type(command).__name__)
        self.command = command


# ---------------------------------------------------------------------- the group


class DeviceGroup:
    """The process groups of a multi-device peer: the default one (nccl on CUDA, gloo on a CPU) for
    gradients and parameters, and a gloo one for the leader's commands."""

    def __init__(self, launch: Launch, device: torch.device) -> None:
        self.rank, self.world, self.device = launch.rank, launch.world, device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        try:
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=LOCKSTEP_TIMEOUT)
            self.commands: dist.ProcessGroup | None = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
            # host tensors in lockstep (a sharded stage's theta): gloo, whatever the devices speak
            self.host: dist.ProcessGroup | None = dist.new_group(backend="gloo", timeout=LOCKSTEP_TIMEOUT)
        except (ValueError, RuntimeError) as err:  # no MASTER_ADDR, a rank that never came, ...
            raise ConfigError(f"cannot form this peer's process group of {self.world}: {err}") from None
        self._trace = Trace.from_env(self.rank)
        self.sharded = False  # (set at Setup: --devices shard)
        self._mesh: object | None = None

    @property
    def leads(self) -> bool:
        return self.rank == 0

    def send(self, command: Command) -> None:
        dist.broadcast_object_list([command], src=0, group=self.commands)

    def receive(self) -> Command:
        box: list[Command | None] = [None]
        dist.broadcast_object_list(box, src=0, group=self.commands)
        assert box[0] is not None
        return box[0]

    def theta(self, theta: torch.Tensor | None, numel: int) -> torch.Tensor:
        """The leader's ``theta`` (it passes it; the others pass None), on this rank's device (sharded: on
        its host, where each rank copies out its rows; no device holds the whole vector)."""
        if self.sharded:
            buf = theta if theta is not None else torch.empty(numel, dtype=torch.float32)
            dist.broadcast(buf, src=0, group=self.host)
            return buf
        buf = (theta.to(self.device, torch.float32) if theta is not None
               else torch.empty(numel, dtype=torch.float32, device=self.device))
        dist.broadcast(buf, src=0)
        return buf

    def trace(self, event: str, steps_done: int, held: list[nn.Parameter] | torch.Tensor) -> None:
        """Tests: the hash of this rank's parameters, or of a flat theta (sharded: of the whole stage's
        parameters, gathered, written by the leader alone; every rank calls it then, in lockstep)."""
        if self._trace.path is None:
            return
        if isinstance(held, torch.Tensor) or not self.sharded:
            self._trace(event, steps_done, held)
            return
        params = held
        numel = sum(p.numel() for p in params)
        whole = self.gather(params, torch.empty(numel, dtype=torch.float32) if self.leads else None)
        if whole is not None:
            self._trace(event, steps_done, whole)

    def shard(self, worker: StageWorker) -> None:
        """Shard ``worker``'s layers over this peer's devices (every rank, in the same order)."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(self.device.type, (self.world,))
        n = sharding.shard(worker.layers, self._mesh)
        worker.params = list(worker.layers.parameters())  # (DTensors now)
        if self.leads:
            log.info("sharded %d of the stage's %d layers over this peer's %d processes (FSDP2): each holds 1/%d "
                     "of their weights, gradients and AdamW state", n, len(worker.layers), self.world, self.world)

    def gather(self, params: list[nn.Parameter], out: torch.Tensor | None) -> torch.Tensor | None:
        """Sharded: the stage's flat theta in ``out`` on the leader (None elsewhere); every rank calls it."""
        return sharding.gather(params, self.rank, self.world, out, self.host)

    def load(self, params: list[nn.Parameter], theta: torch.Tensor) -> None:
        """Parameters from the broadcast ``theta``: a sharded rank copies out its rows, a replica all of it."""
        if self.sharded:
            sharding.load(params, theta, self.rank, self.world)
        else:
            load_flat(params, theta)

    def rows(self, batch: Batch) -> Batch:
        """This rank's slice of the batch: ``batch_size / N`` consecutive rows."""
        ids, x, y = batch
        n = len(x) // self.world
        part = slice(self.rank * n, (self.rank + 1) * n)
        return ids[part], x[part], y[part]

    def average(self, params: list[nn.Parameter], loss: float) -> float:
        """Replace every gradient by its mean over the ranks (the same bits on all of them: each chunk
        is summed once and the sum passed on); returns the mean loss."""
        # (sharded parameters' gradients were averaged by FSDP's reduce-scatter in the backward pass)
        grads = [p.grad for p in params if p.grad is not None and not sharding.is_sharded(p)]
        for dtype in dict.fromkeys(g.dtype for g in grads):
            bucket: list[torch.Tensor] = []
            size = 0
            for g in (g for g in grads if g.dtype == dtype):
                bucket.append(g)
                size += g.numel()
                if size >= BUCKET:
                    self._mean(bucket)
                    bucket, size = [], 0
            if bucket:
                self._mean(bucket)
        total = torch.tensor([loss], dtype=torch.float64, device=self.device)
        dist.all_reduce(total)
        return float(total) / self.world

    def _mean(self, tensors: list[torch.Tensor]) -> None:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat)
        flat.div_(self.world)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

    def close(self) -> None:
        try:
            dist.destroy_process_group()
        except Exception as err:  # a member already gone: nothing left to tear down in order
            log.warning("could not destroy this peer's process group in order (%s); its processes end anyway", err)
        # the last reference to the command group: its threads are joined now. Left to the interpreter's
        # teardown, one of them may release its last work then, need the GIL, and abort the process
        self.commands = None


class Trace:
    """Tests: each rank appends ``<event> <inner steps> <sha256 of its parameters>`` to
    ``$POTLUCK_DEVICE_HASHES/rank-<r>.txt`` around every load, so a test compares the ranks."""

    def __init__(self, path: Path | None) -> None:
        self.path = path

    @classmethod
    def from_env(cls, rank: int) -> Trace:
        folder = os.environ.get(HASHES_ENV)
        if not folder:
            return cls(None)
        Path(folder).mkdir(parents=True, exist_ok=True)
        return cls(Path(folder) / f"rank-{rank}.txt")

    def __call__(self, event: str, steps_done: int, held: list[nn.Parameter] | torch.Tensor) -> None:
        """``held``: the parameters, or theta as one flat vector."""
        if self.path is None:
            return
        theta = held.detach().to("cpu", torch.float32) if isinstance(held, torch.Tensor) else flatten_params(held)
        digest = hashlib.sha256(theta.contiguous().numpy().tobytes()).hexdigest()
        with self.path.open("a") as f:
            f.write(f"{event} {steps_done} {digest}\n")


# ---------------------------------------------------------------------- rank 0


class Leader:
    """Rank 0's side: it tells the helpers what to do, and its stage worker calls the hooks of
    :class:`~potluck.peer.training.stage.Devices` (``worker.devices``)."""

    def __init__(self, group: DeviceGroup, shard: bool = False) -> None:
        self.group = group
        self.shard = shard  # --devices shard: the stage split over the processes, not replicated on each
        self.stopped = False

    @property
    def sharded(self) -> bool:
        return self.group.sharded

    @property
    def device(self) -> torch.device:
        return self.group.device

    @property
    def world(self) -> int:
        return self.group.world

    def setup(self, rc: RunConfig) -> None:
        """Refuse a run this group cannot train (with a reason), else hand the helpers its config."""
        n, b = self.group.world, rc.train.batch_size
        k = rc.train.grad_accum if isinstance(rc.train.grad_accum, int) else 1  # auto: divisors of each rank's rows
        if rc.pipeline.stages > 1:
            raise ConfigError(f"this peer is {n} processes (torchrun), which train runs of pipeline.stages = 1 only; "
                              f"this run has {rc.pipeline.stages} stages: start one peer per GPU instead "
                              "(potluck peer --device cuda:N)")
        if rc.train.step_in_backward:
            raise ConfigError(f"train.step_in_backward updates each parameter in the backward pass, before this peer's "
                              f"{n} processes have averaged its gradient: set it false, or start one peer per device")
        if self.shard:
            sharding.refuse(rc)
        if b % (n * k):
            raise ConfigError(f"train.batch_size = {b} does not split over this peer's {n} processes"
                              + (f" x train.grad_accum = {k} micro-batches" if k > 1 else "")
                              + f": it must be a multiple of {n * k}; start a number of processes that divides it")
        self.group.send(Setup(rc, self.shard))
        self.group.sharded = self.shard
        log.info("a peer of %d processes on %s: each trains %d of the %d rows of every batch%s", n,
                 self.device.type, b // n, b, ", its stage sharded over them" if self.shard else "")

    def attach(self, worker: StageWorker) -> None:
        """``worker`` (a fresh one, at theta_0) is the leader's now: the helpers build theirs and load its theta."""
        self.group.send(Build(worker.stage, worker.bounds))
        theta0 = worker.theta()
        if self.sharded:
            self.group.shard(worker)
        worker.devices = self
        worker.load(theta0, worker.steps_done)

    # the stage worker's hooks

    def begin(self, step: int) -> None:
        self.group.send(Phase(step))

    def split(self, batch: Batch | None) -> Batch:
        assert batch is not None, "the leader reads the batches"
        self.group.send(Rows(batch))
        return self.group.rows(batch)

    def average(self, params: list[nn.Parameter], loss: float) -> float:
        return self.group.average(params, loss)

    def load(self, params: list[nn.Parameter], theta: torch.Tensor, steps_done: int) -> None:
        """Every rank loads ``theta`` (the leader too, when sharded: :meth:`StageWorker.load` leaves it to this)."""
        self.group.send(Load(steps_done, theta.numel()))
        self.group.trace("before", steps_done, params)  # (sharded: a gather, which the helpers join on Load)
        self.group.theta(theta.contiguous(), theta.numel())
        if self.sharded:
            self.group.load(params, theta)
            self.group.trace("loaded", steps_done, theta)
            self.group.trace("after", steps_done, params)  # (gathered back: the hash of what the ranks now hold)
        else:
            self.group.trace("after", steps_done, theta)

    def gather(self, params: list[nn.Parameter], out: torch.Tensor) -> torch.Tensor:
        """Sharded: the stage's theta, its rows sent by every rank, assembled in ``out`` on this host."""
        self.group.send(Gather())
        whole = self.group.gather(params, out)
        assert whole is not None
        return whole

    def evaluate(self, inputs: list[torch.Tensor]) -> None:
        """Sharded: the other ranks run the forward passes the leader is about to (their weights' all-gathers pair
        up); replicated, the leader evaluates alone."""
        if self.sharded:
            self.group.send(Eval(inputs))

    def close(self, reason: str) -> None:
        """The peer is done: the helpers may go (they are gone already if the group broke)."""
        if self.stopped:
            return
        self.stopped = True
        try:
            self.group.send(Stop(reason))
        except Exception as err:  # a helper died: torchrun ends the group anyway
            log.warning("could not tell this peer's other processes to stop: %s", err)
        self.group.close()


# ---------------------------------------------------------------------- ranks 1..N-1


class Helper:
    """A rank other than 0: a replica of the leader's stage worker that follows its commands."""

    def __init__(self, group: DeviceGroup, threads: int = 0) -> None:
        self.group = group
        self.threads = threads
        self.rc: RunConfig | None = None
        self.worker: StageWorker | None = None
        self.never = threading.Event()  # a helper's phase ends when the leader's does, never on its own

    def run(self) -> int:
        """Follow the leader until it says Stop; returns the process exit code."""
        set_context(role=f"rank{self.group.rank}")
        for sig in (signal.SIGINT, signal.SIGTERM):  # it ends with its leader (see the module's docstring)
            signal.signal(sig, signal.SIG_IGN)
        if self.threads:
            torch.set_num_threads(self.threads)
        warm_up("torch._dynamo")
        log.info("rank %d of %d on %s: waiting for the leader (rank 0) to join the run", self.group.rank,
                 self.group.world, self.group.device)
        try:
            command = self.group.receive()
            while not isinstance(command, Stop):
                try:
                    self._do(command)
                except PhaseEnded as ended:
                    command = ended.command
                    continue
                command = self.group.receive()
        except RuntimeError as err:  # the leader died: gloo says its connection closed (torchrun ends the group)
            log.error("rank %d: lost the leader (rank 0): %s", self.group.rank, (str(err).splitlines() or [""])[0])
            return 1
        finally:
            self.group.close()
        log.info("rank %d: the leader stopped (%s)", self.group.rank, command.reason)
        return 0

    def _do(self, command: Command) -> None:
        match command:
            case Setup(rc=rc, shard=shard):
                self.rc = rc
                self.group.sharded = shard
            case Build(stage=stage, bounds=bounds):
                assert self.rc is not None, "Build before Setup"
                # the leader reads the data: a helper's worker is never its stage's first reader
                worker = StageWorker(self.rc, stage, bounds, self.group.device, cast(Dataset, None), None)
                if self.group.sharded:
                    self.group.shard(worker)
                worker.first, worker.devices = False, self
                self.worker = worker
            case Load(steps_done=steps_done, numel=numel):
                w = self._worker()
                self.group.trace("before", steps_done, w.params)
                self.group.load(w.params, self.group.theta(None, numel))
                w.steps_done = steps_done
                self.group.trace("after", steps_done, w.params)
            case Phase(step=step):
                self._worker().inner_phase([], self.never, lambda i, loss, seconds: None, step)
            case Gather():
                self.group.gather(self._worker().params, None)
            case Eval(inputs=inputs):
                w = self._worker()
                w.layers.eval()
                try:
                    with torch.no_grad():
                        for x in inputs:
                            w.runner(x.to(self.group.device))
                finally:
                    w.layers.train()
            case _:
                raise RuntimeError(f"rank {self.group.rank}: unexpected {type(command).__name__} from the leader")

    def _worker(self) -> StageWorker:
        if self.worker is None:
            raise RuntimeError(f"rank {self.group.rank}: the leader sent a command before Build")
        return self.worker

    # the stage worker's hooks

    def begin(self, step: int) -> None:
        """(The Phase command began it.)"""

    def split(self, batch: Batch | None) -> Batch:
        command = self.group.receive()
        if not isinstance(command, Rows):
            raise PhaseEnded(command)
        return self.group.rows(command.batch)

    def average(self, params: list[nn.Parameter], loss: float) -> float:
        return self.group.average(params, loss)

    def load(self, params: list[nn.Parameter], theta: torch.Tensor, steps_done: int) -> None:
        """(A helper loads only what the leader broadcasts, in :meth:`_do`.)"""

    @property
    def sharded(self) -> bool:
        return self.group.sharded

    def gather(self, params: list[nn.Parameter], out: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a helper's theta is gathered on the leader's command, never on its own")

    def evaluate(self, inputs: list[torch.Tensor]) -> None:
        """(A helper evaluates on the leader's command, in :meth:`_do`.)"""


def start(device: str, env: Mapping[str, str] = os.environ) -> DeviceGroup | None:
    """This process's device group under torchrun (it waits for every rank), or None for a lone process."""
    launch = Launch.from_env(env)
    if launch is None:
        return None
    return DeviceGroup(launch, device_for(device, launch.local_rank))
