"""Where the recurrent states of one or many sequences lie, and how a launch binds them.

Shared by every runner and slot pool: the layout of state buffers (:class:`StateLayout`), the two buffers a launch
reads and writes (:class:`StateBuffers`), and the check of a graph's or plan's inputs and outputs against the I/O
contract (:func:`check_io`). Letters as in :mod:`mambatrt.config` (L layers, E inner width, K conv, N state).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from mambatrt.contract import CONV_STATE, SSM_STATE, GraphContract
from mambatrt.errors import BundleError


class StateLayout:
    """Where the states of several sequences lie, one buffer per kind of state, and how a launch binds them.

    Stacked graphs (the portable graphs, and every graph of bundle schemas 1-3) take a kind as one tensor
    [B, L, E, ..]: the buffer is [rows, L, E, ..] and a launch over rows start..start+k-1 binds one block. Layered
    graphs (the kernels graphs) take L tensors [B, E, ..]: the buffer is layer-major, [L, rows, E, ..], and a launch
    binds L blocks, one per layer, so the graph splits and joins nothing. One sequence's state is then L pieces of
    one layer each, ``pitch`` bytes apart: device copies are 2-D copies, host copies numpy views (:meth:`rows`). A
    buffer of one row is the same memory in both layouts: a sequence's [L, E, ..].
    """

    def __init__(self, contract: GraphContract, config) -> None:
        self.io = contract.state_io  # (input, output, kind, layer)
        self.layered = contract.layered
        self.batched = contract.max_batch is not None
        self.layers = config.n_layer
        self.shapes = {CONV_STATE: config.conv_state_shape, SSM_STATE: config.ssm_state_shape}  # [L, E, ..] each
        self.row_bytes = {kind: 4 * int(np.prod(shape)) for kind, shape in self.shapes.items()}
        # the bytes one step of :meth:`offset` moves: a layer's row (layered) or a sequence's row (stacked)
        self.step = {kind: b // self.layers if self.layered else b for kind, b in self.row_bytes.items()}

    def buffer_shape(self, kind: str, rows: int) -> tuple[int, ...]:
        """The shape of a buffer of ``rows`` sequences' states of ``kind``."""
        shape = self.shapes[kind]
        return (shape[0], rows, *shape[1:]) if self.layered else (rows, *shape)

    def rows(self, array: np.ndarray, start: int, stop: int | None = None) -> np.ndarray:
        """View of row ``start`` of a host buffer ([L, E, ..]), or of rows start..stop-1 in the buffer's layout."""
        index = start if stop is None else slice(start, stop)
        return array[:, index] if self.layered else array[index]

    def binds(self, capacity: int, start: int, k: int) -> list[tuple[str, str, str, tuple[int, ...], int]]:
        """(input, output, kind, shape, byte offset) of each state tensor of a launch over rows start..start+k-1 of
        buffers of ``capacity`` rows: the offset from the buffer's start, of the input's and the output's buffer
        alike."""
        out = []
        for name, out_name, kind, layer in self.io:
            shape = self.shapes[kind]
            if layer is None:  # schema 1 has no batch axis (one sequence)
                out.append((name, out_name, kind, ((k,) if self.batched else ()) + shape, start * self.step[kind]))
            else:
                out.append((name, out_name, kind, (k, *shape[1:]), (layer * capacity + start) * self.step[kind]))
        return out

    def feed(self, conv: np.ndarray, ssm: np.ndarray) -> dict[str, np.ndarray]:
        """Stacked states [B, L, E, ..] as a session's state inputs (each layer's piece, contiguous, where layered)."""
        stacked = {CONV_STATE: conv, SSM_STATE: ssm}
        if not self.layered:
            return stacked
        return {name: np.ascontiguousarray(stacked[kind][:, layer]) for name, _, kind, layer in self.io}

    def stacked(self, outputs: list[np.ndarray]) -> list[np.ndarray]:
        """A session's outputs [logits, state outputs...] as [logits, conv [B, L, E, K-1], ssm [B, L, E, N]]."""
        if not self.layered:
            return outputs
        logits, *pieces = outputs
        half = len(pieces) // 2  # conv states first (:attr:`io`)
        return [logits, np.stack(pieces[:half], axis=1), np.stack(pieces[half:], axis=1)]

    def offset(self, kind: str, row: int) -> int:
        """Byte offset of row ``row``'s (first) piece in a buffer."""
        return row * self.step[kind]

    def extent(self, kind: str, k: int = 1) -> tuple[int, int]:
        """(bytes per piece, pieces) of k consecutive rows: the width and height of a 2-D copy of them."""
        return k * self.step[kind], self.layers if self.layered else 1

    def pitch(self, kind: str, capacity: int) -> int:
        """Bytes from one piece of a row to the next in a buffer of ``capacity`` rows (host arrays of one
        sequence: capacity 1)."""
        return capacity * self.step[kind]


