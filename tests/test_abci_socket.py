"""Where the ABCI app listens, and who can reach it there: addresses read in one place, a Unix socket
in a directory only the validator's user may enter, and a real unprivileged local process that drives
an app on TCP loopback but cannot reach one on its socket (docs/threat-model.md)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import stat
import subprocess
import threading
import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from harness import AppHarness, sqlite_url
from nobody import NOBODY, as_nobody, as_root, shared_directory
from tendermint.abci import types_pb2 as abci

from planetserve.chain.abci.address import (
    MAX_SOCKET_PATH,
    AbciAddress,
    AbciAddressError,
    TcpAddress,
    UnixAddress,
    connect,
    listening,
    parse_abci_address,
)
from planetserve.chain.abci.server import AbciServer, frame, parse_uvarint
from planetserve.cli import main
from planetserve.genesis.network import free_ports
from planetserve.localnet.net import app_command

FLUSH = frame(abci.Request(flush=abci.RequestFlush()))
GARBAGE_GENESIS = frame(abci.Request(init_chain=abci.RequestInitChain(chain_id="x", app_state_bytes=b"garbage")))


# --- the address ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "address", "proxy_app"), [
    ("127.0.0.1:26658", TcpAddress("127.0.0.1", 26658), "tcp://127.0.0.1:26658"),
    ("[::1]:1", TcpAddress("::1", 1), "tcp://[::1]:1"),
    ("unix:///srv/ps/abci/app.sock", UnixAddress(Path("/srv/ps/abci/app.sock")), "unix:///srv/ps/abci/app.sock"),
    ("unix:///" + "a" * (MAX_SOCKET_PATH - 1), UnixAddress(Path("/" + "a" * (MAX_SOCKET_PATH - 1))),
     "unix:///" + "a" * (MAX_SOCKET_PATH - 1)),  # the longest path a socket takes
])
def test_an_address_reads_as_the_server_binds_it_and_cometbft_dials_it(text: str, address: AbciAddress,
                                                                        proxy_app: str) -> None:
    parsed = parse_abci_address(text)
    assert parsed == address and str(parsed) == text and parsed.proxy_app == proxy_app


@pytest.mark.parametrize(("text", "message"), [
    *[(bad, "is neither HOST:PORT nor unix:///ABSOLUTE/PATH") for bad in (
        "", "26658", ":26658", "127.0.0.1", "127.0.0.1:0", "127.0.0.1:65536", "127.0.0.1:２６６５８", "::1:26658",
        "tcp://127.0.0.1:26658", "my host:1")],
    *[(bad, "a socket needs an absolute file path") for bad in ("unix://", "unix://app.sock", "unix:///srv/ps/")],
    ("unix:///" + "a" * MAX_SOCKET_PATH, f"is {MAX_SOCKET_PATH + 1} bytes, more than the {MAX_SOCKET_PATH} a Unix "
                                         "socket's address holds: use a shorter home, or HOST:PORT"),
    ("unix:///" + "é" * 50, "is 101 bytes"),  # bytes count, not characters
])
def test_a_malformed_address_is_refused_saying_why(text: str, message: str) -> None:
    with pytest.raises(AbciAddressError, match=re.escape(message)):
        parse_abci_address(text)


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    with shared_directory("ps-abci-") as path:
        yield path


def chain_init(home: Path, tmp_path: Path, *args: str) -> tuple[int, str]:
    genesis = tmp_path / "genesis.json"
    genesis.write_text('{"chain_id": "socket-test"}')
    result = CliRunner().invoke(main, [
        "chain", "init", "--home", str(home), "--genesis", str(genesis), "--moniker", "v5",
        "--peer", "0123456789abcdef0123456789abcdef01234567@127.0.0.1:26656", *args], catch_exceptions=False)
    return result.exit_code, " ".join(result.output.split())


@pytest.mark.parametrize(("args", "message"), [
    (["--abci", "unix://relative.sock"], "a socket needs an absolute file path"),
    (["--abci", "unix:///" + "a" * 200], "a Unix socket's address holds: use a shorter home, or HOST:PORT"),
    (["--abci", "localhost"], "is neither HOST:PORT nor unix:///ABSOLUTE/PATH"),
])
def test_chain_init_refuses_a_malformed_abci_address_before_writing_anything(tmp_path: Path, args: list[str],
                                                                             message: str) -> None:
    code, out = chain_init(tmp_path / "home", tmp_path, *args)
    assert code == 2 and message in out
    assert not (tmp_path / "home").exists()


def test_chain_init_puts_the_app_on_a_private_socket_unless_told_or_the_path_is_too_long(
        tmp_path: Path, shared_dir: Path) -> None:
    def made(home: Path, *args: str) -> tuple[str, str, str]:
        code, out = chain_init(home, tmp_path, *args)
        assert code == 0, out
        proxy_app = tomllib.loads((home / "config" / "config.toml").read_text())["proxy_app"]
        return json.loads((home / "config" / "planetserve.json").read_text())["abci_listen"], proxy_app, out

    home = shared_dir / "short"
    private = f"unix://{home}/abci/app.sock"
    listen, proxy_app, out = made(home)
    assert listen == proxy_app == private
    assert f"its app listens on {private}: only this user can connect to it" in out
    assert made(tmp_path / "tcp", "--abci", "127.0.0.1:36658")[:2] == ("127.0.0.1:36658", "tcp://127.0.0.1:36658")
    listen, proxy_app, out = made(tmp_path / ("h" * MAX_SOCKET_PATH))
    assert (listen, proxy_app) == ("127.0.0.1:26658", "tcp://127.0.0.1:26658")
    assert ("its app listens on 127.0.0.1:26658 (the home's path is too long for a Unix socket): on TCP any "
            "local process can drive it") in out


# --- the server -----------------------------------------------------------------------------------


@contextlib.contextmanager
def serving(tmp_path: Path, address: AbciAddress) -> Iterator[AppHarness]:
    """An AbciServer at `address` on a thread, over an in-process application at height 1."""
    harness = AppHarness(sqlite_url(tmp_path))
    harness.block()
    server = AbciServer(harness.app)
    ready = threading.Event()
    thread = threading.Thread(target=asyncio.run, daemon=True, args=(server.serve(
        address, handle_signals=False, ready=lambda _bound: ready.set()),))
    thread.start()
    try:
        assert ready.wait(10)
        yield harness
    finally:
        server.stop()
        thread.join(10)


def refusal(tmp_path: Path, address: AbciAddress) -> str:
    """Why the server would not listen at `address`."""
    with pytest.raises(AbciAddressError) as refused:
        asyncio.run(AbciServer(AppHarness(sqlite_url(tmp_path)).app).serve(address, handle_signals=False))
    return str(refused.value)


def info_height(address: AbciAddress) -> int:
    """The app's committed height, asked at `address` as CometBFT asks."""
    with connect(address, 10) as sock:
        sock.sendall(frame(abci.Request(info=abci.RequestInfo())) + FLUSH)
        data = b""
        while (head := parse_uvarint(data, 0)) is None or len(data) < head[0] + head[1]:
            chunk = sock.recv(1 << 16)
            assert chunk, "the app closed the connection"
            data += chunk
        size, start = head
        return abci.Response.FromString(data[start : start + size]).info.last_block_height


