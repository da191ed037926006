"""The graphs' I/O contract, declared once as data.

Export names and shapes the ONNX graphs from it, compile derives the TensorRT profiles from it, and the runtime
checks graphs and plans against it and allocates its buffers from it. Pure Python (no torch, no numpy).

Bundle schema 4, the one ``mambatrt bundle`` writes (letters as in :mod:`mambatrt.config`, Vp the padded vocabulary):

    decode   token_ids  int64 [batch]   conv_state float32 [batch, L, E, K-1]   ssm_state float32 [batch, L, E, N]
             -> logits float32 [batch, Vp], conv_state_out, ssm_state_out (the states' shapes)
    prefill  token_ids  int64 [rows]    conv_state float32 [1, L, E, K-1]       ssm_state float32 [1, L, E, N]
             -> logits float32 [1, Vp] (the last row), conv_state_out, ssm_state_out
    score    as prefill, but logits float32 [rows, Vp]: every row's (``score.onnx``, optional: prompt scoring)

That is the "portable" flavour (standard ONNX; TensorRT plans are built from it). The "kernels" flavour's graphs
take and give each layer's states as tensors of their own, ``conv_state_<l>`` [batch, E, K-1] and ``ssm_state_<l>``
[batch, E, N] (outputs ``conv_state_out_<l>``, ``ssm_state_out_<l>``), l in 0..L-1: a runtime keeps the states
layer-major ([L, slots, E, ..]: the runtime's ``StateLayout``), so a launch over slots 0..B-1 binds L contiguous
blocks per state and the graph splits and joins nothing. Their prefill graph also takes a batch of sequences: token_ids
[B x T] are the chunks of B sequences one after the other, T = rows / B rows each, B in 1..max_prefill_batch, states
[B, ..] and logits [B, Vp] (each sequence's last row); T runs 1..max_rows, and where the manifest records the kernels
graph's rows (:func:`kernels_prefill_rows`: 2048 where the portable graphs take 64) B x T does too.

Older schemas the runtime still reads: 3, the same with the kernels graphs' states stacked as the portable graphs'
([batch, L, E, ..]); 2, prefill batch 1 in every flavour; 1 (``max_batch=None`` here), no batch axis at all:
decode token_ids [1], states [L, E, K-1] and [L, E, N], logits [1, Vp].
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import MambaConfig

DECODE = "decode"
PREFILL = "prefill"
GRAPHS = (DECODE, PREFILL)
# The scoring graph: the portable prefill with every row's logits, for requests that score their prompt (echo with
# logprobs, eval): a chunk's rows in one launch instead of one decode launch per token, while the prefill graphs
# keep computing the last row's logits only. onnxruntime only; optional in a bundle (split bundles have it).
SCORE = "score"
SCORE_FILE = "score.onnx"
ROWS_AXIS = "rows"
BATCH_AXIS = "batch"
DEFAULT_MAX_ROWS = 64
DEFAULT_OPT_ROWS = 32
DEFAULT_MAX_BATCH = 64
DEFAULT_OPT_BATCH = 16  # the decode plan's optimum: a server's typical number of running sequences
DEFAULT_MAX_PREFILL_BATCH = 16  # sequences per prefill launch of the kernels graphs
# Rows of one launch of the kernels prefill graph, its sequences' together: the portable graphs keep
# DEFAULT_MAX_ROWS (the TensorRT plans' profile, and the portable scan's loop bounds), while the kernels' conv and
# scan take any number of rows, so a long prompt goes in a few launches whose projections run at full M. Capping
# the rows of a launch over all its sequences (not per sequence) bounds the activations and staging memory of a
# batched launch (16 prompts share these rows rather than take 16 x 2048).
DEFAULT_KERNELS_PREFILL_ROWS = 2048

# Graph flavours: the same contract, different operators. "portable" graphs use standard ONNX only (TensorRT plans
# are built from them; the universal fallback); "kernels" graphs use mambatrt's own ops (compile/kernels/, a library
# the bundle carries; a few kernels per layer, for onnxruntime on CPU and CUDA).
PORTABLE = "portable"
KERNELS = "kernels"
FLAVOURS = (PORTABLE, KERNELS)
# A retired flavour (onnxruntime's com.microsoft Mamba ops): the manifests of older bundles list its graphs under
# "fused_graphs", which the manifest accepts and ignores.
FUSED = "fused"
# What mambatrt's kernels handle (compile/kernels/mamba_ops.h): one warp lane per state element, the conv window
# in registers
KERNELS_MAX_STATE = 32
KERNELS_MAX_CONV = 8


def kernels_unsupported(config) -> str | None:
    """Why the "kernels" flavour cannot run a model of this config (a MambaConfig), or None."""
    if config.d_state > KERNELS_MAX_STATE:
        return f"state size {config.d_state} > {KERNELS_MAX_STATE}"
    if config.d_conv > KERNELS_MAX_CONV:
        return f"conv width {config.d_conv} > {KERNELS_MAX_CONV}"
    return None


def kernels_prefill_rows(max_rows: int) -> int:
    """The rows of one launch of the kernels prefill graph that a bundle of portable prefill chunks of ``max_rows``
    rows gets: DEFAULT_KERNELS_PREFILL_ROWS, or ``max_rows`` where that is more."""
    return max(max_rows, DEFAULT_KERNELS_PREFILL_ROWS)


def graph_file(graph: str, flavour: str = PORTABLE) -> str:
    """The ONNX file name of a graph in a bundle: decode.onnx, prefill.onnx, decode.kernels.onnx, ..."""
    return f"{graph}.onnx" if flavour == PORTABLE else f"{graph}.{flavour}.onnx"


def cuda_graph_file(graph: str) -> str:
    """The ONNX file of a kernels graph's CUDA copy (its fp32 projections as MambaLinear): decode.kernels-cuda.onnx."""
    return f"{graph}.{KERNELS}-cuda.onnx"


