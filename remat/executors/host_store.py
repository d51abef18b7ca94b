"""Where offloaded values wait for the backward: host memory outside PyTorch's allocator.

On a CPU device the host store is numpy memory, which neither PyTorch's allocator nor remat's
meters count: a test then measures the device bytes a GPU would hold, and the store's own
counter measures the host bytes (on a CPU both are one memory, so offload saves nothing real
there; plans say so). Each copy runs inline, which the ``cpu`` profile's link models
(:data:`remat.measure.profiles.CPU_HOST_STORE`: synchronous).

A copy takes the value's whole storage and its view of it (offset, sizes, strides), so the
tensor the backward gets back is bitwise the one the forward made, in the same layout.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Stored:
    """One offloaded value while it is in host memory."""

    data: np.ndarray
    dtype: torch.dtype
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    device: torch.device

    @classmethod
    def of(cls, value: torch.Tensor, data: np.ndarray) -> Stored:
        """``value``'s storage as ``data``, with its view of it (dtype, offset, layout)."""
        return cls(
            data,
            value.dtype,
            int(value.storage_offset()),
            tuple(value.shape),
            tuple(value.stride()),
            value.device,
        )


_STORES: weakref.WeakValueDictionary[int, HostStore] = weakref.WeakValueDictionary()
_IDS = itertools.count()


class HostStore:
    """Offloaded values of one step and the host bytes they take. Graphs name a store by its
    :attr:`key` (:func:`offload_value`, :func:`wait_offload`, :func:`fetch_value`): FX's code
    generator writes a call's constant arguments into the code, which an int survives."""

    def __init__(self) -> None:
        self.live_bytes = 0
        self.peak_bytes = 0
        self.key = next(_IDS)
        _STORES[self.key] = self

    def offload(self, value: torch.Tensor) -> Stored:
        """Copy ``value``'s storage to host memory (its copy-out); the device copy is freed
        once the graph drops its last reference, after the wait the plan placed."""
        if value.device.type != "cpu":
            raise NotImplementedError(
                f"offload from a {value.device.type} device: only a CPU device's host store "
                "exists so far"
            )
        raw = torch.empty(0, dtype=torch.uint8).set_(value.untyped_storage())
        data = raw.numpy().copy()  # numpy's memory, outside PyTorch's allocator
        self.live_bytes += data.nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return Stored.of(value, data)

    def wait(self, stored: Stored, value: torch.Tensor) -> None:
        """The copy-out's wait: inline on a CPU device, so done; it reads ``value`` so that
        the graph frees the device copy right after it."""

    def fetch(self, stored: Stored) -> torch.Tensor:
        """Copy ``stored`` back to a new device storage (the prefetch) and free the host copy."""
        storage = torch.empty(stored.data.nbytes, dtype=torch.uint8, device=stored.device)
        storage.copy_(torch.from_numpy(stored.data))
        self.live_bytes -= stored.data.nbytes
        stored.data = np.empty(0, dtype=np.uint8)
        out = torch.empty(0, dtype=stored.dtype, device=stored.device)
        return out.set_(storage.untyped_storage(), stored.offset, stored.shape, stored.stride)


def offload_value(store: int, value: torch.Tensor) -> Stored:
    """The graph op that starts ``value``'s copy-out into store ``store``."""
    return _STORES[store].offload(value)


def wait_offload(store: int, stored: Stored, value: torch.Tensor) -> None:
    """The graph op that waits on a copy-out; the device copy is freed right after it."""
    _STORES[store].wait(stored, value)


def fetch_value(store: int, stored: Stored) -> torch.Tensor:
    """The graph op that copies an offloaded value back to the device."""
    return _STORES[store].fetch(stored)


__all__ = ["HostStore", "Stored", "fetch_value", "offload_value", "wait_offload"]
