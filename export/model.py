"""The one PyTorch Mamba-1 model of mambatrt, used by export and by tests alike.

Entry points over explicit recurrent state (no cache objects):

    step(token_id [1], conv_state [L, E, K-1], ssm_state [L, E, N])      -> logits [1, Vp], conv', ssm'
    steps(token_ids [B], conv_state [B, L, E, K-1], ssm_state [B, L, E, N]) -> logits [B, Vp], conv', ssm'
    rows(token_ids [S], conv_state, ssm_state, scan)  1 <= S <= max_rows -> logits [1, Vp] (last row), conv', ssm'

Each layer reads ``x = x + mixer(norm(x))`` (:class:`MambaBlock`); the mixer has one path per entry point:
``forward`` (S rows of one sequence, through the blocked prefill scan or its sequential reference, both in
:mod:`.scan_rows`) and ``step`` (one new row of each of B sequences, the direct update: the batched decode).
:meth:`MambaLM.forward_kernels` computes both graphs through mambatrt's own ops (:mod:`.kernel_ops`): the "kernels"
graph flavour.

Precision: the large matrices (embedding, in/out projections, lm_head) are stored and multiplied in the model's
dtype (fp32, fp16 or bf16), with explicit casts around each product, or stored as int8 rows with a scale each and
multiplied in fp32 ("int8", :mod:`.quantize`); the small x and dt projections (about 5 % of
a layer's weights), norms, conv, A_log, D, the residual stream, the scan, the states and the logits stay float32.
Half-precision x/dt projections would add four Cast kernels per layer to a decode step that is bound by its kernel
count, which made fp16 decode slower than fp32 (docs/benchmarks.md).

Parameter names follow transformers' ``MambaForCausalLM`` so HF checkpoints load without renaming.
Letters as in :mod:`mambatrt.config`: S rows, R rows of a launch (the sequences' rows one after the other), B
sequences, T rows per sequence, D model, E inner, N state, K conv, L layers, Vp padded vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mambatrt.config import MambaConfig
from mambatrt.contract import DEFAULT_MAX_ROWS, KERNELS, PORTABLE
from mambatrt.errors import InputError

from . import kernel_ops as ops
from .quantize import embed, quantize_module, weight
from .scan_rows import (
    BLOCKED,
    SEQUENTIAL,
    block_rows,
    blocked_selective_scan_aligned,
    causal_conv_rows,
    causal_conv_step,
    pad_rows,
    selective_scan_reference,
    selective_scan_step,
    stack_limited,
)

# each precision's dtype of the matrix products; "int8" stores the large matrices as int8 rows (:mod:`.quantize`)
PRECISIONS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.float32}
# The prefill scans by name: the graphs' (on whole blocks of rows, padded by the model) and the reference.
SCANS: dict[str, Callable] = {BLOCKED: blocked_selective_scan_aligned, SEQUENTIAL: selective_scan_reference}


def _same(a: torch.Tensor) -> torch.Tensor:
    return a


def precision_dtype(precision: str) -> torch.dtype:
    """torch dtype of a precision name; unknown names are refused with the list of known ones."""
    try:
        return PRECISIONS[precision]
    except KeyError:
        raise InputError(f"unknown precision '{precision}'; choose one of {', '.join(PRECISIONS)}") from None


def _linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """x @ W^T (+ b) in the layer's dtype; returns float32."""
    w = weight(layer)
    bias = None if layer.bias is None else layer.bias
    return F.linear(x.to(w.dtype), w, bias).to(torch.float32)


