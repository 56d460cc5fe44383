"""`prepare --ray ADDRESS`: the per-chunk stages as Ray tasks on a cluster, behind a process pool's interface.

What runs where:
- the driver (the `prepare` process) reads the inputs, cuts them into chunks, takes the dedup
  decisions and writes every output file, exactly as without Ray;
- each chunk (clean, exact hash, MinHash band keys, encode: `workers.clean_chunk` /
  `workers.tokenize_chunk`) is one Ray task, on any node with a free CPU;
- so is the sort of each dedup partition (records split by the top bits of their key: exact
  duplicates, and the band buckets that near-duplicate candidates share), its records in and its
  decisions out (`RayCluster.map`); the partitions' files stay on the driver's disk, and the
  greedy near-dedup pass over the candidates, which needs input order across partitions, runs there.

`RayPool` has the two methods `pool.ordered` uses (`apply_async(fn, args).get()` and
`terminate()`), so the driver keeps taking results in input order with a bounded number in
flight, and the output is byte-identical to a local run. Ray is the only transport: no RPC of ours.

A pool initializer (`workers.init_worker`) sets per-process state; a Ray task has no initializer.
The init arguments go to the object store once (`ray.put`), each task carries their reference,
and a Ray worker process runs the initializer the first time it meets that reference (a
per-process cache, like a pool worker's). The tokenizer file travels by content in the same
object: the nodes need no shared filesystem.

Every node must run the same mspretrain sources and library versions, or "byte-identical" would
not hold: `connect` checks that on each node (one small task pinned to it) before anything is
written, and refuses in one line naming the node that differs.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import pickle
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from mspretrain.errors import UserError

INSTALL_HINT = "pip install 'mspretrain[ray]' (on this machine and on every node of the cluster)"
PROBE_SECONDS = 10.0  # TCP reachability of host:port before `ray.init`, which would retry for minutes
NODE_CHECK_SECONDS = 120.0  # a node's first task starts a Ray worker process that imports mspretrain
DEDUP_IN_FLIGHT = 4  # dedup partitions out at once (each ~diskdedup.PART_BYTES, held by the driver until done)
TOKENIZER_NAMES = ("tokenizer.model", "tokenizer.json")  # an init argument naming one is sent by content


def code_fingerprint() -> dict[str, str]:
    """What must be equal on every node for byte-identical output: mspretrain's Python sources and
    the versions of Python and of the libraries the workers call."""
    import numpy

    import mspretrain

    root = Path(mspretrain.__file__).resolve().parent
    h = hashlib.sha256()
    for p in sorted(root.rglob("*.py")):
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    out = {"mspretrain": f"{mspretrain.__version__} sources {h.hexdigest()[:16]}",
           "python": ".".join(map(str, sys.version_info[:3])), "numpy": numpy.__version__}
    for lib in ("sentencepiece", "tokenizers", "opencc", "py3langid"):
        if importlib.util.find_spec(lib) is not None:
            out[lib] = getattr(__import__(lib), "__version__", "?")
    return out


def _probe(address: str) -> None:
    """Refuse an address whose host:port does not answer, in seconds instead of Ray's minutes."""
    if address in ("auto", "local") or "://" in address and not address.startswith("ray://"):
        return
    hostport = address.removeprefix("ray://")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"--ray {address}: not an address Ray accepts",
                        "give HOST:PORT of the head node (as `ray start --head` printed), ray://HOST:PORT, auto or local")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_SECONDS).close()
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise UserError(f"cannot reach the Ray cluster at {address} ({why}); nothing was written",
                        "start the head node with `ray start --head --port PORT` and pass its HOST:PORT, or run without --ray") from None


