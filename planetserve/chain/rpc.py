"""A small client for CometBFT's JSON-RPC (HTTP POST), with bounded answers and clear errors.

Nothing an endpoint returns is trusted here: this module only transports and decodes. Verification
of headers, commits and validator sets is `planetserve.chain.lightclient`'s job.

Errors are all `RpcError`s:
- `RpcUnreachable`: connection refused, timeout, HTTP-level failure, answer larger than allowed;
- `RpcResponseError`: the endpoint answered with a JSON-RPC error object (`.code`, `.data`);
- `RpcMalformed`: the answer is not the JSON shape expected (including bad base64/hex/ints).
"""

from __future__ import annotations

import base64
import binascii
import itertools
import re
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from planetserve.registry import codec

DEFAULT_TIMEOUT = 5.0
CALL_DEADLINE_READS = 6
"""A call's whole deadline, in read timeouts."""
DEFAULT_MAX_RESPONSE_BYTES = 32 * 1024 * 1024
MAX_ANSWER_VALUES = 1 << 19
MAX_ANSWER_CONTAINERS = 1 << 17
"""JSON values one answer may decode into: 32 MiB of `[[],[],...]` would otherwise be about 700 MiB
of Python lists. Honest answers (a block's transactions, a validator set, a commit) hold far fewer."""
MAX_VALIDATORS = 10_000
VALIDATORS_PER_PAGE = 100


class RpcError(Exception):
    """Any failure to obtain a well-formed answer from the endpoint."""


class RpcUnreachable(RpcError):
    """The endpoint could not be reached or gave no usable HTTP answer."""


class RpcResponseError(RpcError):
    """The endpoint answered with a JSON-RPC error object."""

    def __init__(self, method: str, code: int, message: str, data: str) -> None:
        super().__init__(f"{method}: JSON-RPC error {code}: {message}" + (f" ({data})" if data else ""))
        self.method = method
        self.code = code
        self.message = message
        self.data = data


class RpcMalformed(RpcError):
    """The answer does not have the expected shape."""


# --- field decoding -----------------------------------------------------------------------------


def b64(value: Any, what: str = "field") -> bytes:
    """Decode a base64 JSON string (None/"" give b"")."""
    if value is None or value == "":
        return b""
    if not isinstance(value, str):
        raise RpcMalformed(f"{what}: expected a base64 string, got {type(value).__name__}")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RpcMalformed(f"{what}: invalid base64") from exc


def hexb(value: Any, what: str = "field") -> bytes:
    """Decode a hex JSON string (None/"" give b"")."""
    if value is None or value == "":
        return b""
    if not isinstance(value, str):
        raise RpcMalformed(f"{what}: expected a hex string, got {type(value).__name__}")
    try:
        return bytes.fromhex(value)
    except ValueError as exc:
        raise RpcMalformed(f"{what}: invalid hex") from exc


INT64 = range(-(1 << 63), 1 << 63)


def integer(value: Any, what: str = "field") -> int:
    """An integer that CometBFT may send as a JSON number or a decimal string, within int64 as all of
    its integers are: `str.isdigit` took "--1" and "²", which `int` then refused with a ValueError no
    caller expected (a lying endpoint ended a relay's list refreshes for good)."""
    if isinstance(value, bool):
        raise RpcMalformed(f"{what}: expected an integer, got a boolean")
    if isinstance(value, str) and re.fullmatch(r"-?[0-9]{1,19}", value):
        value = int(value)
    if isinstance(value, int) and value in INT64:
        return value
    raise RpcMalformed(f"{what}: expected an int64, got {value!r:.40}")