class StateBuffers:
    """Two buffers per state tensor: a launch reads one and writes the other, then :meth:`swap`.

    Input and output of one execution must not share memory; the prefill and decode graphs share these buffers, so a
    prompt's state flows into the decode steps without a copy. ``alloc(shape)`` makes one buffer (host or device).
    """

    def __init__(self, shapes: dict[str, tuple[int, ...]], alloc: Callable[[tuple[int, ...]], Any]) -> None:
        self.pairs = {name: (alloc(shape), alloc(shape)) for name, shape in shapes.items()}
        self.parity = 0  # which buffer of each pair holds the current state

    def read(self, name: str) -> Any:
        """The buffer holding the current value of state ``name`` (a launch's input)."""
        return self.pairs[name][self.parity]

    def write(self, name: str) -> Any:
        """The other buffer of ``name`` (a launch's output)."""
        return self.pairs[name][1 - self.parity]

    def swap(self) -> None:
        """After a launch: what was written is now the current state."""
        self.parity ^= 1

    def buffers(self) -> list[Any]:
        """Every buffer (to free them)."""
        return [b for pair in self.pairs.values() for b in pair]


def bind_states(
    binding, device: str, layout: StateLayout, rows: tuple[int, int, int], read: Callable, write: Callable
) -> None:
    """Bind the state inputs and outputs of an onnxruntime launch over ``rows`` = (capacity, start, k): rows
    start..start+k-1 of buffers of ``capacity`` rows, ``read(kind)`` the buffer of the inputs and ``write(kind)``
    that of the outputs (numpy arrays on the CPU, OrtValues on CUDA); IOBinding on ``device`` "cpu" or "cuda"."""
    for name, out_name, kind, shape, offset in layout.binds(*rows):
        binding.bind_input(name, device, 0, np.float32, list(shape), address(read(kind)) + offset)
        binding.bind_output(out_name, device, 0, np.float32, list(shape), address(write(kind)) + offset)


def address(buffer) -> int:
    """Where a state buffer's memory starts: a numpy array's, an OrtValue's, or a device array's pointer."""
    if isinstance(buffer, np.ndarray):
        return buffer.ctypes.data
    return buffer.data_ptr() if hasattr(buffer, "data_ptr") else buffer.ptr


def check_io(contract: GraphContract, inputs: list[tuple], outputs: list[tuple], where: str) -> None:
    """A graph's or plan's I/O, as (name, dtype, shape) triples, against the contract it was built to.

    Names, dtypes and ranks must match, and a fixed dimension must equal the contract's; a dimension the graph
    leaves symbolic (a str, None or -1: the rows axis, or an expression the exporter could not fold) is not
    compared. A mismatch means a bundle from another mambatrt or a hand-edited graph: BundleError.
    """
    for kind, found, specs in (("inputs", inputs, contract.inputs), ("outputs", outputs, contract.outputs)):
        names = [f[0] for f in found]
        if sorted(names) != sorted(t.name for t in specs):
            raise BundleError(
                f"{where}: {kind} {names} do not match the I/O contract {[t.name for t in specs]}; rebuild the bundle"
            )
        by_name = {f[0]: f for f in found}
        for spec in specs:
            _, dtype, shape = by_name[spec.name]
            shape = list(shape)
            fixed = [isinstance(d, int) and d >= 0 for d in shape]
            if (
                dtype != spec.dtype
                or len(shape) != len(spec.shape)
                or any(f and isinstance(w, int) and d != w for f, d, w in zip(fixed, shape, spec.shape, strict=True))
            ):
                raise BundleError(
                    f"{where}: {spec.name} is {dtype} {shape}, the contract says {spec.dtype} {list(spec.shape)}; "
                    "rebuild the bundle"
                )
