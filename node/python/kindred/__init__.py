"""Python client for a Kindred node.

A Kindred node distills, routes and merges model updates; a training job on the same host trains.
This package is the job's side of the node's local HTTP API:

- :class:`Client` talks to the API (``/v1/spec``, ``/v1/update``, ``/v1/merged``, ``/v1/status``),
  with a timeout on every call and retries with backoff while the node restarts;
- :class:`Synchronizer` keeps a dict of numpy arrays in step with the node: every sync it pushes
  ``params - params at the last sync`` and applies the merged update in place;
- :class:`kindred.torch.TorchSync` does the same for a ``torch.nn.Module`` every N steps,
  preserving each parameter's dtype (float32, float16, bfloat16) and device (needs torch).

Errors are typed (:class:`KindredError` and its subclasses).

Example::

    from kindred import Client, Synchronizer

    client = Client("127.0.0.1:7070")
    sync = Synchronizer(client, params)      # params: {layer name: np.ndarray}, as /v1/spec lists
    for step in range(steps):
        train_step(params)
        if (step + 1) % 50 == 0:
            sync.sync(samples=50 * batch, loss=loss)
"""

from .client import (
    Client,
    KindredError,
    Layer,
    MergeTimeout,
    NodeBusy,
    NodeUnavailable,
    RequestRejected,
    Spec,
    SpecMismatch,
)
from .sync import Synchronizer

__all__ = [
    "Client",
    "KindredError",
    "Layer",
    "MergeTimeout",
    "NodeBusy",
    "NodeUnavailable",
    "RequestRejected",
    "Spec",
    "SpecMismatch",
    "Synchronizer",
]
__version__ = "0.1.0"