def obj(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise RpcMalformed(f"{what}: expected an object, got {type(value).__name__}")
    return value


# --- decoded answers ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ProofOp:
    type: str
    key: bytes
    data: bytes


@dataclass(frozen=True)
class AbciQuery:
    code: int
    log: str
    info: str
    index: int
    key: bytes
    value: bytes
    proof_ops: list[ProofOp]
    height: int
    codespace: str

    @property
    def ok(self) -> bool:
        return self.code == 0


@dataclass(frozen=True)
class TxOutcome:
    """A CheckTx or ExecTxResult answer."""

    code: int
    data: bytes
    log: str
    info: str = ""
    codespace: str = ""
    gas_wanted: int = 0
    gas_used: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.code == 0

    def attribute(self, event: str, key: str) -> str | None:
        """The value of `key` in the transaction's first event of type `event`, if it has one."""
        for raw in self.events:
            if isinstance(raw, dict) and raw.get("type") == event:
                for attribute in raw.get("attributes") or ():
                    if isinstance(attribute, dict) and attribute.get("key") == key:
                        return str(attribute.get("value"))
        return None


@dataclass(frozen=True)
class BroadcastResult:
    hash: bytes
    code: int
    data: bytes
    log: str
    codespace: str

    @property
    def ok(self) -> bool:
        return self.code == 0


@dataclass(frozen=True)
class TxCommitResult:
    hash: bytes
    height: int
    check_tx: TxOutcome
    tx_result: TxOutcome

    @property
    def ok(self) -> bool:
        return self.check_tx.ok and self.tx_result.ok


@dataclass(frozen=True)
class TxResult:
    hash: bytes
    height: int
    index: int
    tx: bytes
    result: TxOutcome


def _outcome(raw: Any, what: str) -> TxOutcome:
    raw = obj(raw if raw is not None else {}, what)
    events = raw.get("events") or []
    if not isinstance(events, list):
        raise RpcMalformed(f"{what}.events: expected a list")
    return TxOutcome(
        code=integer(raw.get("code", 0), f"{what}.code"),
        data=b64(raw.get("data"), f"{what}.data"),
        log=str(raw.get("log") or ""),
        info=str(raw.get("info") or ""),
        codespace=str(raw.get("codespace") or ""),
        gas_wanted=integer(raw.get("gas_wanted", 0) or 0, f"{what}.gas_wanted"),
        gas_used=integer(raw.get("gas_used", 0) or 0, f"{what}.gas_used"),
        events=events,
    )


# --- the client ---------------------------------------------------------------------------------


class TooLarge(Exception):
    """An HTTP answer longer than its reader accepts."""


class TooSlow(Exception):
    """A streamed answer still coming when its deadline passed."""


def read_limited(response: httpx.Response, limit: int, deadline: float | None = None) -> bytes:
    """The body of a streamed response; TooLarge as soon as it passes `limit` bytes, so that a
    peer cannot make us hold more than that, and TooSlow once the monotonic `deadline` has passed: a
    client's timeout bounds each read, so a peer sending a byte just within it held a call for ever."""
    chunks, size = [], 0
    for chunk in response.iter_bytes():
        size += len(chunk)
        if size > limit:
            raise TooLarge(f"answer larger than {limit} bytes")
        if deadline is not None and time.monotonic() > deadline:
            raise TooSlow("answer still coming at its deadline")
        chunks.append(chunk)
    return b"".join(chunks)


class RpcClient:
    """JSON-RPC over HTTP POST to one CometBFT endpoint, e.g. `RpcClient("http://127.0.0.1:26657")`.

    Height arguments of None mean "latest". Every call is bounded by `timeout` seconds and
    `max_response_bytes`.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
    ) -> None:
        self.url = url.rstrip("/")
        self.max_response_bytes = max_response_bytes
        self.deadline = CALL_DEADLINE_READS * timeout
        """The longest a whole call may take, however its answer trickles in."""
        self._http = httpx.Client(timeout=timeout, trust_env=False)
        self._ids = itertools.count(1)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RpcClient({self.url!r})"

    # transport

    def call(self, method: str, **params: Any) -> Any:
        """Call `method` with the given params (None values left out) and return its `result`."""
        req_id = next(self._ids)
        body = {
            "jsonrpc": "2.0",
            "id": req_id,
            "method": method,
            "params": {k: v for k, v in params.items() if v is not None},
        }
        raw = self._post(method, body)
        try:  # a lying endpoint's few KB of brackets must not escape as a crash (RecursionError)
            answer = codec.json_loads_bounded(raw, MAX_ANSWER_VALUES, MAX_ANSWER_CONTAINERS)
        except codec.LimitExceeded as exc:
            raise RpcMalformed(f"{method}: answer holds {exc}, more than JSON-RPC needs") from None
        except codec.CodecError as exc:
            raise RpcMalformed(f"{method}: answer {exc}") from None
        answer = obj(answer, f"{method} answer")
        err = answer.get("error")
        if err is not None:
            err = obj(err, f"{method} error")
            raise RpcResponseError(
                method,
                integer(err.get("code", 0), "error.code"),
                str(err.get("message", "")),
                str(err.get("data", "") or ""),
            )
        if "result" not in answer:
            raise RpcMalformed(f"{method}: answer has neither result nor error")
        return answer["result"]

    def _post(self, method: str, body: dict[str, Any]) -> bytes:
        deadline = time.monotonic() + self.deadline
        try:
            with self._http.stream("POST", self.url, json=body) as resp:
                try:
                    data = read_limited(resp, self.max_response_bytes, deadline)
                except TooLarge:
                    raise RpcUnreachable(
                        f"{method}: answer from {self.url} exceeds {self.max_response_bytes} bytes"
                    ) from None
                except TooSlow:
                    raise RpcUnreachable(f"{method}: {self.url} took over {self.deadline:g} s to answer") \
                        from None
                if resp.status_code >= 400 and not data.lstrip().startswith(b"{"):
                    raise RpcUnreachable(f"{method}: HTTP {resp.status_code} from {self.url}")
                return data
        except httpx.TimeoutException as exc:
            raise RpcUnreachable(f"{method}: {self.url} timed out") from exc
        except httpx.ConnectError as exc:
            raise RpcUnreachable(f"{method}: {self.url} unreachable: nothing accepts connections there "
                                 "(is the validator's CometBFT RPC listening on it?)") from exc
        except httpx.HTTPError as exc:
            raise RpcUnreachable(f"{method}: {self.url} unreachable: {type(exc).__name__}") from exc

    # info

    def status(self) -> dict[str, Any]:
        return obj(self.call("status"), "status")

    def abci_info(self) -> dict[str, Any]:
        """The application's Info answer: {"data", "version", "last_block_height", ...}."""
        return obj(obj(self.call("abci_info"), "abci_info").get("response"), "abci_info.response")

    def latest_height(self) -> int:
        sync = obj(self.status().get("sync_info"), "status.sync_info")
        return integer(sync.get("latest_block_height"), "latest_block_height")

    def genesis(self) -> dict[str, Any]:
        result = obj(self.call("genesis"), "genesis")
        return obj(result.get("genesis"), "genesis.genesis")

    def commit(self, height: int | None = None) -> dict[str, Any]:
        """The signed header at `height`: {"header": {...}, "commit": {...}} (raw JSON)."""
        result = obj(self.call("commit", height=_h(height)), "commit")
        sh = obj(result.get("signed_header"), "commit.signed_header")
        obj(sh.get("header"), "signed_header.header")
        obj(sh.get("commit"), "signed_header.commit")
        return sh

    def block(self, height: int | None = None) -> dict[str, Any]:
        """{"block_id": {...}, "block": {"header", "data", "evidence", "last_commit"}} (raw JSON)."""
        result = obj(self.call("block", height=_h(height)), "block")
        obj(result.get("block"), "block.block")
        return result

    def block_txs(self, height: int) -> list[bytes]:
        """The transactions of block `height`, in block order."""
        data = obj(obj(self.block(height)["block"], "block.block").get("data"), "block.data")
        txs = data.get("txs") or []
        if not isinstance(txs, list):
            raise RpcMalformed("block.data.txs: expected a list")
        return [b64(tx, "block.data.txs") for tx in txs]

    def block_results(self, height: int) -> list[TxOutcome]:
        """The outcome of each transaction of block `height`, in block order."""
        result = obj(self.call("block_results", height=_h(height)), "block_results")
        txs = result.get("txs_results") or []
        if not isinstance(txs, list):
            raise RpcMalformed("block_results.txs_results: expected a list")
        return [_outcome(tx, "block_results.txs_results") for tx in txs]

    def header(self, height: int | None = None) -> dict[str, Any]:
        result = obj(self.call("header", height=_h(height)), "header")
        return obj(result.get("header"), "header.header")

    def validators(self, height: int | None = None) -> tuple[int, list[dict[str, Any]]]:
        """(height, every validator of the set at that height, all pages, in the endpoint's order)."""
        out: list[dict[str, Any]] = []
        page, total, at = 1, None, height
        while True:
            result = obj(
                self.call(
                    "validators", height=_h(at), page=str(page), per_page=str(VALIDATORS_PER_PAGE)
                ),
                "validators",
            )
            block_height = integer(result.get("block_height"), "validators.block_height")
            if at is None:
                at = block_height
            elif block_height != at:
                raise RpcMalformed(f"validators: asked for height {at}, got {block_height}")
            count = integer(result.get("total"), "validators.total")
            if total is None:
                total = count
                if not 0 <= total <= MAX_VALIDATORS:
                    raise RpcMalformed(f"validators: implausible total {total}")
            elif count != total:
                raise RpcMalformed("validators: total changed between pages")
            vals = result.get("validators")
            if not isinstance(vals, list):
                raise RpcMalformed("validators: expected a list")
            if not vals and len(out) < total:
                raise RpcMalformed("validators: empty page before the total was reached")
            out += [obj(v, "validator") for v in vals]
            if len(out) >= total:
                break
            page += 1
        if len(out) != total:
            raise RpcMalformed(f"validators: got {len(out)} validators, total says {total}")
        return at, out

    # application

    def abci_query(
        self, path: str, data: bytes = b"", height: int = 0, prove: bool = True
    ) -> AbciQuery:
        result = obj(
            self.call("abci_query", path=path, data=data.hex(), height=str(height), prove=prove),
            "abci_query",
        )
        r = obj(result.get("response"), "abci_query.response")
        ops_raw = r.get("proofOps") or r.get("proof_ops") or {}
        ops_list = obj(ops_raw, "proofOps").get("ops") or []
        if not isinstance(ops_list, list):
            raise RpcMalformed("abci_query.proofOps.ops: expected a list")
        ops = [
            ProofOp(
                type=str(obj(o, "proof op").get("type", "")),
                key=b64(o.get("key"), "proof op key"),
                data=b64(o.get("data"), "proof op data"),
            )
            for o in ops_list
        ]
        return AbciQuery(
            code=integer(r.get("code", 0), "query.code"),
            log=str(r.get("log") or ""),
            info=str(r.get("info") or ""),
            index=integer(r.get("index", 0), "query.index"),
            key=b64(r.get("key"), "query.key"),
            value=b64(r.get("value"), "query.value"),
            proof_ops=ops,
            height=integer(r.get("height", 0), "query.height"),
            codespace=str(r.get("codespace") or ""),
        )

    def broadcast_tx_sync(self, tx: bytes) -> BroadcastResult:
        """Submit and wait for CheckTx's answer."""
        return self._broadcast("broadcast_tx_sync", tx)

    def broadcast_tx_async(self, tx: bytes) -> BroadcastResult:
        """Submit without waiting for CheckTx (the code is always 0: refusals are not reported)."""
        return self._broadcast("broadcast_tx_async", tx)

    def _broadcast(self, method: str, tx: bytes) -> BroadcastResult:
        r = obj(self.call(method, tx=base64.b64encode(tx).decode()), "broadcast")
        return BroadcastResult(
            hash=hexb(r.get("hash"), "broadcast.hash"),
            code=integer(r.get("code", 0), "broadcast.code"),
            data=b64(r.get("data"), "broadcast.data"),
            log=str(r.get("log") or ""),
            codespace=str(r.get("codespace") or ""),
        )

    def broadcast_tx_commit(self, tx: bytes) -> TxCommitResult:
        r = obj(self.call("broadcast_tx_commit", tx=base64.b64encode(tx).decode()), "broadcast")
        return TxCommitResult(
            hash=hexb(r.get("hash"), "broadcast.hash"),
            height=integer(r.get("height", 0), "broadcast.height"),
            check_tx=_outcome(r.get("check_tx"), "check_tx"),
            tx_result=_outcome(r.get("tx_result"), "tx_result"),
        )

    def tx(self, tx_hash: bytes) -> TxResult:
        """Look a committed transaction up by its hash (sha256 of the tx bytes)."""
        r = obj(self.call("tx", hash=base64.b64encode(tx_hash).decode(), prove=False), "tx")
        return TxResult(
            hash=hexb(r.get("hash"), "tx.hash"),
            height=integer(r.get("height"), "tx.height"),
            index=integer(r.get("index", 0), "tx.index"),
            tx=b64(r.get("tx"), "tx.tx"),
            result=_outcome(r.get("tx_result"), "tx_result"),
        )


def _h(height: int | None) -> str | None:
    if height is None:
        return None
    if height < 0:
        raise ValueError("height must not be negative")
    return str(height)
