"""Faults in a real model's forward, for tests of how an engine survives them."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch
from transformers import PreTrainedModel


class Fault:
    """Makes the real model's forward raise (or wait) for chosen inputs, through a hook on its
    embedding (or on `module`, one of its layers: the layers before it have run, and written their KV):
    the engine under test runs unchanged, its model fails as a device can."""

    def __init__(self, model: PreTrainedModel, raises: Callable[[torch.Tensor], bool],
                 module: torch.nn.Module | None = None) -> None:
        self.raises = raises
        self.gate = threading.Event()
        self.gate.set()
        hooked = model.get_input_embeddings() if module is None else module
        self.handle = hooked.register_forward_pre_hook(self._hook)

    def _hook(self, module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        self.gate.wait(30)
        if self.raises(args[0]):
            raise RuntimeError("injected device fault")

    def remove(self) -> None:
        self.gate.set()
        self.handle.remove()


@contextlib.contextmanager
def fault(model: PreTrainedModel, raises: Callable[[torch.Tensor], bool],
          module: torch.nn.Module | None = None) -> Iterator[Fault]:
    injected = Fault(model, raises, module)
    try:
        yield injected
    finally:
        injected.remove()
