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
    the starting point.

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
        params: MutableMapping[str, np.ndarray],
        *,
        merge_timeout: float = 120.0,
        check_spec: bool = True,
    ):
        self.client = client
        self.params = params
        self.merge_timeout = float(merge_timeout)
        if check_spec:
            client.spec().check(params)
        self._anchor: Dict[str, np.ndarray] = {
            k: np.array(v, dtype=np.float32, copy=True) for k, v in params.items()
        }
        self.last_round: Optional[int] = None

    def update(self) -> Dict[str, np.ndarray]:
        """The change since the last sync, float32 per layer."""
        return {k: np.asarray(self.params[k], dtype=np.float32) - a for k, a in self._anchor.items()}

    def sync(self, samples: int, loss: float = 0.0) -> int:
        """Push the change since the last sync, wait for the round's merged update and apply it:
        every array becomes its value at the last sync plus the merge, in place. Returns the
        merged round. On an error the parameters are left as they were."""
        self.client.push_update(self.update(), samples=samples, loss=loss)
        round_, merged = self.client.wait_merged(self.last_round, timeout=self.merge_timeout)
        self.apply(merged)
        self.last_round = round_
        return round_

    def apply(self, merged: Mapping[str, np.ndarray]) -> None:
        """Set every array to its value at the last sync plus ``merged[layer]``, in place, and
        make that the new starting point."""
        for k, anchor in self._anchor.items():
            if k not in merged:
                raise KindredError(f"the merged update has no layer {k!r}")
            new = anchor + np.asarray(merged[k], dtype=np.float32)
            target = self.params[k]
            if isinstance(target, np.ndarray) and target.flags.writeable:
                np.copyto(target, new.astype(target.dtype, copy=False))
            else:
                self.params[k] = target = new
            # The next update is measured from what the array holds (rounded to its dtype).
            self._anchor[k] = np.array(target, dtype=np.float32, copy=True)
