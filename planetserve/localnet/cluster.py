"""Running a network built by `planetserve.genesis.network.build_network` on this machine.

Per node the cluster starts the ABCI app (unless the network uses cometbft's built-in kvstore),
waits for its socket, then starts `cometbft start --home <home>`. Each process runs in its own
process group with its output appended to `<home>/logs/{app,cometbft}.log`; pids (with their
kernel start times, so a recycled pid is never signalled) are recorded in `<home>/pids.json`, so
`stop_all(root)` can stop a network from another process that only knows the directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from planetserve.chain.rpc import RpcClient, RpcError, hexb, integer
from planetserve.genesis.network import NetworkSpec, ValidatorInfo, cometbft_binary

Part = Literal["all", "app", "cometbft"]
PIDS_FILE = "pids.json"
POLL = 0.05


class ClusterError(Exception):
    """A process failed to start or the network did not behave as expected."""


# --- pid bookkeeping (usable without a Cluster) --------------------------------------------------


def _proc_start_time(pid: int) -> int | None:
    """The kernel start time of `pid` (clock ticks since boot), or None if it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def _alive(entry: Mapping[str, int]) -> bool:
    start = _proc_start_time(int(entry["pid"]))
    return start is not None and start == int(entry["start"])


def _read_pids(home: Path) -> dict[str, dict[str, int]]:
    try:
        body = json.loads((home / PIDS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return body if isinstance(body, dict) else {}


def _write_pids(home: Path, pids: dict[str, dict[str, int]]) -> None:
    tmp = home / (PIDS_FILE + ".tmp")
    tmp.write_text(json.dumps(pids, indent=2) + "\n")
    tmp.replace(home / PIDS_FILE)


def _signal_group(entry: Mapping[str, int], sig: int) -> None:
    """Signal the process group led by the recorded process, if it is still that process."""
    if _alive(entry):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(int(entry["pid"]), sig)


def _stop_entry(
    entry: Mapping[str, int], sig: int, timeout: float, proc: subprocess.Popen | None = None
) -> None:
    """Send `sig`, wait up to `timeout` for the process to end, then SIGKILL its group."""
    _signal_group(entry, sig)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=POLL)
        if not _alive(entry):
            break
        if proc is None:
            time.sleep(POLL)
    else:
        _signal_group(entry, signal.SIGKILL)
    if proc is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout)


