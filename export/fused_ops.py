"""Fused Mamba ops as torch custom ops: onnxruntime's (domain com.microsoft) for the "fused" graph flavour, and
mambatrt's own (domain mambatrt, compile/kernels/) for the "kernels" flavour.

onnxruntime ships CPU and CUDA kernels that cover most of a Mamba-1 layer in three nodes; TensorRT's parser does not
know them, so the graphs that use them are a second flavour beside the portable ones (see
:meth:`mambatrt.export.model.MambaLM.forward_fused`). Each op here has

- an eager implementation in plain torch (the math onnxruntime's kernel computes, so the model runs and is tested
  without onnxruntime), checked against the portable path and against onnxruntime's kernels in the tests;
- a fake implementation (shapes only, for torch.export);
- a translation for the dynamo exporter that emits the one com.microsoft node (:data:`FUSED_TRANSLATIONS`), with an
  ``OpSchema`` written here because onnxscript's schema registry predates these ops.

Ops and their onnxruntime counterparts:

    causal_conv(x [B, E, T], w [E, 1, K], b [E], past [B, E, K-1]) -> silu(conv) [B, E, T], present [B, E, K-1]
        CausalConvWithState(activation="silu")
    gated_scan(q=C [B, T, N], k=B [B, T, N], v=dt*x [B, T, E], past [B, E, N, 1], decay=dt*A [B, T, E*N])
        -> y [B, T, E], present [B, E, N, 1]
        LinearAttention(update_rule="gated", q_num_heads=1, kv_num_heads=E, scale=1): per channel e (a head with
        key size N and value size 1), h_t = exp(decay_t) * h_{t-1} + k_t v_t, y_t = q_t . h_t
    skip_rms_norm(x [.., D], skip [.., D], w [D], eps) -> rmsnorm(x + skip) * w, x + skip
        SkipSimplifiedLayerNormalization (its 4th output is the sum)

mambatrt's ops (the "kernels" flavour; CPU and CUDA kernels in compile/kernels/, shapes in mamba_ops.h there):

    mamba_conv(xz [B, T, 2E], w [E, K], b [E], past [B, E, K-1]) -> silu(conv of xz's x half) [B, T, E], present
        MambaConv: reads the x half of the in_proj output in place (no Split)
    mamba_scan(u [B, T, E], xdbl [B, T, R+2N], dt_w [E, R], dt_b [E], A [E, N], D [E], xz [B, T, 2E], past [B, E, N])
        -> (C . h + D u) * silu(z) [B, T, E], present [B, E, N]
        MambaScan: the dt projection, softplus, the scan and the gate tail in one kernel, rows walked in registers
    Both also take a decode step's rows as they are, [B, C] for [B, 1, C] (y then [B, E]), and a layer's states as
    a Split of the stacked states gives them, [B, 1, E, ..] (present then the same shape): a decode graph then needs
    no Squeeze or Unsqueeze around them (eight per layer, each a run of its own on the CPU provider).
    With a float16 xz (an fp16 bundle's in_proj output) they become MambaConv16 / MambaScan16, and the scan's y
    comes out in float16 for out_proj: no Cast nodes around them.
    add_rms_norm16(x [R, D] float16, residual [R, D], w [D], eps) -> rmsnorm(x + residual) * w in float16, the sum
        MambaAddNorm16: an fp16 bundle's out_proj output joins the float32 residual stream and the next in_proj's
        input leaves it in one node (eps as a one-value input), so a layer has no Cast at all
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_DOMAIN = "com.microsoft"
KERNELS_DOMAIN = "mambatrt"  # the domain compile/kernels/mamba_ops.cc registers


# -- eager and fake implementations ---------------------------------------------------------------------------
@torch.library.custom_op("mambatrt::causal_conv", mutates_args=())
def causal_conv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, past: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over the K-1 previous inputs plus this chunk, then SiLU; the new conv state."""
    k = weight.shape[-1]
    full = torch.cat([past, x], dim=-1)  # [B, E, K-1+T]
    y = F.conv1d(full, weight, bias, groups=weight.shape[0])  # [B, E, T]
    return F.silu(y), full[..., full.shape[-1] - (k - 1) :].clone()


@causal_conv.register_fake
def _(x, weight, bias, past):
    return torch.empty_like(x), torch.empty_like(past)


