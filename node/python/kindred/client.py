"""The node's local HTTP API, from the training job's side.

Every call has a timeout. A node that is restarting (connection refused or reset, no answer in
time) is retried with exponential backoff before :class:`NodeUnavailable` is raised; a node that
is busy (another upload in progress, the round's update still queued) likewise before
:class:`NodeBusy`. A request the node refuses for what it is (wrong shapes, values out of bounds,
too large) raises :class:`RequestRejected` at once: sending it again would not help.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable, Dict, Mapping, Optional, Tuple

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save


class KindredError(Exception):
    """Base class of every error this package raises."""


class NodeUnavailable(KindredError):
    """The node could not be reached (or did not answer in time) after every retry."""


class NodeBusy(KindredError):
    """The node stayed busy (HTTP 409 or 503) through every retry."""

    def __init__(self, status: int, message: str):
        super().__init__(f"the node is busy (HTTP {status}): {message}")
        self.status = status
        self.message = message


class RequestRejected(KindredError):
    """The node refused the request itself (HTTP 4xx other than 409, or 5xx other than 503)."""

    def __init__(self, status: int, message: str):
        super().__init__(f"the node refused the request (HTTP {status}): {message}")
        self.status = status
        self.message = message


class SpecMismatch(KindredError):
    """Tensors do not match the node's model (a layer missing, extra, or of another shape)."""


class MergeTimeout(KindredError):
    """No merged update for the round arrived before the deadline."""


@dataclass(frozen=True)
class Layer:
    """One layer of the node's model: its name, shape and dtype on the wire."""

    name: str
    shape: Tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        """Elements in the layer."""
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Spec:
    """The node's model, as ``GET /v1/spec`` lists it: what every update must match."""

    model_id: str
    params: int
    layers: Tuple[Layer, ...]

    @classmethod
    def from_json(cls, doc: Mapping) -> "Spec":
        try:
            layers = tuple(
                Layer(str(l["name"]), tuple(int(d) for d in l["shape"]), str(l["dtype"]))
                for l in doc["layers"]
            )
            return cls(str(doc["model_id"]), int(doc["params"]), layers)
        except (KeyError, TypeError, ValueError) as e:
            raise KindredError(f"the node's /v1/spec answer is malformed: {e!r}") from e

    @property
    def names(self) -> Tuple[str, ...]:
        """Layer names in the spec's order."""
        return tuple(l.name for l in self.layers)

    def check(self, tensors: Mapping[str, object]) -> None:
        """Raise :class:`SpecMismatch` unless ``tensors`` has exactly the spec's layers, each of
        the layer's shape (any object with a ``shape`` attribute)."""
        missing = [l.name for l in self.layers if l.name not in tensors]
        extra = [k for k in tensors if k not in set(self.names)]
        if missing or extra:
            raise SpecMismatch(f"layers missing: {missing}, not in the model: {extra}")
        for l in self.layers:
            shape = tuple(getattr(tensors[l.name], "shape", ()))
            if shape != l.shape:
                raise SpecMismatch(f"layer {l.name!r} has shape {shape}, the model's is {l.shape}")


# Failures that mean the node is not there right now (restarting, overloaded): worth a retry.
_TRANSIENT = (
    urllib.error.URLError,
    ConnectionError,
    socket.timeout,
    TimeoutError,
    http.client.HTTPException,
)