def stop_home(home: Path, part: Part = "all", sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
    """Stop the processes recorded in `home/pids.json` (cometbft first, then the app)."""
    pids = _read_pids(home)
    for name in ("cometbft", "app"):
        if part in ("all", name) and name in pids:
            _stop_entry(pids[name], sig, timeout)
            del pids[name]
    _write_pids(home, pids)


def stop_all(root: Path, timeout: float = 10.0) -> None:
    """Stop every node of the network under `root`, from the pid files alone."""
    for home in sorted(Path(root).glob("v*")):
        if (home / PIDS_FILE).exists():
            stop_home(home, timeout=timeout)


# --- the cluster --------------------------------------------------------------------------------


class Cluster:
    """Start, stop and observe the nodes of `spec`.

    `app_cmd(info)` gives the command line of node `info`'s ABCI app; None means the network uses
    cometbft's built-in kvstore and no app process is started.
    """

    def __init__(
        self,
        spec: NetworkSpec,
        app_cmd: Callable[[ValidatorInfo], list[str]] | None = None,
        *,
        env: Mapping[str, str] | None = None,
        start_timeout: float = 30.0,
        rpc_timeout: float = 2.0,
    ) -> None:
        if app_cmd is None and not spec.kvstore:
            raise ClusterError("this network expects an ABCI app: pass app_cmd")
        self.spec = spec
        self.app_cmd = app_cmd
        self.env = dict(os.environ if env is None else env)
        self.start_timeout = start_timeout
        self._procs: dict[tuple[int, str], subprocess.Popen] = {}
        self._rpc = {v.index: RpcClient(v.rpc_url, timeout=rpc_timeout) for v in spec.validators}
        self._binary = cometbft_binary()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop every node and release the RPC clients."""
        try:
            self.stop_all()
        finally:
            for rpc in self._rpc.values():
                rpc.close()

    @property
    def validators(self) -> list[ValidatorInfo]:
        return self.spec.validators

    def _indices(self, i: int | Iterable[int] | None) -> list[int]:
        if i is None:
            return [v.index for v in self.spec.validators]
        return [i] if isinstance(i, int) else list(i)

    # processes

    def _spawn(self, info: ValidatorInfo, name: str, cmd: list[str]) -> None:
        log_dir = info.home / "logs"
        log_dir.mkdir(exist_ok=True)
        with open(log_dir / f"{name}.log", "ab") as log:
            log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} starting {cmd}\n".encode())
            log.flush()
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=info.home,
                env=self.env,
                start_new_session=True,
            )
        self._procs[(info.index, name)] = proc
        start = _proc_start_time(proc.pid)
        pids = _read_pids(info.home)
        pids[name] = {"pid": proc.pid, "start": start if start is not None else -1}
        _write_pids(info.home, pids)

    def _wait_port(self, info: ValidatorInfo, port: int, name: str) -> None:
        proc = self._procs[(info.index, name)]
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ClusterError(
                    f"{info.moniker}: {name} exited with {proc.returncode}; "
                    f"see {info.home / 'logs' / (name + '.log')}"
                )
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                return
            time.sleep(POLL)
        raise ClusterError(f"{info.moniker}: {name} did not listen on port {port} in time")

    def running(self, i: int) -> dict[str, bool]:
        pids = _read_pids(self.spec.validators[i].home)
        return {name: name in pids and _alive(pids[name]) for name in ("app", "cometbft")}

    def start(self, i: int | Iterable[int] | None = None) -> None:
        """Start node(s) `i` (default all): the app and wait for its socket, then cometbft."""
        started = []
        for idx in self._indices(i):
            info = self.spec.validators[idx]
            state = self.running(idx)
            if self.app_cmd is not None and not state["app"]:
                self._spawn(info, "app", self.app_cmd(info))
                self._wait_port(info, info.ports.abci, "app")
            if not state["cometbft"]:
                self._spawn(info, "cometbft", [self._binary, "start", "--home", str(info.home)])
                started.append(info)
        for info in started:
            self._wait_port(info, info.ports.rpc, "cometbft")

    def stop(
        self, i: int, sig: int = signal.SIGTERM, part: Part = "all", timeout: float = 10.0
    ) -> None:
        """Stop node `i` (cometbft first, then the app), escalating to SIGKILL after `timeout`."""
        info = self.spec.validators[i]
        pids = _read_pids(info.home)
        for name in ("cometbft", "app"):
            if part not in ("all", name):
                continue
            proc = self._procs.pop((i, name), None)
            if name in pids:
                _stop_entry(pids[name], sig, timeout, proc)
                del pids[name]
            elif proc is not None and proc.poll() is None:  # ours, but its record is gone
                start = _proc_start_time(proc.pid)
                if start is not None:
                    _stop_entry({"pid": proc.pid, "start": start}, sig, timeout, proc)
        _write_pids(info.home, pids)

    def kill(self, i: int, part: Part = "all") -> None:
        self.stop(i, signal.SIGKILL, part)

    def restart(self, i: int) -> None:
        self.stop(i)
        self.start(i)

    def stop_all(self) -> None:
        for v in reversed(self.spec.validators):
            self.stop(v.index)

    # observation

    def rpc(self, i: int) -> RpcClient:
        return self._rpc[i]

    def rpc_url(self, i: int) -> str:
        return self.spec.validators[i].rpc_url

    def status(self, i: int) -> dict[str, Any]:
        """Node `i`'s /status result (raises RpcError when it does not answer)."""
        return self._rpc[i].status()

    def height(self, i: int) -> int | None:
        """Node `i`'s latest committed height, or None when its RPC does not answer."""
        try:
            return self._rpc[i].latest_height()
        except RpcError:
            return None

    def wait_for_height(
        self, h: int, validators: Iterable[int] | None = None, timeout: float = 30.0
    ) -> dict[int, int]:
        """Wait until every listed node (default all) has committed height `h`; their heights."""
        idx = self._indices(validators)
        deadline = time.monotonic() + timeout
        heights: dict[int, int | None] = {}
        while True:
            heights = {i: self.height(i) for i in idx}
            if all(x is not None and x >= h for x in heights.values()):
                return {i: int(x) for i, x in heights.items() if x is not None}
            if time.monotonic() >= deadline:
                seen = ", ".join(
                    f"{self.spec.validators[i].moniker}={'unreachable' if x is None else x}"
                    for i, x in heights.items()
                )
                raise TimeoutError(f"height {h} not reached within {timeout:g}s: {seen}")
            time.sleep(0.1)

    def app_hashes(
        self, height: int, validators: Iterable[int] | None = None, timeout: float = 30.0
    ) -> dict[int, bytes]:
        """Each node's app hash of the state after block `height` (read from header `height`+1)."""
        idx = self._indices(validators)
        self.wait_for_height(height + 1, idx, timeout)
        out = {}
        for i in idx:
            header = self._rpc[i].header(height + 1)
            if integer(header.get("height"), "header.height") != height + 1:
                raise ClusterError(f"{self.spec.validators[i].moniker}: wrong header height")
            out[i] = hexb(header.get("app_hash"), "header.app_hash")
        return out
