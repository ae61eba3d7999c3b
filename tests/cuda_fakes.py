"""Stand-ins for what the CUDA code paths of `model.host_copy` / `model.host_report` receive, so the
CPU can run them: device buffers backed by host memory."""

from __future__ import annotations

import numpy as np


class HostBackedBuffer:
    """A numpy array posing as a device buffer (`__cuda_array_interface__`, shape, dtype)."""

    def __init__(self, array: np.ndarray) -> None:
        self.array, self.shape, self.dtype = array, array.shape, array.dtype
        self.__cuda_array_interface__ = {"data": (array.ctypes.data, False)}