def test_the_server_refuses_a_socket_directory_that_group_or_others_can_enter(tmp_path: Path) -> None:
    directory = tmp_path / "abci"
    address = UnixAddress(directory / "app.sock")
    for mode in (0o750, 0o701, 0o777):
        directory.mkdir(mode=0o700, exist_ok=True)
        directory.chmod(mode)
        assert refusal(tmp_path, address) == (f"the socket directory {directory} has mode {mode:04o}: group and "
                                              f"others could reach the app; run `chmod 700 {directory}`")
        assert not address.path.exists()


@as_root
def test_the_server_refuses_a_socket_directory_owned_by_another_user(tmp_path: Path) -> None:
    directory = tmp_path / "abci"
    directory.mkdir(mode=0o700)
    os.chown(directory, NOBODY, NOBODY)
    assert refusal(tmp_path, UnixAddress(directory / "app.sock")) == (
        f"the socket directory {directory} is owned by uid {NOBODY}, not by this user (uid 0): its owner could "
        "reach the app; use a directory of your own")


def test_a_stale_socket_is_replaced_a_live_one_or_another_file_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "abci"
    address = UnixAddress(directory / "app.sock")
    directory.mkdir(mode=0o700)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as gone:
        gone.bind(str(address.path))
    assert stat.S_ISSOCK(address.path.lstat().st_mode) and not listening(address)  # left by a run that is gone
    with serving(tmp_path / "one", address):
        assert info_height(address) == 1
        assert stat.S_IMODE(address.path.stat().st_mode) == 0o600
        assert refusal(tmp_path / "two", address) == (f"something already serves at {address.path}: is this "
                                                      "validator's app running already?")
        assert info_height(address) == 1  # the first app still serves
    address.path.unlink()
    address.path.write_text("not a socket")
    assert refusal(tmp_path / "three", address) == (f"{address.path} exists and is not a socket: remove it, or "
                                                    "listen elsewhere")
    assert address.path.read_text() == "not a socket"