class RayCluster:
    """A connection to a Ray cluster (`ray.init`), checked, with the CPUs it offers."""

    def __init__(self, address: str) -> None:
        if importlib.util.find_spec("ray") is None:
            raise UserError("--ray needs the `ray` package, which is not installed", INSTALL_HINT)
        _probe(address)
        import logging

        import ray

        self.address = address
        try:
            ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise UserError(f"cannot connect to the Ray cluster at {address}: {str(exc).splitlines()[0][:200]}; nothing was written",
                            "start the head node with `ray start --head` and pass its HOST:PORT, or run without --ray") from None
        try:
            self.nodes = [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) >= 1]
            self.cpus = int(sum(n["Resources"]["CPU"] for n in self.nodes))
            if self.cpus < 1:
                raise UserError(f"the Ray cluster at {address} has no CPUs to run tasks on",
                                "start the nodes with --num-cpus N (N >= 1)")
            self._check_nodes()
        except BaseException:
            ray.shutdown()
            raise
        self._task = ray.remote(num_cpus=1)(_run)  # retried (Ray's default, 3) if its worker or node dies: a chunk is pure

    def _check_nodes(self) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = code_fingerprint()
        check = ray.remote(num_cpus=1)(code_fingerprint)
        refs = {n["NodeManagerAddress"] + " " + n["NodeID"][:8]:
                check.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
                for n in self.nodes}
        for node, ref in refs.items():
            try:
                there = ray.get(ref, timeout=NODE_CHECK_SECONDS)
            except ray.exceptions.GetTimeoutError:
                raise UserError(f"Ray node {node} did not run a task within {NODE_CHECK_SECONDS:.0f} s; nothing was written",
                                "check the cluster with `ray status`") from None
            except ray.exceptions.RayError as exc:
                raise UserError(f"Ray node {node} cannot run mspretrain's tasks ({str(exc).strip().splitlines()[-1][:160]}); nothing was written",
                                f"install the same mspretrain on every node: {INSTALL_HINT}") from None
            diff = [f"{k} {there.get(k)} there, {v} here" for k, v in here.items() if there.get(k) != v]
            if diff:
                raise UserError(f"Ray node {node} runs other code than this machine ({'; '.join(diff)}), so the output "
                                "would not be byte-identical; nothing was written",
                                "install the same mspretrain and library versions on every node")

    def describe(self) -> str:
        return f"{self.cpus} CPU{'s' * (self.cpus != 1)} on {len(self.nodes)} node{'s' * (len(self.nodes) != 1)}"

    def pool(self, initializer: Callable, initargs: tuple) -> RayPool:
        return RayPool(self._task, initializer, initargs)

    def map(self, fn: Callable, items: Iterable) -> Iterator:
        """fn over items as Ray tasks, results in order, at most DEDUP_IN_FLIGHT out at once: the
        dedup partitions (`diskdedup.DiskDedup.resolve`), ~PART_BYTES each, bytes in and decisions out."""
        from mspretrain.prepare.pool import ordered

        pool = self.pool(_no_state, ())
        try:
            yield from ordered(pool, fn, items, DEDUP_IN_FLIGHT)
        finally:
            pool.terminate()

    def close(self) -> None:
        import ray

        ray.shutdown()

    def __enter__(self) -> RayCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RayPool:
    """`apply_async(fn, (item,)) -> handle` with `handle.get()`, and `terminate()`: what `pool.ordered` needs."""

    def __init__(self, task, initializer: Callable, initargs: tuple) -> None:
        import ray

        shipped = tuple(_File(Path(a).name, Path(a).read_bytes()) if isinstance(a, (str, Path)) and Path(a).name in TOKENIZER_NAMES
                        and Path(a).is_file() else a for a in initargs)
        self._init = [ray.put((initializer, shipped))]  # in a list: Ray passes the reference, not the value
        self._task = task
        self._pending: set = set()

    def apply_async(self, fn: Callable, args: tuple) -> _Result:
        ref = self._task.remote(self._init, fn, *args)
        self._pending.add(ref)
        return _Result(self, ref)

    def terminate(self) -> None:
        """Cancel the tasks not collected yet (after an error, or ^C, in the driver)."""
        import ray

        for ref in self._pending:
            try:
                ray.cancel(ref, force=True)
            except Exception:  # already finished, or the connection is gone: nothing left to stop
                pass
        self._pending.clear()


class _Result:
    def __init__(self, pool: RayPool, ref) -> None:
        self._pool, self._ref = pool, ref

    def get(self) -> Any:
        import ray

        try:
            data = ray.get(self._ref)
        except ray.exceptions.RayTaskError as exc:  # the task raised: the same exception as a local pool would
            raise exc.cause if isinstance(exc.cause, UserError) else exc from None
        except ray.exceptions.RayError as exc:  # a node or worker died beyond Ray's retries, or the cluster went away
            raise UserError(f"a Ray task failed: {str(exc).strip().splitlines()[0][:200]}; nothing was published",
                            "check the cluster with `ray status`, then run the same command again") from None
        finally:
            self._pool._pending.discard(self._ref)
        # The result crossed as pickled bytes: arrays come back writable and own their memory, as
        # from a process pool, instead of read-only views pinning the driver's object store.
        return pickle.loads(data)


class _File:
    """A file's name and bytes, recreated in a temporary dir of the Ray worker process that needs it."""

    def __init__(self, name: str, data: bytes) -> None:
        self.name, self.data = name, data


def _no_state() -> None:
    """The initializer of tasks that need no per-process state (the dedup partitions)."""


_ready: Any = None  # the init reference this Ray worker process was initialised with


def _run(init: list, fn: Callable, item: Any) -> bytes:
    """A Ray task: initialise this worker process once per pool, then run fn on one chunk."""
    global _ready
    import ray

    key = init[0].hex()
    if _ready != key:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as in a pool worker: one thread per task
        initializer, args = ray.get(init[0])
        with tempfile.TemporaryDirectory(prefix="mspretrain-ray-") as tmp:
            local = []
            for a in args:
                if isinstance(a, _File):
                    (Path(tmp) / a.name).write_bytes(a.data)
                    a = str(Path(tmp) / a.name)
                local.append(a)
            initializer(*local)  # the tokenizer is read into memory here: the file may go
        _ready = key
    return pickle.dumps(fn(item), protocol=5)
