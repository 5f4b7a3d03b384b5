"""Background processes recorded in their home directory, so that another process that only knows the
directory can tell whether they run and stop them.

Each process runs in its own process group, with its output appended to `<home>/logs/<name>.log`.
Its pid, with its kernel start time (so a recycled pid is never signalled) and the wall-clock second it
was started, is recorded under `name` in `<home>/pids.json`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

PIDS_FILE = "pids.json"
POLL = 0.05


def proc_start_time(pid: int) -> int | None:
    """The kernel start time of `pid` (clock ticks since boot), or None if it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def alive(entry: Mapping[str, int]) -> bool:
    start = proc_start_time(int(entry["pid"]))
    return start is not None and start == int(entry["start"])


def read_object(path: Path) -> dict | None:
    """The JSON object in `path`, None when it is missing, unreadable or holds something else."""
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def read_pids(home: Path) -> dict[str, dict[str, int]]:
    return read_object(home / PIDS_FILE) or {}


def write_pids(home: Path, pids: dict[str, dict[str, int]]) -> None:
    tmp = home / (PIDS_FILE + ".tmp")
    tmp.write_text(json.dumps(pids, indent=2) + "\n")
    tmp.replace(home / PIDS_FILE)


def running(home: Path, name: str) -> bool:
    """Whether the process recorded under `name` in `home` is still that process."""
    entry = read_pids(home).get(name)
    return entry is not None and alive(entry)


def started_at(home: Path, name: str) -> int | None:
    """The wall-clock second the recorded process was started (None: not recorded)."""
    entry = read_pids(home).get(name)
    return int(entry["since"]) if entry is not None and "since" in entry else None


def log_path(home: Path, name: str) -> Path:
    return home / "logs" / f"{name}.log"


def spawn(home: Path, name: str, cmd: list[str], env: Mapping[str, str] | None = None) -> subprocess.Popen:
    """Start `cmd` in its own session, in `home`, its output appended to its log; record its pid."""
    log = log_path(home, name)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        out.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} starting {cmd}\n".encode())
        out.flush()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=home,
                                env=dict(os.environ if env is None else env), start_new_session=True)
    start = proc_start_time(proc.pid)
    pids = read_pids(home)
    pids[name] = {"pid": proc.pid, "start": start if start is not None else -1, "since": int(time.time())}
    write_pids(home, pids)
    return proc


def signal_group(entry: Mapping[str, int], sig: int) -> None:
    """Signal the process group led by the recorded process, if it is still that process."""
    if alive(entry):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(int(entry["pid"]), sig)


def stop_entry(
    entry: Mapping[str, int], sig: int, timeout: float, proc: subprocess.Popen | None = None
) -> None:
    """Send `sig`, wait up to `timeout` for the process to end, then SIGKILL its group."""
    signal_group(entry, sig)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=POLL)
        if not alive(entry):
            break
        if proc is None:
            time.sleep(POLL)
    else:
        signal_group(entry, signal.SIGKILL)
    if proc is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout)


def stop_recorded(
    homes: Iterable[Path], names: Iterable[str] | None = None, sig: int = signal.SIGTERM,
    timeout: float = 10.0,
) -> None:
    """Stop the processes recorded in each of `homes` under `names` (default: all) at once: signal them
    all, wait up to `timeout` for them to end, SIGKILL the groups of those that did not, forget them."""
    wanted = None if names is None else set(names)
    stopping = []
    for home in homes:
        pids = read_pids(home)
        for name, entry in pids.items():
            if wanted is None or name in wanted:
                signal_group(entry, sig)
                stopping.append((home, name, entry))
    deadline = time.monotonic() + timeout
    while any(alive(entry) for _, _, entry in stopping) and time.monotonic() < deadline:
        time.sleep(POLL)
    for home, name, entry in stopping:
        signal_group(entry, signal.SIGKILL)
        pids = read_pids(home)
        pids.pop(name, None)
        write_pids(home, pids)