def test_the_server_makes_a_missing_socket_directory_private(tmp_path: Path) -> None:
    address = UnixAddress(tmp_path / "abci" / "app.sock")
    with serving(tmp_path, address):
        assert stat.S_IMODE(address.path.parent.stat().st_mode) == 0o700
        assert stat.S_IMODE(address.path.stat().st_mode) == 0o600
        assert info_height(address) == 1


# --- an unprivileged local process against a real app ---------------------------------------------


def init_chain_of_garbage(address: AbciAddress) -> Callable[[], str]:
    """The adversary: connect to the app as CometBFT would and send an InitChain of garbage, which stops it."""

    def attempt() -> str:
        assert (os.getuid(), os.getgid(), os.getgroups()) == (NOBODY, NOBODY, [])
        try:
            sock = connect(address, 5)
        except PermissionError:
            return "denied"
        with sock:
            sock.sendall(GARBAGE_GENESIS + FLUSH)
            try:
                answered = sock.recv(1) != b""
            except ConnectionResetError:  # closed with the flush still unread
                answered = False
            return "sent; the app answered" if answered else "sent; the app closed the connection"

    return attempt


@contextlib.contextmanager
def app_process(home: Path, listen: str) -> Iterator[subprocess.Popen]:
    """`planetserve chain app` of a fresh home whose app listens at `listen`, once it accepts connections."""
    (home / "config").mkdir(parents=True)
    (home / "data").mkdir()
    home.chmod(0o755)  # others may look in: only the socket's own directory is closed to them
    (home / "config" / "planetserve.json").write_text(json.dumps(
        {"abci_listen": listen, "db": f"sqlite:///{home}/data/planetserve.db", "chain_id": "socket-test"}))
    proc = subprocess.Popen(app_command(home), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not listening(parse_abci_address(listen)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.1)
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.communicate(timeout=30)


@as_root
def test_an_unprivileged_process_drives_an_app_listening_on_tcp(shared_dir: Path) -> None:
    """The attack the socket closes: on loopback TCP, nobody's InitChain of garbage stops the app."""
    address = TcpAddress("127.0.0.1", free_ports(1)[0])
    with app_process(shared_dir / "home", str(address)) as app:
        assert as_nobody(init_chain_of_garbage(address)) == "sent; the app closed the connection"
        out, _ = app.communicate(timeout=30)
        assert app.returncode == 1 and "stopped after a fatal error" in out


@as_root
def test_an_unprivileged_process_cannot_reach_an_app_on_its_socket(shared_dir: Path) -> None:
    """The same process, against an app on its default socket: denied by the file system, and the app
    saw nothing (it serves on, at height 0). With the socket directory opened to others, as TCP is, the
    same process stops it: the directory's mode is what kept it out."""
    home = shared_dir / "home"
    address = UnixAddress(home / "abci" / "app.sock")
    with app_process(home, str(address)) as app:
        assert as_nobody(lambda: str(sorted(os.listdir(home)))) == "['abci', 'config', 'data']"
        assert as_nobody(init_chain_of_garbage(address)) == "denied"
        assert app.poll() is None and info_height(address) == 0
        address.path.parent.chmod(0o755)
        address.path.chmod(0o666)
        assert as_nobody(init_chain_of_garbage(address)) == "sent; the app closed the connection"
        out, _ = app.communicate(timeout=30)
        assert app.returncode == 1 and "stopped after a fatal error" in out
