"""The one PyTorch Mamba-1 model of mambatrt, used by export and by tests alike.

Entry points over explicit recurrent state (no cache objects):

    step(token_id [1], conv_state [L, E, K-1], ssm_state [L, E, N])      -> logits [1, Vp], conv', ssm'
    steps(token_ids [B], conv_state [B, L, E, K-1], ssm_state [B, L, E, N]) -> logits [B, Vp], conv', ssm'
    rows(token_ids [S], conv_state, ssm_state, scan)  1 <= S <= max_rows -> logits [1, Vp] (last row), conv', ssm'

Each layer reads ``x = x + mixer(norm(x))`` (:class:`MambaBlock`); the mixer has one path per entry point:
``forward`` (S rows of one sequence, any prefill scan of :mod:`mambatrt.export.scans`) and ``step`` (one new row of
each of B sequences, the direct update: the batched decode).

Precision: the large matrices (embedding, in/out projections, lm_head) are stored and multiplied in the model's
dtype (fp32, fp16 or bf16), with explicit casts around each product; the small x and dt projections (about 5 % of
a layer's weights), norms, conv, A_log, D, the residual stream, the scan, the states and the logits stay float32.
Half-precision x/dt projections would add four Cast kernels per layer to a decode step that is bound by its kernel
count, which made fp16 decode slower than fp32 (BENCHMARKS.md).

Parameter names follow transformers' ``MambaForCausalLM`` so HF checkpoints load without renaming.
Letters as in :mod:`mambatrt.config`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mambatrt.config import MambaConfig
from mambatrt.contract import DEFAULT_MAX_ROWS
from mambatrt.errors import InputError
from mambatrt.export.scan_rows import (
    block_rows,
    causal_conv_rows,
    causal_conv_step,
    pad_rows,
    selective_scan_step,
    stack_limited,
)
from mambatrt.export.scans import DEFAULT_SCAN, ScanSpec, scan_spec

PRECISIONS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


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
    w = layer.weight
    bias = None if layer.bias is None else layer.bias
    return F.linear(x.to(w.dtype), w, bias).to(torch.float32)


def softplus_exp_log(x: torch.Tensor) -> torch.Tensor:
    """``F.softplus(x)`` (beta 1, threshold 20: x > 20 gives x) written with Exp and Log.

    Same values as torch's softplus up to float32 rounding of 1 + exp(x) (absolute error below 1e-7). Scans whose
    registry entry says ``softplus="exp-log"`` (the CPU-oriented one) use it: onnxruntime's CPU ``Softplus`` kernel
    (alone or fused into a Gemm) runs element by element, several times slower than Exp + Add + Log. The other
    graphs keep the one-node Softplus (fewer kernels per layer on a GPU).
    """
    return torch.where(x > 20.0, x, torch.log(1.0 + torch.exp(x)))  # exp(x) = inf above 88 is not selected


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
        scan: ScanSpec,
        max_rows: int,
        row_mask: torch.Tensor | None = None,
        valid_rows: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Mix S rows with the prefill scan ``scan``.

        Args:
            h: [S, D] float32 normed input.  conv_state: [E, K-1].  ssm_state: [E, N].
            scan: an entry of :data:`mambatrt.export.scans.SCANS` (or the sequential reference).
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
        dt, b_in, c_out, a_mat = self._ssm_inputs(x, scan.softplus)  # [S, E], [S, N], [S, N], [E, N]
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
        dt, b_in, c_out, a_mat = self._ssm_inputs(x, "plain")  # [B, E], [B, N], [B, N], [E, N]
        y, new_ssm = selective_scan_step(dt, dt * x, a_mat, b_in, c_out, ssm_state)  # [B, E], [B, E, N]
        return self._output(y, x, z), conv_state, new_ssm  # [B, D], [B, E, K-1], [B, E, N]

    def _ssm_inputs(self, x: torch.Tensor, softplus: str) -> tuple[torch.Tensor, ...]:
        """dt = softplus(dt_proj(.)), B, C from x [S, E], and A = -exp(A_log) [E, N]."""
        c = self.config
        dt, b_in, c_out = _linear(x, self.x_proj).split([c.dt_rank, c.d_state, c.d_state], dim=-1)  # [S, R|N|N]
        dt = _linear(dt, self.dt_proj)  # [S, E]
        dt = softplus_exp_log(dt) if softplus == "exp-log" else F.softplus(dt)  # [S, E]
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
        return self.backbone.embeddings.weight.dtype

    def to_precision(self, precision: str) -> MambaLM:
        """Cast the large matrices to fp32/fp16/bf16 in place (see the module docstring); returns self."""
        dtype = precision_dtype(precision)
        self.backbone.embeddings.to(dtype)
        for layer in self.backbone.layers:
            for proj in (layer.mixer.in_proj, layer.mixer.out_proj):
                proj.to(dtype)
        if self.lm_head is not None:
            self.lm_head.to(dtype)
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
        scan: str | ScanSpec = DEFAULT_SCAN,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Unchecked prefill body (what ``prefill.onnx`` computes): S rows through the prefill scan ``scan``.

        A scan on whole blocks (``aligned`` in its registry entry) gets the rows padded once, here, to M rows (a
        multiple of the block size) with a row mask; the stream is then [M, D], real rows first.

        Args: token_ids [S] int64, conv_state [L, E, K-1], ssm_state [L, E, N] float32.
        Returns: logits [1, Vp] float32 (last real row), conv_state' [L, E, K-1], ssm_state' [L, E, N].
        """
        spec = scan_spec(scan) if isinstance(scan, str) else scan
        x = F.embedding(token_ids, self.backbone.embeddings.weight).to(torch.float32)  # [S, D]
        rows = token_ids.shape[0]
        mask = valid = None
        if spec.aligned:
            align = block_rows(self.max_rows)
            mask = pad_rows(torch.ones_like(x[:, :1]), align)  # [M, 1]: 1 real row, 0 padding
            x, valid = pad_rows(x, align), rows  # [M, D]
        convs, ssms = [], []
        for i, layer in enumerate(self.backbone.layers):
            x, conv_i, ssm_i = layer(x, conv_state[i], ssm_state[i], spec, self.max_rows, mask, valid)  # [S or M, D]
            convs.append(conv_i)
            ssms.append(ssm_i)
        logits = self.head(self.backbone.norm_f(x[rows - 1 : rows]))  # [1, Vp] (the last real row)
        return logits, stack_limited(convs), stack_limited(ssms)  # [1, Vp], [L, E, K-1], [L, E, N]

    def forward_step(
        self, token_ids: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Unchecked decode body (what ``decode.onnx`` computes): one new token for each of B sequences.

        Args: token_ids [B] int64, conv_state [B, L, E, K-1], ssm_state [B, L, E, N] float32.
        Returns: logits [B, Vp] float32, conv_state' [B, L, E, K-1], ssm_state' [B, L, E, N].
        """
        x = F.embedding(token_ids, self.backbone.embeddings.weight).to(torch.float32)  # [B, D]
        convs, ssms = [], []
        for i, layer in enumerate(self.backbone.layers):
            x, conv_i, ssm_i = layer.step(x, conv_state[:, i], ssm_state[:, i])  # [B, D]
            convs.append(conv_i)
            ssms.append(ssm_i)
        logits = self.head(self.backbone.norm_f(x))  # [B, Vp]
        return logits, stack_limited(convs, 1), stack_limited(ssms, 1)  # [B, Vp], [B, L, E, K-1], [B, L, E, N]

    def forward_fused(
        self,
        token_ids: torch.Tensor,
        conv_state: torch.Tensor,
        ssm_state: torch.Tensor,
        decode: bool,
        kernels: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The body of the "fused" and "kernels" flavours, for both graphs (:mod:`mambatrt.export.fused_ops`): per
        layer the residual add + RMSNorm is one node; the causal conv + SiLU and the scan are one node each, from
        onnxruntime (fused) or, with ``kernels``, from mambatrt's own library, whose scan node also takes in the dt
        projection and the gate tail; so a step launches far fewer kernels than the portable graphs.

        The stream stays 2-D, R rows of [R, D] (so the matrix products keep the portable graphs' weight layout and
        share weights.bin with them); the fused ops see it as [B, T, ..]: ``decode`` -> R sequences of one row
        (B = R, T = 1), else B sequences (the states' batch) of T = R / B rows each, one after the other.

        The states come stacked, or with ``kernels`` as lists of each layer's (contract schema 4: the graph then
        splits and joins nothing) and leave the same way.

        Args: token_ids [R] int64, conv_state [B, L, E, K-1] or L x [B, E, K-1], ssm_state [B, L, E, N] or
        L x [B, E, N] float32.
        Returns: logits [B, Vp] float32 (each sequence's last row), conv_state', ssm_state' (as they came).
        """
        from mambatrt.export import fused_ops as ops

        c = self.config
        layered = isinstance(conv_state, (list, tuple))
        assert kernels or not layered, "only the kernels graphs take layered states"
        batch = (conv_state[0] if layered else conv_state).shape[0]  # B (prefill: the sequences of the launch)

        def seq(a: torch.Tensor) -> torch.Tensor:  # [R, C] -> [B, T, C] (a free Unsqueeze or Reshape)
            return a.unsqueeze(1) if decode else a.reshape(batch, -1, a.shape[-1])

        def rows(a: torch.Tensor) -> torch.Tensor:  # [B, T, C] -> [R, C] (a free Squeeze or Reshape)
            return a.squeeze(1) if decode else a.reshape(-1, a.shape[-1])

        x = F.embedding(token_ids, self.backbone.embeddings.weight).to(torch.float32)  # [R, D]
        # an fp16 model's kernels graphs keep the mixer's ends in float16: out_proj's output joins the float32
        # stream and in_proj's input leaves it in MambaAddNorm16 (no Cast per layer)
        half = kernels and self.backbone.layers[0].mixer.in_proj.weight.dtype == torch.float16
        out = None
        convs, ssms = [], []
        # stacked states: one Split per state rather than a Gather per layer. mambatrt's ops take a layer's
        # [B, 1, E, ..] as the Split gives it (and give the same back, so the outputs join in one Concat);
        # onnxruntime's ops want [B, E, ..] (a Squeeze each way) and LinearAttention's [B, E, N, 1]
        if layered:  # L x [B, E, K-1], L x [B, E, N]
            conv_in, ssm_in = list(conv_state), list(ssm_state)
        else:  # L x [B, (1,) E, K-1], L x [B, (1,) E, N] (or [B, E, N, 1])
            conv_in = [s if kernels else s.squeeze(1) for s in conv_state.split(1, dim=1)]
            ssm_in = [s if kernels else s.squeeze(1).unsqueeze(-1) for s in ssm_state.split(1, dim=1)]
        for i, layer in enumerate(self.backbone.layers):
            m = layer.mixer
            if out is None:
                h = layer.norm(x)  # [R, D] (onnxruntime forms one SimplifiedLayerNormalization)
            elif half:
                h, x = ops.add_rms_norm16(out, x, layer.norm.weight, layer.norm.eps)  # [R, D] float16, float32
            else:
                h, x = ops.skip_rms_norm(out, x, layer.norm.weight, layer.norm.eps)  # [R, D] each
            bias = m.conv1d.bias if m.conv1d.bias is not None else torch.zeros(c.d_inner)
            if kernels:
                out, conv_i, ssm_i = self._mixer_kernels(m, h, bias, conv_in[i], ssm_in[i], seq, rows, half, decode)
                convs.append(conv_i)
                ssms.append(ssm_i)
                continue
            xs, z = _linear(h, m.in_proj).split(c.d_inner, dim=-1)  # [R, E] each
            rows_last = xs.unsqueeze(-1) if decode else seq(xs).transpose(1, 2)  # [B, E, T]
            xc, conv_i = ops.causal_conv(rows_last, m.conv1d.weight, bias, conv_in[i])  # [B, E, T], [B, E, K-1]
            xc = xc.squeeze(-1) if decode else rows(xc.transpose(1, 2))  # [R, E]
            dt, b_in, c_out, a_mat = m._ssm_inputs(xc, "plain")  # [R, E], [R, N] x2, [E, N]
            decay = (dt[..., None] * a_mat).flatten(1)  # [R, E*N]
            y, ssm_i = ops.gated_scan(seq(c_out), seq(b_in), seq(dt * xc), ssm_in[i], seq(decay))  # [B, T, E]
            y = rows(y)  # [R, E]
            out = m._output(y, xc, z)  # [R, D]
            convs.append(conv_i)
            ssms.append(ssm_i.squeeze(-1))
        if not decode:  # each sequence's last row is what the prefill graph returns logits for
            out, x = seq(out)[:, -1], seq(x)[:, -1]  # [B, D]
        norm = ops.add_rms_norm16 if half else ops.skip_rms_norm
        h, _ = norm(out, x, self.backbone.norm_f.weight, self.backbone.norm_f.eps)
        logits = self.head(h)  # [B, Vp]
        if layered:
            return logits, convs, ssms  # [B, Vp], L x [B, E, K-1], L x [B, E, N]
        join = torch.cat if kernels else torch.stack  # the layers' [B, 1, E, ..] (kernels) or [B, E, ..]
        return logits, join(convs, 1), join(ssms, 1)  # [B, Vp], [B, L, E, K-1], [B, L, E, N]

    @staticmethod
    def _mixer_kernels(m: MambaMixer, h: torch.Tensor, conv_bias: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor,
                       seq: Callable, rows: Callable, half: bool = False, step: bool = False):  # fmt: skip
        """One mixer through mambatrt's ops: h [R, D] (normed), conv [B, (1,) E, K-1], ssm [B, (1,) E, N] -> out_proj
        output [R, D] float32 (``half``: float16), conv', ssm' (the states' shapes as given). The matrix products run
        on the 2-D stream (so they keep the portable graphs' weight layout and share weights.bin); ``seq`` / ``rows``
        reshape between [R, C] and the ops' [B, T, C], except for a decode ``step``, whose R = B rows the ops take as
        [B, C]. The ops compute in fp32; an fp16 model's in_proj output goes to them and their y to out_proj in fp16
        (MambaConv16, MambaScan16: no casts between)."""
        from mambatrt.export import fused_ops as ops

        if step:  # [B, C] as it is: no Unsqueeze or Squeeze nodes
            seq = rows = _same
        f32 = torch.float32
        w = m.in_proj.weight
        if w.dtype == torch.float16:
            xz = seq(F.linear(h.to(w.dtype), w, m.in_proj.bias))  # [B, T, 2E] float16
        else:
            xz = seq(_linear(h, m.in_proj))  # [B, T, 2E] float32
        u, conv = ops.mamba_conv(xz, m.conv1d.weight[:, 0, :].to(f32), conv_bias.to(f32), conv)  # [B, (T,) E]
        xdbl = seq(_linear(rows(u), m.x_proj))  # [B, T, R+2N]
        dt_proj = m.dt_proj
        y, ssm = ops.mamba_scan(  # [B, (T,) E], [B, 1, E, N]
            u, xdbl, dt_proj.weight.to(f32), dt_proj.bias.to(f32), -torch.exp(m.A_log.to(f32)), m.D.to(f32), xz, ssm
        )
        if half:  # out_proj's float16 output goes to MambaAddNorm16 as it is
            return F.linear(rows(y), m.out_proj.weight, m.out_proj.bias), conv, ssm
        return _linear(rows(y), m.out_proj), conv, ssm

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits [S, Vp] float32 of normed rows h [S, D] (tied: the embedding matrix)."""
        w = self.backbone.embeddings.weight if self.lm_head is None else self.lm_head.weight  # [Vp, D]
        # one Gemm (transB) on the weight as stored, shared with the embedding's Gather: no transposed copy. Its
        # earlier form, w @ h^T between two Transposes, becomes onnxruntime's FusedMatMul on the CPU, far slower at
        # batch 1 (BENCHMARKS.md, session 14)
        return F.linear(h.to(w.dtype), w).to(torch.float32)  # [S, Vp]

    def rows(
        self, token_ids: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor, scan: str = DEFAULT_SCAN
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


def _state_args(states: tuple, layered: bool) -> tuple:
    """A graph's state arguments as forward_fused takes them: (conv, ssm) stacked, or (L convs, L ssms)."""
    if not layered:
        return states
    half = len(states) // 2
    return list(states[:half]), list(states[half:])


def _flat(out: tuple) -> tuple:
    """forward_fused's (logits, conv, ssm) as the graph's outputs: layered states flattened, conv states first."""
    logits, conv, ssm = out
    return (logits, *conv, *ssm) if isinstance(conv, list) else out


class DecodeGraph(nn.Module):
    """What ``decode.onnx`` computes: :meth:`MambaLM.forward_step` for B sequences (contract schema 2); the
    "fused" flavour computes the same through :meth:`MambaLM.forward_fused`."""

    def __init__(self, model: MambaLM, flavour: str = "portable", layered: bool = False) -> None:
        super().__init__()
        self.model = model
        self.flavour = flavour
        self.layered = layered  # the states one tensor per layer and kind (schema 4's kernels graphs)

    def forward(self, token_ids, states: list):
        """token_ids [B], states [conv_state [B, L, E, K-1], ssm_state [B, L, E, N]] -> logits [B, Vp],
        conv_state_out, ssm_state_out; a layered graph (:attr:`layered`) takes and gives each layer's states."""
        if self.flavour != "portable":
            conv, ssm = _state_args(states, self.layered)
            kernels = self.flavour == "kernels"
            return _flat(self.model.forward_fused(token_ids, conv, ssm, decode=True, kernels=kernels))
        return self.model.forward_step(token_ids, *states)


class PrefillGraph(nn.Module):
    """What ``prefill.onnx`` computes: :meth:`MambaLM.forward_rows` with the prefill scan ``scan``, on the states of
    one sequence with the batch axis of the contract ([1, L, E, K-1] and [1, L, E, N]); the fused and kernels
    flavours take B sequences of T rows each (token_ids [B x T], states [B, ..]; contract schema 3)."""

    def __init__(self, model: MambaLM, scan: str = DEFAULT_SCAN, flavour: str = "portable", layered: bool = False):
        super().__init__()
        self.model = model
        self.scan = scan_spec(scan)
        self.flavour = flavour
        self.layered = layered  # as DecodeGraph's

    def forward(self, token_ids, states: list):
        """token_ids [S], states [conv_state [B, L, E, K-1], ssm_state [B, L, E, N]] -> logits [B, Vp] (each
        sequence's last row), conv_state_out, ssm_state_out (portable: B = 1); a layered graph takes and gives each
        layer's states."""
        if self.flavour != "portable":  # B sequences of T = S / B rows; the fused scans take any T, no padding
            conv, ssm = _state_args(states, self.layered)
            kernels = self.flavour == "kernels"
            return _flat(self.model.forward_fused(token_ids, conv, ssm, decode=False, kernels=kernels))
        conv_state, ssm_state = states
        logits, conv, ssm = self.model.forward_rows(token_ids, conv_state[0], ssm_state[0], self.scan)
        return logits, conv.unsqueeze(0), ssm.unsqueeze(0)


__all__ = ["MambaLM", "DecodeGraph", "PrefillGraph", "precision_dtype", "PRECISIONS"]
