"""The graphs' I/O contract, declared once as data.

Export names and shapes the ONNX graphs from it, compile derives the TensorRT profiles from it, and the runtime
checks graphs and plans against it and allocates its buffers from it. Pure Python (no torch, no numpy).

Both graphs share one signature:

    inputs   token_ids       int64    [rows]          decode: rows = 1; prefill: 1..max_rows ("rows" axis)
             conv_state      float32  [L, E, K-1]
             ssm_state       float32  [L, E, N]
    outputs  logits          float32  [1, Vp]         last row only
             conv_state_out  float32  [L, E, K-1]
             ssm_state_out   float32  [L, E, N]
"""

from __future__ import annotations

from dataclasses import dataclass

from mambatrt.config import MambaConfig

DECODE = "decode"
PREFILL = "prefill"
GRAPHS = (DECODE, PREFILL)
ROWS_AXIS = "rows"
DEFAULT_MAX_ROWS = 64
DEFAULT_OPT_ROWS = 32

TOKEN_IDS = "token_ids"
CONV_STATE = "conv_state"
SSM_STATE = "ssm_state"
LOGITS = "logits"
CONV_STATE_OUT = "conv_state_out"
SSM_STATE_OUT = "ssm_state_out"

INPUT_NAMES = (TOKEN_IDS, CONV_STATE, SSM_STATE)
OUTPUT_NAMES = (LOGITS, CONV_STATE_OUT, SSM_STATE_OUT)
# Each state input and the output that carries its next value.
STATE_PAIRS = ((CONV_STATE, CONV_STATE_OUT), (SSM_STATE, SSM_STATE_OUT))


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output: name, numpy-style dtype name, shape (ints, or a str naming a dynamic axis)."""

    name: str
    dtype: str
    shape: tuple[int | str, ...]

    def to_dict(self) -> dict:
        """JSON-friendly form, as a manifest stores it."""
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    def concrete_shape(self, rows: int) -> tuple[int, ...]:
        """The shape with the rows axis set to ``rows``."""
        return tuple(rows if d == ROWS_AXIS else d for d in self.shape)


@dataclass(frozen=True)
class GraphContract:
    """Inputs and outputs of one graph (decode or prefill)."""

    graph: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    min_rows: int
    max_rows: int

    def to_dict(self) -> dict:
        """JSON-friendly form, as a manifest stores it."""
        return {
            "graph": self.graph,
            "rows": [self.min_rows, self.max_rows],
            "inputs": [t.to_dict() for t in self.inputs],
            "outputs": [t.to_dict() for t in self.outputs],
        }

    def spec(self, name: str) -> TensorSpec:
        """The input or output called ``name``."""
        for t in self.inputs + self.outputs:
            if t.name == name:
                return t
        raise KeyError(name)


def graph_contract(config: MambaConfig, graph: str, max_rows: int = DEFAULT_MAX_ROWS) -> GraphContract:
    """The I/O contract of ``graph`` ("decode" or "prefill") for a model of this config."""
    if graph not in GRAPHS:
        raise ValueError(f"unknown graph {graph!r}; expected one of {GRAPHS}")
    rows: int | str = 1 if graph == DECODE else ROWS_AXIS
    conv = config.conv_state_shape
    ssm = config.ssm_state_shape
    inputs = (
        TensorSpec(TOKEN_IDS, "int64", (rows,)),
        TensorSpec(CONV_STATE, "float32", conv),
        TensorSpec(SSM_STATE, "float32", ssm),
    )
    outputs = (
        TensorSpec(LOGITS, "float32", (1, config.vocab_padded)),
        TensorSpec(CONV_STATE_OUT, "float32", conv),
        TensorSpec(SSM_STATE_OUT, "float32", ssm),
    )
    return GraphContract(graph, inputs, outputs, 1, 1 if graph == DECODE else max_rows)
