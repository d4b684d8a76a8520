"""Syncing a PyTorch model with a node every N optimizer steps (needs torch).

Each parameter keeps its dtype (float32, float16, bfloat16) and device; the arithmetic of a sync
(the change since the last sync, the merged update added to the parameters at the last sync) is
float32 on the CPU, where the node's updates are float32 safetensors.
"""

from __future__ import annotations

from typing import Dict, Iterable, Mapping, Optional, Tuple

import numpy as np
import torch

from .client import Client, KindredError
from .sync import Synchronizer

__all__ = ["TorchSync"]


class TorchSync(Synchronizer):
    """Keeps a module's parameters in step with a node.

    Call :meth:`step` after every optimizer step with the batch's samples and loss; every
    ``every`` steps it pushes ``params - params at the last sync`` (one round's update) and
    replaces it, in place, by the round's merged update (:meth:`Synchronizer.sync`). ``names``
    maps the node's layer names to the module's parameter names where they differ (default:
    the same names).

    Example::

        from kindred import Client
        from kindred.torch import TorchSync

        sync = TorchSync(model, Client("127.0.0.1:7070"), every=50)
        for x, y in loader:
            loss = loss_fn(model(x), y)
            opt.zero_grad(); loss.backward(); opt.step()
            sync.step(samples=len(x), loss=loss.item())
    """

    def __init__(
        self,
        module: torch.nn.Module,
        client: Client,
        every: int,
        *,
        names: Optional[Mapping[str, str]] = None,
        merge_timeout: float = 120.0,
    ):
        if every < 1:
            raise ValueError("every must be at least 1")
        self.every = int(every)
        by_name = dict(module.named_parameters())
        names = dict(names or {})
        params: Dict[str, torch.nn.Parameter] = {}
        for layer in client.spec().layers:
            pname = names.get(layer.name, layer.name)
            if pname not in by_name:
                raise KindredError(
                    f"the node's layer {layer.name!r} has no parameter {pname!r} in the module"
                )
            p = by_name[pname]
            if tuple(p.shape) != layer.shape:
                raise KindredError(
                    f"parameter {pname!r} has shape {tuple(p.shape)}, the node's layer "
                    f"{layer.name!r} {layer.shape}"
                )
            if not p.dtype.is_floating_point:
                raise KindredError(f"parameter {pname!r} is {p.dtype}, not floating point")
            params[layer.name] = p
        super().__init__(client, params, merge_timeout=merge_timeout, check_spec=False)
        self._steps = 0
        self._samples = 0
        self._loss_sum = 0.0

    def _read(self, name: str) -> np.ndarray:
        p = self.params[name]
        return p.detach().to(device="cpu", dtype=torch.float32).numpy().copy()

    @torch.no_grad()
    def _write(self, name: str, value: np.ndarray) -> None:
        p = self.params[name]
        p.copy_(torch.from_numpy(value).to(device=p.device, dtype=p.dtype))

    def step(self, samples: int, loss: float = 0.0) -> Optional[int]:
        """Count one optimizer step; every ``every`` steps, sync. Returns the merged round when
        this step synced, else ``None``."""
        self._steps += 1
        self._samples += int(samples)
        self._loss_sum += float(loss)
        if self._steps % self.every:
            return None
        mean_loss = self._loss_sum / self.every
        samples, self._samples, self._loss_sum = self._samples, 0, 0.0
        return self.sync(samples=max(samples, 1), loss=mean_loss)

    def parameters(self) -> Iterable[Tuple[str, torch.nn.Parameter]]:
        """The synced parameters by the node's layer names."""
        return self.params.items()