def cpu_graph_file(graph: str) -> str:
    """The ONNX file of a kernels graph's CPU copy (its fp32 products, the LM head's too, as MambaLinear for the
    library's packed AVX-512 kernel): decode.kernels-cpu.onnx, prefill.kernels-cpu.onnx."""
    return f"{graph}.{KERNELS}-cpu.onnx"


TOKEN_IDS = "token_ids"
CONV_STATE = "conv_state"
SSM_STATE = "ssm_state"
LOGITS = "logits"
CONV_STATE_OUT = "conv_state_out"
SSM_STATE_OUT = "ssm_state_out"

INPUT_NAMES = (TOKEN_IDS, CONV_STATE, SSM_STATE)
OUTPUT_NAMES = (LOGITS, CONV_STATE_OUT, SSM_STATE_OUT)
# Each state input and the output that carries its next value (the stacked graphs').
STATE_PAIRS = ((CONV_STATE, CONV_STATE_OUT), (SSM_STATE, SSM_STATE_OUT))
STATES = (CONV_STATE, SSM_STATE)  # the two kinds of state, by their stacked input names


def layer_name(name: str, layer: int) -> str:
    """The name of one layer's tensor of state input or output ``name`` in a layered graph: conv_state_3, ..."""
    return f"{name}_{layer}"


