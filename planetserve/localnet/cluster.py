"""Running a network built by `planetserve.genesis.network.build_network` on this machine.

Per node the cluster starts the ABCI app (unless the network uses cometbft's built-in kvstore),
waits for its socket, then starts `cometbft start --home <home>`. Each process is recorded in its
home the way `processes` records background processes (`<home>/pids.json`, `<home>/logs/{app,cometbft}.log`),
so `stop_all(root)` can stop a network from another process that only knows the directory.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from planetserve.chain.abci.address import AbciAddress, TcpAddress, listening
from planetserve.chain.rpc import RpcClient, RpcError, hexb, integer
from planetserve.genesis.network import NetworkSpec, ValidatorInfo, cometbft_binary
from planetserve.localnet.processes import (
    PIDS_FILE,
    POLL,
    proc_start_time,
    read_pids,
    spawn,
    stop_entry,
    write_pids,
)
from planetserve.localnet.processes import running as process_running

Part = Literal["all", "app", "cometbft"]


class ClusterError(Exception):
    """A process failed to start or the network did not behave as expected."""


def stop_home(home: Path, part: Part = "all", sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
    """Stop the processes recorded in `home/pids.json` (cometbft first, then the app)."""
    pids = read_pids(home)
    for name in ("cometbft", "app"):
        if part in ("all", name) and name in pids:
            stop_entry(pids[name], sig, timeout)
            del pids[name]
    write_pids(home, pids)


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
        self._procs[(info.index, name)] = spawn(info.home, name, cmd, self.env)

    def _wait_listening(self, info: ValidatorInfo, name: str, address: AbciAddress) -> None:
        proc = self._procs[(info.index, name)]
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ClusterError(
                    f"{info.moniker}: {name} exited with {proc.returncode}; "
                    f"see {info.home / 'logs' / (name + '.log')}"
                )
            if listening(address):
                return
            time.sleep(POLL)
        raise ClusterError(f"{info.moniker}: {name} did not listen at {address} in time")

    def running(self, i: int) -> dict[str, bool]:
        home = self.spec.validators[i].home
        return {name: process_running(home, name) for name in ("app", "cometbft")}

    def start(self, i: int | Iterable[int] | None = None) -> None:
        """Start node(s) `i` (default all): the app and wait for its socket, then cometbft."""
        started = []
        for idx in self._indices(i):
            info = self.spec.validators[idx]
            state = self.running(idx)
            if self.app_cmd is not None and not state["app"]:
                self._spawn(info, "app", self.app_cmd(info))
                self._wait_listening(info, "app", info.abci_address)
            if not state["cometbft"]:
                self._spawn(info, "cometbft", [self._binary, "start", "--home", str(info.home)])
                started.append(info)
        for info in started:
            self._wait_listening(info, "cometbft", TcpAddress("127.0.0.1", info.ports.rpc))

    def stop(
        self, i: int, sig: int = signal.SIGTERM, part: Part = "all", timeout: float = 10.0
    ) -> None:
        """Stop node `i` (cometbft first, then the app), escalating to SIGKILL after `timeout`."""
        info = self.spec.validators[i]
        pids = read_pids(info.home)
        for name in ("cometbft", "app"):
            if part not in ("all", name):
                continue
            proc = self._procs.pop((i, name), None)
            if name in pids:
                stop_entry(pids[name], sig, timeout, proc)
                del pids[name]
            elif proc is not None and proc.poll() is None:  # ours, but its record is gone
                start = proc_start_time(proc.pid)
                if start is not None:
                    stop_entry({"pid": proc.pid, "start": start}, sig, timeout, proc)
        write_pids(info.home, pids)

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