class Client:
    """A client of one node's API.

    ``api`` is ``host:port`` (``kindred run --api``). ``timeout`` bounds every HTTP call in
    seconds. A call that cannot reach the node, or finds it busy, is tried ``retries`` more
    times, waiting ``backoff``, then twice that, ... up to ``max_backoff`` seconds between tries.

    >>> client = Client("127.0.0.1:7070", timeout=10)
    >>> client.api
    '127.0.0.1:7070'
    """

    def __init__(
        self,
        api: str = "127.0.0.1:7070",
        *,
        timeout: float = 30.0,
        retries: int = 6,
        backoff: float = 0.25,
        max_backoff: float = 8.0,
        sleep: Callable[[float], None] = time.sleep,
    ):
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        if retries < 0 or backoff < 0 or max_backoff < 0:
            raise ValueError("retries and backoff must not be negative")
        self.api = (api[len("http://") :] if api.startswith("http://") else api).rstrip("/")
        self.timeout = float(timeout)
        self.retries = int(retries)
        self.backoff = float(backoff)
        self.max_backoff = float(max_backoff)
        self._sleep = sleep
        self._spec: Optional[Spec] = None

    # -- API calls ---------------------------------------------------------------------------

    def spec(self, refresh: bool = False) -> Spec:
        """The node's model (cached after the first call unless ``refresh``)."""
        if self._spec is None or refresh:
            _, body, _ = self._call("GET", "/v1/spec")
            try:
                doc = json.loads(body)
            except ValueError as e:
                raise KindredError(f"the node's /v1/spec answer is not JSON: {e}") from e
            self._spec = Spec.from_json(doc)
        return self._spec

    def status(self) -> dict:
        """The node's status document (``GET /v1/status``)."""
        _, body, _ = self._call("GET", "/v1/status")
        try:
            return json.loads(body)
        except ValueError as e:
            raise KindredError(f"the node's /v1/status answer is not JSON: {e}") from e

    def push_update(self, update: Mapping[str, np.ndarray], samples: int, loss: float = 0.0) -> None:
        """Send one round's update: one array per layer (cast to float32), the number of
        samples it was trained on and the mean training loss. Returns once the node queued it.

        Raises :class:`SpecMismatch` before sending anything that cannot match the model."""
        if not 1 <= int(samples) <= 2**32:
            raise ValueError(f"samples must be in 1..=2^32, got {samples}")
        loss = float(loss)
        if not np.isfinite(loss):
            raise ValueError(f"loss must be finite, got {loss}")
        spec = self.spec()
        spec.check(update)
        tensors = {
            name: np.ascontiguousarray(np.asarray(update[name], dtype=np.float32))
            for name in spec.names
        }
        for name, t in tensors.items():
            if not np.all(np.isfinite(t)):
                raise ValueError(f"layer {name!r} of the update holds NaN or infinity")
        body = st_save(tensors)
        path = f"/v1/update?samples={int(samples)}&loss={loss!r}"
        self._call("POST", path, body=body, expect=(202,), already_done=_already_queued)

    def merged(self, after: Optional[int] = None) -> Optional[Tuple[int, Dict[str, np.ndarray]]]:
        """The newest merged update of a round after ``after`` (any round when ``None``):
        ``(round, {layer: float32 array})``, or ``None`` while there is none."""
        path = "/v1/merged" if after is None else f"/v1/merged?after={int(after)}"
        status, body, headers = self._call("GET", path, expect=(200, 204))
        if status == 204:
            return None
        try:
            round_ = int(headers.get("x-kindred-round", ""))
        except ValueError as e:
            raise KindredError("the merged update carries no round (x-kindred-round)") from e
        try:
            tensors = st_load(body)
        except Exception as e:  # safetensors raises its own error types
            raise KindredError(f"the merged update is not valid safetensors: {e}") from e
        self.spec().check(tensors)
        return round_, tensors

    def wait_merged(
        self, after: Optional[int] = None, timeout: float = 120.0, poll: float = 0.2
    ) -> Tuple[int, Dict[str, np.ndarray]]:
        """Poll :meth:`merged` until an update of a round after ``after`` arrives; raise
        :class:`MergeTimeout` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.merged(after)
            if got is not None:
                return got
            if time.monotonic() >= deadline:
                raise MergeTimeout(
                    f"no merged update after round {after} within {timeout:.0f} s"
                )
            self._sleep(poll)

    # -- transport ---------------------------------------------------------------------------

    def _call(
        self,
        method: str,
        path: str,
        body: Optional[bytes] = None,
        expect: Tuple[int, ...] = (200,),
        already_done: Optional[Callable[[int, str], bool]] = None,
    ) -> Tuple[int, bytes, Dict[str, str]]:
        """One API call with retries. ``already_done(status, message)`` tells whether a busy
        answer after a lost attempt means the request itself went through."""
        url = f"http://{self.api}{path}"
        lost_attempt = False
        last: Optional[BaseException] = None
        busy: Optional[Tuple[int, str]] = None
        for attempt in range(self.retries + 1):
            if attempt:
                self._sleep(min(self.backoff * 2 ** (attempt - 1), self.max_backoff))
            req = urllib.request.Request(url, data=body, method=method)
            if body is not None:
                req.add_header("Content-Type", "application/octet-stream")
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    status = resp.status
                    data = resp.read()
                    headers = {k.lower(): v for k, v in resp.headers.items()}
            except urllib.error.HTTPError as e:
                message = _text(e.read())
                if e.code in (409, 503):
                    if lost_attempt and already_done is not None and already_done(e.code, message):
                        return 202, b"", {}
                    busy = (e.code, message)
                    continue
                raise RequestRejected(e.code, message) from None
            except _TRANSIENT as e:
                last = e
                lost_attempt = lost_attempt or body is not None
                continue
            if status not in expect:
                raise RequestRejected(status, _text(data))
            return status, data, headers
        if busy is not None and last is None:
            raise NodeBusy(*busy)
        raise NodeUnavailable(
            f"no answer from the node at {self.api} after {self.retries + 1} tries: {last!r}"
        )


def _already_queued(status: int, message: str) -> bool:
    # The node answers this when a round's update is queued: after an upload whose answer was
    # lost, it is ours.
    return status == 503 and "already queued" in message


def _text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace").strip()[:500]
