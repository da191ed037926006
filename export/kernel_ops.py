"""mambatrt's own Mamba ops as torch custom ops: the "kernels" graph flavour's nodes (domain mambatrt; CPU and CUDA
kernels in compile/kernels/, shapes in mamba_ops.h there), used by :meth:`.model.MambaLM.forward_kernels`.

Each op here has
- an eager implementation in plain torch (the math the library's kernel computes, so the model runs and is tested
  without the library), checked against the portable path in the tests and against the kernels in the runtime's;
- a fake implementation (shapes only, for torch.export);
- a translation for the dynamo exporter that emits the one node (:data:`KERNELS_TRANSLATIONS`), with an ``OpSchema``
  written here because onnxscript's schema registry does not know these ops.

    mamba_conv(xz [B, T, 2E], w [E, K], b [E], past [B, E, K-1]) -> silu(conv of xz's x half) [B, T, E], present
        MambaConv: reads the x half of the in_proj output in place (no Split)
    mamba_scan(u [B, T, E], xdbl [B, T, R+2N], dt_w [E, R], dt_b [E], A [E, N], D [E], xz [B, T, 2E], past [B, E, N])
        -> (C . h + D u) * silu(z) [B, T, E], present [B, E, N]
        MambaScan: the dt projection, softplus, the scan and the gate tail in one kernel, rows walked in registers
    Both also take a decode step's rows as they are, [B, C] for [B, 1, C] (y then [B, E]): a decode graph needs no
    Squeeze or Unsqueeze around them. With a float16 xz (an fp16 bundle's in_proj output) they become MambaConv16 /
    MambaScan16, and the scan's y comes out in float16 for out_proj: no Cast nodes around them.
    add_rms_norm16(x [R, D] float16, residual [R, D], w [D], eps) -> rmsnorm(x + residual) * w in float16, the sum
        MambaAddNorm16: an fp16 bundle's out_proj output joins the float32 residual stream and the next in_proj's
        input leaves it in one node (eps as a one-value input), so a layer has no Cast at all
    skip_rms_norm(x [R, D], skip [R, D], w [D], eps) -> rmsnorm(x + skip) * w, x + skip
        onnxruntime's com.microsoft SkipSimplifiedLayerNormalization (its 4th output is the sum): the same for fp32
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ORT_DOMAIN = "com.microsoft"  # onnxruntime's contrib ops (SkipSimplifiedLayerNormalization)
KERNELS_DOMAIN = "mambatrt"  # the domain the kernels library registers its ops in (compile/kernels/ort_ops.cc)


# -- eager and fake implementations ---------------------------------------------------------------------------
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


def _as_rows(a: torch.Tensor) -> torch.Tensor:
    """A decode step's [B, C] as [B, 1, C]; [B, T, C] as it is."""
    return a[:, None] if a.dim() == 2 else a


def _as_given(a: torch.Tensor, rank: int) -> torch.Tensor:
    """The inverse of :func:`_as_rows`: a [B, T, C] result in the rank its input came in."""
    return a[:, 0] if rank == 2 else a


@torch.library.custom_op("mambatrt::mamba_conv", mutates_args=())
def mamba_conv(
    xz: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, past: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU of the depthwise causal conv of xz's first E columns after the K-1 past columns; the new conv state."""
    e, k = weight.shape
    x = _as_rows(xz)[..., :e].to(torch.float32).transpose(1, 2)  # [B, E, T] (xz may be float16)
    full = torch.cat([past, x], dim=-1)  # [B, E, K-1+T]
    y = F.silu(F.conv1d(full, weight[:, None, :], bias, groups=e)).transpose(1, 2)  # [B, T, E]
    present = full[..., full.shape[-1] - (k - 1) :]  # [B, E, K-1]
    return _as_given(y, xz.dim()).contiguous(), present.contiguous()


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
    u, xdbl, xz = (_as_rows(t) for t in (u, xdbl, xz))  # [B, T, ..]
    dt = F.softplus(xdbl[..., :r] @ dt_weight.transpose(0, 1) + dt_bias)  # [B, T, E]
    b_in, c_out = xdbl[..., r : r + n], xdbl[..., r + n :]  # [B, T, N] each
    z = xz[..., xz.shape[-1] - e :].to(torch.float32)  # [B, T, E]
    h = past  # [B, E, N]
    ys = []
    for i in range(u.shape[1]):
        h = torch.exp(dt[:, i, :, None] * a) * h + (dt[:, i] * u[:, i])[..., None] * b_in[:, i, None, :]
        ys.append((h * c_out[:, i, None, :]).sum(-1))  # [B, E]
    y = torch.stack(ys, dim=1)  # [B, T, E]
    y = ((y + d * u) * F.silu(z)).to(xz.dtype)  # in xz's dtype (MambaScan16: float16)
    return _as_given(y, given).contiguous(), h.contiguous()


@mamba_scan.register_fake
def _(u, xdbl, dt_weight, dt_bias, a, d, xz, past):
    return torch.empty_like(u, dtype=xz.dtype), torch.empty_like(past)


# -- exporter translations -----------------------------------------------------------------------------------
def _op(
    name: str,
    inputs: list[str],
    outputs: list[str],
    attributes: dict[str, str],
    domain: str = ORT_DOMAIN,
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