@torch.library.custom_op("mambatrt::gated_scan", mutates_args=())
def gated_scan(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: torch.Tensor, decay: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The selective scan, sequential over T (the reference the kernel must equal)."""
    b, t, e = v.shape
    n = q.shape[-1]
    h = past[..., 0]  # [B, E, N]
    a = torch.exp(decay.reshape(b, t, e, n))  # [B, T, E, N]
    ys = []
    for i in range(t):
        h = a[:, i] * h + v[:, i, :, None] * k[:, i, None, :]  # [B, E, N]
        ys.append((h * q[:, i, None, :]).sum(-1))  # [B, E]
    return torch.stack(ys, dim=1), h[..., None].clone()  # [B, T, E], [B, E, N, 1]


@gated_scan.register_fake
def _(q, k, v, past, decay):
    return torch.empty_like(v), torch.empty_like(past)


@torch.library.custom_op("mambatrt::skip_rms_norm", mutates_args=())
def skip_rms_norm(
    x: torch.Tensor, skip: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of the residual sum, and the sum (the new residual stream)."""
    s = x + skip
    return s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + eps) * weight, s.clone()


@skip_rms_norm.register_fake
def _(x, skip, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("mambatrt::add_rms_norm16", mutates_args=())
def add_rms_norm16(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual sum (float32) of a float16 x, and its RMSNorm in float16: what MambaAddNorm16 computes."""
    s = x.to(torch.float32) + residual
    return (s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + eps) * weight).to(torch.float16), s


@add_rms_norm16.register_fake
def _(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(residual)


def _as_rows(a: torch.Tensor, rank: int) -> torch.Tensor:
    """A decode step's [B, C] as [B, 1, C] (rank 2), a layer's [B, 1, E, ..] state as [B, E, ..] (rank 4)."""
    return a[:, None] if rank == 2 else (a[:, 0] if rank == 4 else a)


def _as_given(a: torch.Tensor, rank: int) -> torch.Tensor:
    """The inverse of :func:`_as_rows`: a result in the rank its input came in."""
    return a[:, 0] if rank == 2 else (a[:, None] if rank == 4 else a)


@torch.library.custom_op("mambatrt::mamba_conv", mutates_args=())
def mamba_conv(
    xz: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, past: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU of the depthwise causal conv of xz's first E columns after the K-1 past columns; the new conv state."""
    e, k = weight.shape
    x = _as_rows(xz, xz.dim())[..., :e].to(torch.float32).transpose(1, 2)  # [B, E, T] (xz may be float16)
    full = torch.cat([_as_rows(past, past.dim()), x], dim=-1)  # [B, E, K-1+T]
    y = F.silu(F.conv1d(full, weight[:, None, :], bias, groups=e)).transpose(1, 2)  # [B, T, E]
    present = full[..., full.shape[-1] - (k - 1) :]  # [B, E, K-1]
    return _as_given(y, xz.dim()).contiguous(), _as_given(present, past.dim()).contiguous()


@mamba_conv.register_fake
def _(xz, weight, bias, past):
    return xz.new_empty(*xz.shape[:-1], weight.shape[0], dtype=torch.float32), torch.empty_like(past)


@torch.library.custom_op("mambatrt::mamba_scan", mutates_args=())
def mamba_scan(
    u: torch.Tensor,
    xdbl: torch.Tensor,
    dt_weight: torch.Tensor,
    dt_bias: torch.Tensor,
    a: torch.Tensor,
    d: torch.Tensor,
    xz: torch.Tensor,
    past: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """dt projection + softplus, the selective scan (sequential over T) and the gate: what MambaScan computes."""
    e, n = a.shape
    r = dt_weight.shape[1]
    given = u.dim()
    u, xdbl, xz = (_as_rows(t, given) for t in (u, xdbl, xz))  # [B, T, ..]
    dt = F.softplus(xdbl[..., :r] @ dt_weight.transpose(0, 1) + dt_bias)  # [B, T, E]
    b_in, c_out = xdbl[..., r : r + n], xdbl[..., r + n :]  # [B, T, N] each
    z = xz[..., xz.shape[-1] - e :].to(torch.float32)  # [B, T, E]
    h = _as_rows(past, past.dim())  # [B, E, N]
    ys = []
    for i in range(u.shape[1]):
        h = torch.exp(dt[:, i, :, None] * a) * h + (dt[:, i] * u[:, i])[..., None] * b_in[:, i, None, :]
        ys.append((h * c_out[:, i, None, :]).sum(-1))  # [B, E]
    y = torch.stack(ys, dim=1)  # [B, T, E]
    y = ((y + d * u) * F.silu(z)).to(xz.dtype)  # in xz's dtype (MambaScan16: float16)
    return _as_given(y, given).contiguous(), _as_given(h, past.dim()).contiguous()


@mamba_scan.register_fake
def _(u, xdbl, dt_weight, dt_bias, a, d, xz, past):
    return torch.empty_like(u, dtype=xz.dtype), torch.empty_like(past)


# -- exporter translations -----------------------------------------------------------------------------------
def _op(
    name: str,
    inputs: list[str],
    outputs: list[str],
    attributes: dict[str, str],
    domain: str = _DOMAIN,
    mixed: bool = False,
):
    """An onnxscript op of ``domain`` with a schema of our own (float types; attributes by kind). ``mixed``: each
    input and output has a float type of its own (MambaConv16 takes float16 and gives float32), else one for all."""
    import onnxscript
    from onnx.defs import OpSchema

    kinds = {"int": OpSchema.AttrType.INT, "float": OpSchema.AttrType.FLOAT, "str": OpSchema.AttrType.STRING}
    floats = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]
    params = inputs + outputs
    types = [f"T{i}" if mixed else "T" for i in range(len(params))]
    schema = OpSchema(
        name,
        domain,
        1,
        inputs=[OpSchema.FormalParameter(p, t) for p, t in zip(inputs, types, strict=False)],
        outputs=[OpSchema.FormalParameter(p, t) for p, t in zip(outputs, types[len(inputs) :], strict=True)],
        type_constraints=[(t, floats, "float tensors") for t in dict.fromkeys(types)],
        attributes=[OpSchema.Attribute(a, kinds[k], "") for a, k in attributes.items()],
    )
    return onnxscript.values.Op(onnxscript.values.Opset(domain, 1), name, schema)


def _causal_conv_onnx(x, weight, bias, past):
    conv = _op("CausalConvWithState", ["input", "weight", "bias", "past_state"], ["output", "present_state"],
               {"activation": "str"})  # fmt: skip
    return conv(x, weight, bias, past, activation="silu")


def _gated_scan_onnx(q, k, v, past, decay):
    scan = _op(
        "LinearAttention",
        ["query", "key", "value", "past_state", "decay"],
        ["output", "present_state"],
        {"update_rule": "str", "q_num_heads": "int", "kv_num_heads": "int", "scale": "float"},
    )
    e = v.shape[-1]
    return scan(q, k, v, past, decay, update_rule="gated", q_num_heads=1, kv_num_heads=int(e), scale=1.0)


def _skip_rms_norm_onnx(x, skip, weight, eps: float):
    norm = _op(
        "SkipSimplifiedLayerNormalization",
        ["input", "skip", "gamma"],
        ["output", "mean", "inv_std_var", "input_skip_bias_sum"],
        {"epsilon": "float"},
    )
    y, _, _, s = norm(x, skip, weight, epsilon=float(eps))
    return y, s


def _half(value) -> str:
    """The op-name suffix for an xz of this dtype: "16" for float16 (MambaConv16, MambaScan16), else ""."""
    import onnx_ir as ir

    return "16" if getattr(value, "dtype", None) == ir.DataType.FLOAT16 else ""


def _mamba_conv_onnx(xz, weight, bias, past):
    conv = _op(f"MambaConv{_half(xz)}", ["xz", "weight", "bias", "past"], ["y", "present"], {}, KERNELS_DOMAIN, True)
    return conv(xz, weight, bias, past)


def _mamba_scan_onnx(u, xdbl, dt_weight, dt_bias, a, d, xz, past):
    names = ["u", "xdbl", "dt_weight", "dt_bias", "A", "D", "xz", "past"]
    scan = _op(f"MambaScan{_half(xz)}", names, ["y", "present"], {}, KERNELS_DOMAIN, True)
    return scan(u, xdbl, dt_weight, dt_bias, a, d, xz, past)


def _add_rms_norm16_onnx(x, residual, weight, eps: float):
    from onnxscript import opset18

    norm = _op("MambaAddNorm16", ["x", "residual", "weight", "eps"], ["normed", "sum"], {}, KERNELS_DOMAIN, True)
    return norm(x, residual, weight, opset18.Constant(value_floats=[float(eps)]))


KERNELS_TRANSLATIONS = {
    torch.ops.mambatrt.add_rms_norm16.default: _add_rms_norm16_onnx,
    torch.ops.mambatrt.mamba_conv.default: _mamba_conv_onnx,
    torch.ops.mambatrt.mamba_scan.default: _mamba_scan_onnx,
    torch.ops.mambatrt.skip_rms_norm.default: _skip_rms_norm_onnx,
}

FUSED_TRANSLATIONS = {
    torch.ops.mambatrt.causal_conv.default: _causal_conv_onnx,
    torch.ops.mambatrt.gated_scan.default: _gated_scan_onnx,
    torch.ops.mambatrt.skip_rms_norm.default: _skip_rms_norm_onnx,
}