class RMSNorm(nn.Module):
    """RMSNorm in float32 (transformers' ``MambaRMSNorm``)."""

    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [S, D] float32 -> [S, D] float32."""
        var = x.pow(2).mean(-1, keepdim=True)  # [S, 1]
        # x / sqrt(...) * w: the pattern onnxruntime fuses into one SimplifiedLayerNormalization node
        return x / torch.sqrt(var + self.eps) * self.weight


class MambaMixer(nn.Module):
    """One Mamba-1 mixer over S rows with explicit states (transformers' ``MambaMixer.slow_forward``)."""

    def __init__(self, config: MambaConfig) -> None:
        super().__init__()
        c = config
        self.config = c
        self.in_proj = nn.Linear(c.d_model, 2 * c.d_inner, bias=c.proj_bias)
        self.conv1d = nn.Conv1d(c.d_inner, c.d_inner, c.d_conv, groups=c.d_inner, bias=c.conv_bias)
        self.x_proj = nn.Linear(c.d_inner, c.dt_rank + 2 * c.d_state, bias=False)
        self.dt_proj = nn.Linear(c.dt_rank, c.d_inner, bias=True)
        a = torch.arange(1, c.d_state + 1, dtype=torch.float32).expand(c.d_inner, -1)
        self.A_log = nn.Parameter(torch.log(a).contiguous())  # [E, N]
        self.D = nn.Parameter(torch.ones(c.d_inner))  # [E]
        self.out_proj = nn.Linear(c.d_inner, c.d_model, bias=c.proj_bias)

    def forward(
        self,
        h: torch.Tensor,
        conv_state: torch.Tensor,
        ssm_state: torch.Tensor,
        scan: Callable,
        max_rows: int,
        row_mask: torch.Tensor | None = None,
        valid_rows: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Mix S rows with the prefill scan ``scan``.

        Args:
            h: [S, D] float32 normed input.  conv_state: [E, K-1].  ssm_state: [E, N].
            scan: a value of :data:`SCANS` (the signature of :func:`.scan_rows.selective_scan_reference`).
            max_rows: the chunk limit, which fixes the scans' loop bounds.
            row_mask: [S, 1] 1.0 for real rows, 0.0 for padding rows below them (a scan on whole blocks), or None.
                Padding rows get dt = 0, the identity step (a = exp(0) = 1, b = 0): they repeat the last real state
                and leave the conv state at the last real inputs; their outputs are not used.
            valid_rows: the number of real rows when ``row_mask`` is given.
        Returns:
            out: [S, D] float32, conv_state' [E, K-1], ssm_state' [E, N].
        """
        # 1. gated projection
        x, z = _linear(h, self.in_proj).split(self.config.d_inner, dim=-1)  # [S, E] each (one Split node)
        # 2. causal depthwise conv over the previous K-1 inputs plus this chunk
        x, conv_state = causal_conv_rows(x, conv_state, self.conv1d.weight, self.conv1d.bias, valid_rows)  # [S, E]
        x = F.silu(x)  # [S, E]
        # 3.a input-dependent time step, B and C; 3.b A
        dt, b_in, c_out, a_mat = self._ssm_inputs(x)  # [S, E], [S, N], [S, N], [E, N]
        if row_mask is not None:
            dt = dt * row_mask  # [S, E]: 0 on padding rows, the identity step
        # 3.c the recurrence over the rows, float32
        y, new_ssm = scan(dt, dt * x, a_mat, b_in, c_out, ssm_state, max_rows)  # [S, E], [E, N]
        # 4. skip term, gate and output projection
        return self._output(y, x, z), conv_state, new_ssm  # [S, D], [E, K-1], [E, N]

    def step(
        self, h: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Mix one new row of each of B sequences (decode): the steps of :meth:`forward` with the direct update.

        Args: h [B, D] float32 normed input; conv_state [B, E, K-1]; ssm_state [B, E, N].
        Returns: out [B, D] float32, conv_state' [B, E, K-1], ssm_state' [B, E, N].
        """
        x, z = _linear(h, self.in_proj).split(self.config.d_inner, dim=-1)  # [B, E] each
        x, conv_state = causal_conv_step(x, conv_state, self.conv1d.weight, self.conv1d.bias)  # [B, E]
        x = F.silu(x)  # [B, E]
        dt, b_in, c_out, a_mat = self._ssm_inputs(x)  # [B, E], [B, N], [B, N], [E, N]
        y, new_ssm = selective_scan_step(dt, dt * x, a_mat, b_in, c_out, ssm_state)  # [B, E], [B, E, N]
        return self._output(y, x, z), conv_state, new_ssm  # [B, D], [B, E, K-1], [B, E, N]

    def _ssm_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """dt = softplus(dt_proj(.)), B, C from x [S, E], and A = -exp(A_log) [E, N]."""
        c = self.config
        dt, b_in, c_out = _linear(x, self.x_proj).split([c.dt_rank, c.d_state, c.d_state], dim=-1)  # [S, R|N|N]
        dt = F.softplus(_linear(dt, self.dt_proj))  # [S, E]
        return dt, b_in, c_out, -torch.exp(self.A_log)

    def _output(self, y: torch.Tensor, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """out_proj((y + D x) * silu(z)): [S, E] each -> [S, D]."""
        return _linear((y + self.D * x) * F.silu(z), self.out_proj)


class MambaBlock(nn.Module):
    """Pre-norm residual block: x + mixer(rmsnorm(x)), carrying the layer's states."""

    def __init__(self, config: MambaConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.mixer = MambaMixer(config)

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor, *scan_args):
        """x [S, D] -> x + mixer(norm(x)) [S, D] and the layer's new states; ``scan_args`` as in MambaMixer."""
        out, conv_state, ssm_state = self.mixer(self.norm(x), conv_state, ssm_state, *scan_args)
        return x + out, conv_state, ssm_state

    def step(self, x: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor):
        """x [B, D] -> x + mixer.step(norm(x)) [B, D] and the layer's new states ([B, E, K-1], [B, E, N])."""
        out, conv_state, ssm_state = self.mixer.step(self.norm(x), conv_state, ssm_state)
        return x + out, conv_state, ssm_state


class MambaBackbone(nn.Module):
    """Embedding, layers and final norm (transformers' ``MambaModel``)."""

    def __init__(self, config: MambaConfig) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_padded, config.d_model)
        self.layers = nn.ModuleList(MambaBlock(config) for _ in range(config.n_layer))
        self.norm_f = RMSNorm(config.d_model, config.norm_eps)


class MambaLM(nn.Module):
    """Mamba-1 language model over explicit states; see the module docstring for the entry points."""

    def __init__(self, config: MambaConfig, max_rows: int = DEFAULT_MAX_ROWS) -> None:
        super().__init__()
        self.config = config
        self.max_rows = max_rows
        self.backbone = MambaBackbone(config)
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.d_model, config.vocab_padded, bias=False)

    # -- precision -------------------------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the matrices (the model's precision)."""
        return weight(self.backbone.embeddings).dtype

    def to_precision(self, precision: str, replaced: Callable[[torch.Tensor], None] | None = None) -> MambaLM:
        """Cast the large matrices to fp32/fp16/bf16, or quantize them to int8 rows, in place (see the module
        docstring); returns self. ``replaced`` is called with each weight that int8 replaces, once its rows are
        made (the loader hands a mapped checkpoint's pages back, so that the build holds one source at a time)."""
        dtype = precision_dtype(precision)
        matrices = [self.backbone.embeddings] + [self.lm_head] * (self.lm_head is not None)
        for layer in self.backbone.layers:
            matrices += [layer.mixer.in_proj, layer.mixer.out_proj]
        for module in matrices:
            if precision != "int8":
                module.to(dtype)
                continue
            source = quantize_module(module)  # from the checkpoint's dtype, a block of rows at a time
            if replaced is not None:
                replaced(source)
        return self

    # -- states ----------------------------------------------------------------------------------------------
    def zero_states(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh states: conv [L, E, K-1] and ssm [L, E, N], float32 zeros."""
        c = self.config
        return torch.zeros(c.conv_state_shape), torch.zeros(c.ssm_state_shape)

    # -- checks (Python level; never inside an exported graph) ---------------------------------------------
    def check_rows(self, token_ids: torch.Tensor, max_rows: int) -> None:
        """Refuse chunks that are empty, too long, not 1-D integers, or hold ids outside the vocabulary."""
        if token_ids.dim() != 1 or token_ids.dtype not in (torch.int64, torch.int32):
            raise InputError(
                f"token_ids must be a 1-D integer tensor [S], got {tuple(token_ids.shape)} {token_ids.dtype}"
            )
        s = token_ids.shape[0]
        if s == 0:
            raise InputError("empty chunk: token_ids has no rows; pass at least one token")
        if s > max_rows:
            raise InputError(f"chunk of {s} rows exceeds the limit of {max_rows} rows; split the prompt into chunks")
        lo, hi = int(token_ids.min()), int(token_ids.max())
        if lo < 0 or hi >= self.config.vocab_size:
            bad = lo if lo < 0 else hi
            raise InputError(f"token id {bad} is outside the vocabulary [0, {self.config.vocab_size})")

    # -- graphs ----------------------------------------------------------------------------------------------
    def forward_rows(
        self,
        token_ids: torch.Tensor,
        conv_state: torch.Tensor,
        ssm_state: torch.Tensor,
        scan: str = BLOCKED,
        all_rows: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Unchecked prefill body (what ``prefill.onnx`` computes): S rows through the prefill scan ``scan``
        (a key of :data:`SCANS`: "blocked", the graphs' scan, or "sequential", its reference); ``all_rows``: every
        row's logits [S, Vp] (``score.onnx``).

        The blocked scan works on whole blocks of rows: the rows are padded once, here, to M rows (a multiple of the
        block size) with a row mask; the stream is then [M, D], real rows first.

        Args: token_ids [S] int64, conv_state [L, E, K-1], ssm_state [L, E, N] float32.
        Returns: logits [1, Vp] float32 (last real row), conv_state' [L, E, K-1], ssm_state' [L, E, N].
        """
        if scan not in SCANS:
            raise InputError(f"unknown prefill scan '{scan}'; choose from {', '.join(SCANS)}")
        x = embed(token_ids, self.backbone.embeddings)  # [S, D]
        rows = token_ids.shape[0]
        mask = valid = None
        if scan == BLOCKED:
            align = block_rows(self.max_rows)
            mask = pad_rows(torch.ones_like(x[:, :1]), align)  # [M, 1]: 1 real row, 0 padding
            x, valid = pad_rows(x, align), rows  # [M, D]
        convs, ssms = [], []
        for i, layer in enumerate(self.backbone.layers):
            x, conv_i, ssm_i = layer(x, conv_state[i], ssm_state[i], SCANS[scan], self.max_rows, mask, valid)
            convs.append(conv_i)  # x: [S or M, D]
            ssms.append(ssm_i)
        last = x[:rows] if all_rows else x[rows - 1 : rows]  # every real row, or the last one
        logits = self.head(self.backbone.norm_f(last))  # [S or 1, Vp]
        return logits, stack_limited(convs), stack_limited(ssms)  # [1, Vp], [L, E, K-1], [L, E, N]

    def forward_step(
        self, token_ids: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Unchecked decode body (what ``decode.onnx`` computes): one new token for each of B sequences.

        Args: token_ids [B] int64, conv_state [B, L, E, K-1], ssm_state [B, L, E, N] float32.
        Returns: logits [B, Vp] float32, conv_state' [B, L, E, K-1], ssm_state' [B, L, E, N].
        """
        x = embed(token_ids, self.backbone.embeddings)  # [B, D]
        convs, ssms = [], []
        for i, layer in enumerate(self.backbone.layers):
            x, conv_i, ssm_i = layer.step(x, conv_state[:, i], ssm_state[:, i])  # [B, D]
            convs.append(conv_i)
            ssms.append(ssm_i)
        logits = self.head(self.backbone.norm_f(x))  # [B, Vp]
        return logits, stack_limited(convs, 1), stack_limited(ssms, 1)  # [B, Vp], [B, L, E, K-1], [B, L, E, N]

    def forward_kernels(
        self, token_ids: torch.Tensor, conv_states: list[torch.Tensor], ssm_states: list[torch.Tensor], decode: bool
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """The body of the "kernels" flavour, for both graphs: per layer the conv (+ SiLU) is one node and the dt
        projection, scan and gate tail another, from mambatrt's own library (:mod:`.kernel_ops`), and the residual
        add + RMSNorm of the next layer a third; so a step launches far fewer kernels than the portable graphs.

        The stream stays 2-D, R rows of [R, D] (so the matrix products keep the portable graphs' weight layout and
        share weights.bin with them); the ops see it as [B, T, ..]: ``decode`` -> R sequences of one row (B = R,
        taken as [B, ..]), else B sequences (the states' batch) of T = R / B rows each, one after the other.
        Each layer's states come and leave as tensors of their own (contract schema 4: the graph splits and joins
        nothing).

        Args: token_ids [R] int64, conv_states L x [B, E, K-1], ssm_states L x [B, E, N] float32.
        Returns: logits [B, Vp] float32 (each sequence's last row), conv_states', ssm_states' (L x as they came).
        """
        seq, rows = _row_views(decode, conv_states[0].shape[0])  # B: the states' batch
        x = embed(token_ids, self.backbone.embeddings)  # [R, D]
        # an fp16 model keeps the mixer's ends in float16: out_proj's output joins the float32 stream and in_proj's
        # input leaves it in MambaAddNorm16 (no Cast per layer)
        half = weight(self.backbone.layers[0].mixer.in_proj).dtype == torch.float16
        add_norm = ops.add_rms_norm16 if half else ops.skip_rms_norm
        out, convs, ssms = None, [], []
        for i, layer in enumerate(self.backbone.layers):
            if out is None:
                h = layer.norm(x)  # [R, D]
            else:
                h, x = add_norm(out, x, layer.norm.weight, layer.norm.eps)  # [R, D] (fp16: float16), float32
            out, conv_i, ssm_i = _mixer_kernels(layer.mixer, h, conv_states[i], ssm_states[i], seq, rows, half)
            convs.append(conv_i)  # [B, E, K-1]
            ssms.append(ssm_i)  # [B, E, N]
        if not decode:  # each sequence's last row is what the prefill graph returns logits for
            out, x = seq(out)[:, -1], seq(x)[:, -1]  # [B, D]
        h, _ = add_norm(out, x, self.backbone.norm_f.weight, self.backbone.norm_f.eps)
        return self.head(h), convs, ssms  # [B, Vp], L x [B, E, K-1], L x [B, E, N]

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits [S, Vp] float32 of normed rows h [S, D] (tied: the embedding matrix)."""
        w = weight(self.backbone.embeddings if self.lm_head is None else self.lm_head)  # [Vp, D]
        # one Gemm (transB) on the weight as stored, shared with the embedding's Gather: no transposed copy (w @ h^T
        # between two Transposes becomes onnxruntime's FusedMatMul on the CPU, far slower at batch 1)
        return F.linear(h.to(w.dtype), w).to(torch.float32)  # [S, Vp]

    def rows(
        self, token_ids: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor, scan: str = BLOCKED
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Prefill 1..max_rows rows from the given states; returns last-row logits [1, Vp] and the new states."""
        self.check_rows(token_ids, self.max_rows)
        return self.forward_rows(token_ids.to(torch.int64), conv_state, ssm_state, scan)

    def step(
        self, token_id: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Decode one token [1] of one sequence (states [L, E, K-1], [L, E, N]); returns logits [1, Vp], new states."""
        self.check_rows(token_id, 1)
        logits, conv, ssm = self.forward_step(token_id.to(torch.int64), conv_state[None], ssm_state[None])
        return logits, conv[0], ssm[0]

    def steps(
        self, token_ids: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Decode one token of each of B sequences: token_ids [B], states [B, L, E, K-1] and [B, L, E, N]."""
        if token_ids.dim() != 1 or conv_state.shape[0] != token_ids.shape[0] != ssm_state.shape[0]:
            raise InputError(f"{token_ids.shape[0]} tokens for {conv_state.shape[0]} states; pass one per sequence")
        for i in range(token_ids.shape[0]):
            self.check_rows(token_ids[i : i + 1], 1)
        return self.forward_step(token_ids.to(torch.int64), conv_state, ssm_state)

    def prefill(
        self, token_ids: torch.Tensor, conv_state: torch.Tensor | None = None, ssm_state: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A prompt of any length in chunks of at most max_rows rows (from zero states unless given)."""
        if conv_state is None or ssm_state is None:
            conv_state, ssm_state = self.zero_states()
        if token_ids.numel() == 0:
            raise InputError("empty prompt: pass at least one token")
        logits = None
        for start in range(0, token_ids.shape[0], self.max_rows):
            chunk = token_ids[start : start + self.max_rows]
            logits, conv_state, ssm_state = self.rows(chunk, conv_state, ssm_state)
        return logits, conv_state, ssm_state


def _row_views(decode: bool, batch: int) -> tuple[Callable, Callable]:
    """(seq, rows): the kernels' view of the stream's [R, C] rows, [B, T, C] for B = ``batch`` sequences, and back
    (free Reshapes); a decode step's [B, C] goes to the ops as it is (no Unsqueeze or Squeeze nodes)."""
    if decode:
        return _same, _same

    def seq(a: torch.Tensor) -> torch.Tensor:
        return a.reshape(batch, -1, a.shape[-1])  # [R, C] -> [B, T, C]

    def rows(a: torch.Tensor) -> torch.Tensor:
        return a.reshape(-1, a.shape[-1])  # [B, T, C] -> [R, C]

    return seq, rows


def _mixer_kernels(m: MambaMixer, h: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor, seq: Callable,
                   rows: Callable, half: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """One mixer through mambatrt's ops: h [R, D] (normed), conv [B, E, K-1], ssm [B, E, N] -> out_proj's output
    [R, D] float32 (``half``: float16), conv', ssm'. The matrix products run on the 2-D stream (the portable graphs'
    weight layout); ``seq`` / ``rows`` reshape between [R, C] and the ops' [B, T, C] (a decode step: the identity,
    the ops take its [B, C] as it is). The ops compute in fp32; an fp16 model's in_proj output goes to them and
    their y to out_proj in fp16 (MambaConv16, MambaScan16: no casts between)."""
    f32 = torch.float32
    w = weight(m.in_proj)
    if half:
        xz = seq(F.linear(h.to(w.dtype), w, m.in_proj.bias))  # [B, T, 2E] float16
    else:
        xz = seq(_linear(h, m.in_proj))  # [B, T, 2E] float32
    conv_bias = m.conv1d.bias if m.conv1d.bias is not None else torch.zeros(m.config.d_inner)
    u, conv = ops.mamba_conv(xz, m.conv1d.weight[:, 0, :].to(f32), conv_bias.to(f32), conv)  # [B, (T,) E]
    xdbl = seq(_linear(rows(u), m.x_proj))  # [B, T, R+2N]
    dt_w, dt_b, a_mat, d = m.dt_proj.weight.to(f32), m.dt_proj.bias.to(f32), -torch.exp(m.A_log.to(f32)), m.D.to(f32)
    y, ssm = ops.mamba_scan(u, xdbl, dt_w, dt_b, a_mat, d, xz, ssm)  # [B, (T,) E], [B, E, N]
    if half:  # out_proj's float16 output goes to MambaAddNorm16 as it is
        return F.linear(rows(y), weight(m.out_proj), m.out_proj.bias), conv, ssm
    return _linear(rows(y), m.out_proj), conv, ssm


class DecodeGraph(nn.Module):
    """What ``decode.onnx`` computes: :meth:`MambaLM.forward_step` for B sequences; the "kernels" flavour computes
    the same through :meth:`MambaLM.forward_kernels`, each layer's states a tensor of their own."""

    def __init__(self, model: MambaLM, flavour: str = PORTABLE) -> None:
        super().__init__()
        self.model = model
        self.flavour = flavour

    def forward(self, token_ids: torch.Tensor, states: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """token_ids [B], states [conv_state [B, L, E, K-1], ssm_state [B, L, E, N]] -> logits [B, Vp],
        conv_state_out, ssm_state_out; kernels: states L conv [B, E, K-1] then L ssm [B, E, N], likewise out."""
        if self.flavour == KERNELS:
            return _flat(self.model.forward_kernels(token_ids, *_by_layer(states), decode=True))
        return self.model.forward_step(token_ids, *states)


class PrefillGraph(nn.Module):
    """What ``prefill.onnx`` computes: :meth:`MambaLM.forward_rows` (the blocked scan) on the states of one
    sequence with the batch axis of the contract ([1, L, E, K-1] and [1, L, E, N]); the "kernels" flavour takes B
    sequences of T rows each (token_ids [B x T], each layer's states [B, ..])."""

    def __init__(self, model: MambaLM, flavour: str = PORTABLE) -> None:
        super().__init__()
        self.model = model
        self.flavour = flavour

    def forward(self, token_ids: torch.Tensor, states: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """token_ids [S], states [conv_state [1, L, E, K-1], ssm_state [1, L, E, N]] -> logits [1, Vp] (the last
        row), conv_state_out, ssm_state_out; kernels: B sequences of T = S / B rows, states and logits [B, ..] as
        in :class:`DecodeGraph`."""
        if self.flavour == KERNELS:  # the kernels' scan takes any T: no padding
            return _flat(self.model.forward_kernels(token_ids, *_by_layer(states), decode=False))
        conv_state, ssm_state = states
        logits, conv, ssm = self.model.forward_rows(token_ids, conv_state[0], ssm_state[0])
        return logits, conv.unsqueeze(0), ssm.unsqueeze(0)


class ScoreGraph(nn.Module):
    """What ``score.onnx`` computes: :class:`PrefillGraph`'s portable graph with every row's logits [S, Vp]."""

    def __init__(self, model: MambaLM, flavour: str = PORTABLE) -> None:
        super().__init__()
        self.model = model

    def forward(self, token_ids: torch.Tensor, states: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        conv_state, ssm_state = states
        logits, conv, ssm = self.model.forward_rows(token_ids, conv_state[0], ssm_state[0], all_rows=True)
        return logits, conv.unsqueeze(0), ssm.unsqueeze(0)


def _by_layer(states: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A kernels graph's state inputs (L conv states, then L ssm states) as forward_kernels takes them."""
    layers = len(states) // 2
    return list(states[:layers]), list(states[layers:])


def _flat(out: tuple) -> tuple:
    """forward_kernels' (logits, convs, ssms) as the graph's outputs: logits, the conv states, the ssm states."""
    logits, convs, ssms = out
    return (logits, *convs, *ssms)


__all__ = ["MambaLM", "DecodeGraph", "PrefillGraph", "ScoreGraph", "precision_dtype", "PRECISIONS", "SCANS"]
