"""Side streams for ops that run copies or GEMMs beside the caller's stream, driven by raw handles.

An overlapped op forks work onto side streams and joins it back on every call, so the stream API's host
cost is the op's. Measured on an H200 host (2026-11-23, host µs per call): torch.cuda.current_stream() 3.4,
event.record + stream.wait_event 5.2, torch.cuda.set_stream there and back 4.6, a tensor's copy_ 6.8;
through the driver (cuda-python's cuEventRecord + cuStreamWaitEvent on raw handles) 1.5, torch's C stream
setters there and back 0.8, cuMemcpyDtoDAsync 5.1; cuStreamWriteValue32 of a 4-byte word 1.5 against 4.5 for its
cuMemcpyDtoDAsync (scripts/probe_host.py, 2026-11-23; capturable in a CUDA graph). This module is that cheaper
path; without cuda-python (it comes with torch's CUDA wheels) it falls back to torch's API.

A stream is named by a pair (raw CUstream handle, torch's (stream_id, device_index, device_type)): the
first for the driver, the second for making it torch's current stream.
"""
from __future__ import annotations

import torch

try:
    from cuda.bindings import driver as _driver
    _SUCCESS = _driver.CUresult.CUDA_SUCCESS
except ImportError:
    _driver = None


def _check(result, call: str) -> None:
    if result[0] != _SUCCESS:
        raise RuntimeError(f"weft: {call} failed: {result[0]!r}")


class StreamSet:
    """`count` side streams on a CUDA device and one event for every edge between them and the caller's stream."""

    def __init__(self, device: torch.device, count: int):
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self._streams = [torch.cuda.Stream(device) for _ in range(count)]
        self.sides = [(s.cuda_stream, (s.stream_id, s.device_index, s.device_type)) for s in self._streams]
        self.event = torch.cuda.Event()
        self.event.record()  # created now, so its handle is fixed for the event's life
        self._event = self.event.cuda_event

    def current(self) -> tuple:
        """The caller's current stream."""
        return torch._C._cuda_getCurrentRawStream(self.index), torch._C._cuda_getCurrentStream(self.index)

    def wait(self, waiter: tuple, target: tuple) -> None:
        """Work queued on `waiter` from now on runs after the work queued on `target` so far. One event serves
        every edge: a wait takes the event's state when it is queued, so recording it again later is safe
        (also under CUDA-graph capture, where the pair forks or joins the captured streams)."""
        if _driver is not None:
            _check(_driver.cuEventRecord(self._event, target[0]), "cuEventRecord")
            _check(_driver.cuStreamWaitEvent(waiter[0], self._event, 0), "cuStreamWaitEvent")
        else:
            self.event.record(torch.cuda.ExternalStream(target[0]))
            torch.cuda.ExternalStream(waiter[0]).wait_event(self.event)

    def run_on(self, stream: tuple, main: tuple, fn, *args) -> None:
        """fn(*args) with `stream` torch's current stream, then `main` current again."""
        torch._C._cuda_setStream(*stream[1])
        try:
            fn(*args)
        finally:
            torch._C._cuda_setStream(*main[1])


def device_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) on the current stream; between contiguous CUDA tensors of one dtype and size, one
    cuMemcpyDtoDAsync (peer memory included: a copy-engine transfer over NVLink)."""
    if (_driver is not None and dst.is_cuda and dst.dtype == src.dtype and dst.shape == src.shape
            and dst.is_contiguous() and src.is_contiguous() and src.is_cuda):
        copy_bytes(dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size(), raw_stream(dst.device.index))
    else:
        dst.copy_(src)


def raw_stream(device_index: int) -> int:
    """The current CUDA stream's raw handle."""
    return torch._C._cuda_getCurrentRawStream(device_index)


def copy_bytes(dst: int, src: int, nbytes: int, stream: int) -> None:
    """`nbytes` from device address `src` to `dst` (either may be a peer's: a copy-engine transfer) on `stream`,
    addresses taken by the caller (no tensor checks: the cheapest copy there is)."""
    _check(_driver.cuMemcpyDtoDAsync(dst, src, nbytes, stream), "cuMemcpyDtoDAsync")


def write_word(flag: torch.Tensor, value: int) -> None:
    """flag[0] = value (int32) on the current stream once the work queued before it has completed, with a
    memory fence before the write (cuStreamWriteValue32: a stream memory operation, no kernel, no copy);
    `flag` may be a peer's word (a `heap.peer` view)."""
    if _driver is not None and flag.is_cuda:
        write_word_at(flag.data_ptr(), value, raw_stream(flag.device.index))
    else:
        flag.fill_(value)


def write_word_at(address: int, value: int, stream: int) -> None:
    """write_word to an address the caller took."""
    _check(_driver.cuStreamWriteValue32(stream, address, value, 0), "cuStreamWriteValue32")


def has_driver() -> bool:
    """Whether the driver's API (cuda-python) is here for the raw-address operations above."""
    return _driver is not None
