"""Keeping a training job's parameters in step with the node.

At every sync the job's change since the last sync is one round's update: the node distills it,
exchanges it and answers with what the round changed (its hub's merge, or, the round it joins a
hub, the step to that hub's model). The parameters become *the parameters at the last sync plus
that answer*: the merged update replaces the job's own, as it does in the node's built-in
trainer.
"""

from __future__ import annotations

from typing import Dict, Mapping, MutableMapping, Optional

import numpy as np

from .client import Client, KindredError

__all__ = ["Synchronizer"]


class Synchronizer:
    """Syncs a dict of numpy arrays, updated in place, with a node.

    ``params`` maps each layer name of the node's spec to an array of the layer's shape (any
    float dtype; the arithmetic is float32). Construction checks the names and shapes and takes
    the starting point. :class:`kindred.torch.TorchSync` is the same for a PyTorch module: it
    only reads and writes the parameters differently (:meth:`_read`, :meth:`_write`).

    >>> import numpy as np
    >>> from kindred import Client, Synchronizer
    >>> params = {"w": np.zeros((2, 3), np.float32)}
    >>> sync = Synchronizer(Client("127.0.0.1:7070"), params, check_spec=False)
    >>> sync.last_round is None
    True
    """

    def __init__(
        self,
        client: Client,
        params: MutableMapping,
        *,
        merge_timeout: float = 120.0,
        check_spec: bool = True,
    ):
        self.client = client
        self.params = params
        self.merge_timeout = float(merge_timeout)
        if check_spec:
            client.spec().check(params)
        self._anchor: Dict[str, np.ndarray] = {k: self._read(k) for k in params}
        self.last_round: Optional[int] = None

    def _read(self, name: str) -> np.ndarray:
        """Layer ``name`` as a float32 copy."""
        return np.array(self.params[name], dtype=np.float32, copy=True)

    def _write(self, name: str, value: np.ndarray) -> None:
        """Set layer ``name`` to ``value`` (float32) in place, in the layer's own dtype."""
        target = self.params[name]
        if isinstance(target, np.ndarray) and target.flags.writeable:
            np.copyto(target, value.astype(target.dtype, copy=False))
        else:
            self.params[name] = value

    def update(self) -> Dict[str, np.ndarray]:
        """The change since the last sync, float32 per layer."""
        return {k: self._read(k) - a for k, a in self._anchor.items()}

    def sync(self, samples: int, loss: float = 0.0) -> int:
        """Push the change since the last sync, wait for the round's merged update and apply it:
        every layer becomes its value at the last sync plus the merge, in place. Returns the
        merged round. On an error the parameters are left as they were."""
        self.client.push_update(self.update(), samples=samples, loss=loss)
        round_, merged = self.client.wait_merged(self.last_round, timeout=self.merge_timeout)
        self.apply(merged)
        self.last_round = round_
        return round_

    def apply(self, merged: Mapping[str, np.ndarray]) -> None:
        """Set every layer to its value at the last sync plus ``merged[layer]``, in place, and
        make that the new starting point."""
        missing = [k for k in self._anchor if k not in merged]
        if missing:
            raise KindredError(f"the merged update has no layers {missing}")
        for k, anchor in self._anchor.items():
            self._write(k, anchor + np.asarray(merged[k], dtype=np.float32))
            # The next update is measured from what the layer holds (rounded to its dtype).
            self._anchor[k] = self._read(k)