def state_io(layers: int | None) -> tuple[tuple[str, str, str, int | None], ...]:
    """(input, output, state kind, layer) of each state tensor pair of a graph: the stacked graphs' two (``layers``
    None, layer None), or a layered graph's 2 x ``layers``, conv states first, each kind by layer. The kind is the
    stacked input name (STATES)."""
    if layers is None:
        return tuple((i, o, i, None) for i, o in STATE_PAIRS)
    return tuple((layer_name(i, n), layer_name(o, n), i, n) for i, o in STATE_PAIRS for n in range(layers))


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output: name, numpy-style dtype name, shape (ints, or a str naming a dynamic axis)."""

    name: str
    dtype: str
    shape: tuple[int | str, ...]

    def to_dict(self) -> dict:
        """JSON-friendly form, as a manifest stores it."""
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    def concrete_shape(self, rows: int = 1, batch: int = 1) -> tuple[int, ...]:
        """The shape with the rows axis set to ``rows`` and the batch axis to ``batch``."""
        return tuple(rows if d == ROWS_AXIS else batch if d == BATCH_AXIS else d for d in self.shape)


@dataclass(frozen=True)
class GraphContract:
    """Inputs and outputs of one graph (decode or prefill), with the ranges of its dynamic axes."""

    graph: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    min_rows: int
    max_rows: int
    max_batch: int | None = None  # None: a schema-1 graph, no batch axis
    prefill_batch: int = 1  # sequences per prefill launch (the prefill graph's batch axis: 1..prefill_batch)
    layered: bool = False  # each layer's states a tensor of their own (schema 4's kernels graphs)

    @property
    def batch(self) -> int:
        """The largest batch of one launch of this graph (1 without a batch axis)."""
        if self.max_batch is None:
            return 1
        return self.max_batch if self.graph == DECODE else self.prefill_batch

    @property
    def state_io(self) -> tuple[tuple[str, str, str, int | None], ...]:
        """(input, output, state kind, layer) of each state tensor pair (:func:`state_io`); a layered graph's inputs
        are the token ids and two per layer."""
        return state_io((len(self.inputs) - 1) // 2 if self.layered else None)

    def to_dict(self) -> dict:
        """JSON-friendly form, as a manifest stores it (``rows``: per sequence)."""
        d = {"graph": self.graph, "rows": [self.min_rows, self.max_rows]}
        if self.max_batch is not None:
            d["batch"] = [1, self.batch]
        return {**d, "inputs": [t.to_dict() for t in self.inputs], "outputs": [t.to_dict() for t in self.outputs]}

    def spec(self, name: str) -> TensorSpec:
        """The input or output called ``name``."""
        for t in self.inputs + self.outputs:
            if t.name == name:
                return t
        raise KeyError(name)

    def profile(self, opt_rows: int = DEFAULT_OPT_ROWS, opt_batch: int = DEFAULT_OPT_BATCH) -> dict[str, tuple]:
        """(min, opt, max) shapes of every input with a dynamic axis: a TensorRT optimization profile (plans are
        built from the portable graphs: prefill batch 1)."""
        batch = (1, min(opt_batch, self.batch), self.batch)
        rows = (self.min_rows, min(max(opt_rows, self.min_rows), self.max_rows), self.max_rows)
        out = {}
        for t in self.inputs:
            if ROWS_AXIS in t.shape or BATCH_AXIS in t.shape:
                out[t.name] = tuple(t.concrete_shape(r, b) for r, b in zip(rows, batch, strict=True))
        return out


def graph_contract(
    config: MambaConfig,
    graph: str,
    max_rows: int = DEFAULT_MAX_ROWS,
    max_batch: int | None = DEFAULT_MAX_BATCH,
    prefill_batch: int = 1,
    layered: bool = False,
) -> GraphContract:
    """The I/O contract of ``graph`` ("decode" or "prefill") for a model of this config.

    ``max_batch``: the decode graph's largest batch (schema 2); None gives the unbatched schema-1 contract.
    ``prefill_batch``: the prefill graph's largest batch (the kernels graphs from schema 3; 1 otherwise).
    ``layered``: one state tensor per layer and kind (the kernels graphs from schema 4; batched contracts only).
    """
    if graph not in (*GRAPHS, SCORE):
        raise ValueError(f"unknown graph {graph!r}; expected one of {GRAPHS} or {SCORE!r}")
    if graph == SCORE and (prefill_batch > 1 or layered or max_batch is None):
        raise ValueError("the scoring graph is the portable one of batch 1")
    rows: int | str = 1 if graph == DECODE else ROWS_AXIS
    conv, ssm, vp = config.conv_state_shape, config.ssm_state_shape, config.vocab_padded
    if max_batch is None:  # schema 1
        ids, lead, logit_rows = (rows,), (), 1
    elif graph == DECODE:
        ids, lead, logit_rows = (BATCH_AXIS,), (BATCH_AXIS,), BATCH_AXIS
    elif prefill_batch > 1:
        ids, lead, logit_rows = (ROWS_AXIS,), (BATCH_AXIS,), BATCH_AXIS
    else:
        ids, lead, logit_rows = (ROWS_AXIS,), (1,), ROWS_AXIS if graph == SCORE else 1
    if layered and max_batch is None:
        raise ValueError("layered states need the batch axis (schema 4)")
    per_sequence = {CONV_STATE: conv, SSM_STATE: ssm}  # [L, E, K-1], [L, E, N]
    inputs, outputs = [TensorSpec(TOKEN_IDS, "int64", ids)], [TensorSpec(LOGITS, "float32", (logit_rows, vp))]
    for name, out_name, kind, layer in state_io(config.n_layer if layered else None):  # layered: L x [batch, E, ..]
        shape = lead + (per_sequence[kind] if layer is None else per_sequence[kind][1:])
        inputs.append(TensorSpec(name, "float32", shape))
        outputs.append(TensorSpec(out_name, "float32", shape))
    batch = prefill_batch if graph == PREFILL and max_batch is not None else 1
    rows_max = 1 if graph == DECODE else max_rows
    return GraphContract(graph, tuple(inputs), tuple(outputs), 1, rows_max, max_batch, batch, layered)


# The greedy picker: a one-node-pair graph (Slice to the real vocabulary + ArgMax) that runs on the decode graph's
# logits where they are, so a server whose sequences all decode greedily copies B token ids to the host per step
# instead of B x Vp logits. onnxruntime only; optional in a bundle.
GREEDY = "greedy"
GREEDY_FILE = "greedy.onnx"
NEXT_TOKEN = "next_token"


def greedy_contract(config: MambaConfig) -> tuple[TensorSpec, TensorSpec]:
    """(input, output) of the greedy graph: logits float32 [batch, Vp] -> next_token int64 [batch]."""
    logits = TensorSpec(LOGITS, "float32", (BATCH_AXIS, config.vocab_padded))
    return logits, TensorSpec(NEXT_TOKEN, "int64", (BATCH_AXIS,))
