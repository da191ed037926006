"""The PyTorch model equals transformers' MambaForCausalLM; chunked prefill equals single steps; resuming works."""

import numpy as np
import pytest
import torch

from mambatrt.errors import InputError
from mambatrt.export.checkpoint import load_model
from mambatrt.export.scans import SCANS
from mambatrt.testing import TINY_CONFIGS, assert_close, hf_reference

RTOL_FP32 = 1e-5


def _prompt(vocab: int, n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_rows_equal_hf(checkpoint_factory, name):
    ckpt = checkpoint_factory(name)
    model = load_model(ckpt)
    v = model.config.vocab_size
    ids = _prompt(v, 40, seed=3)
    logits, conv, ssm = model.prefill(ids)
    ref_logits, ref_conv, ref_ssm = hf_reference(ckpt, ids)
    assert logits.shape == (1, model.config.vocab_padded)
    assert_close(f"{name} logits vs HF", logits[0, :v], ref_logits[:v], RTOL_FP32)
    assert_close(f"{name} conv state vs HF", conv, ref_conv, RTOL_FP32)
    assert_close(f"{name} ssm state vs HF", ssm, ref_ssm, RTOL_FP32)
    assert int(logits[0, :v].argmax()) == int(np.argmax(ref_logits[:v]))


def test_75_tokens_chunked_equals_steps_equals_hf(checkpoint_factory):
    ckpt = checkpoint_factory("tiny-odd")
    model = load_model(ckpt)
    v = model.config.vocab_size
    ids = _prompt(v, 75, seed=7)
    conv, ssm = model.zero_states()
    _, conv64, ssm64 = model.rows(ids[:64], conv, ssm, scan="hillis-steele")
    chunk_logits, chunk_conv, chunk_ssm = model.rows(ids[64:], conv64, ssm64, scan="blocked")
    step_conv, step_ssm = model.zero_states()
    for t in range(75):
        step_logits, step_conv, step_ssm = model.step(ids[t : t + 1], step_conv, step_ssm)
    ref_logits, ref_conv, ref_ssm = hf_reference(ckpt, ids)
    assert_close("chunked vs steps logits", chunk_logits, step_logits, RTOL_FP32)
    assert_close("chunked vs steps conv", chunk_conv, step_conv, RTOL_FP32)
    assert_close("chunked vs steps ssm", chunk_ssm, step_ssm, RTOL_FP32)
    assert_close("chunked vs HF logits", chunk_logits[0, :v], ref_logits, RTOL_FP32)
    assert_close("chunked vs HF ssm", chunk_ssm, ref_ssm, RTOL_FP32)
    assert_close("chunked vs HF conv", chunk_conv, ref_conv, RTOL_FP32)
    tokens = {int(chunk_logits[0, :v].argmax()), int(step_logits[0, :v].argmax()), int(np.argmax(ref_logits))}
    assert len(tokens) == 1


@pytest.mark.parametrize("scan", list(SCANS))
@pytest.mark.parametrize("split", [1, 5, 31, 63])
def test_resume_rows_equals_whole(checkpoint_factory, split, scan):
    model = load_model(checkpoint_factory("tiny"))
    ids = _prompt(model.config.vocab_size, 64, seed=split)
    zero = model.zero_states()
    whole = model.rows(ids, *zero, scan="sequential")
    _, conv, ssm = model.rows(ids[:split], *zero, scan=scan)
    resumed = model.rows(ids[split:], conv, ssm, scan=scan)
    for name, got, want in zip(("logits", "conv", "ssm"), resumed, whole, strict=True):
        assert_close(f"resume at {split}: {name}", got, want, RTOL_FP32)


def test_bad_rows_are_refused(tiny_checkpoint):
    model = load_model(tiny_checkpoint)
    zero = model.zero_states()
    v = model.config.vocab_size
    with pytest.raises(InputError, match="exceeds the limit of 64 rows"):
        model.rows(torch.zeros(65, dtype=torch.int64), *zero)
    with pytest.raises(InputError, match="empty chunk"):
        model.rows(torch.zeros(0, dtype=torch.int64), *zero)
    with pytest.raises(InputError, match=f"token id {v} is outside the vocabulary"):
        model.rows(torch.tensor([1, v]), *zero)
    with pytest.raises(InputError, match="token id -1"):
        model.step(torch.tensor([-1]), *zero)
    with pytest.raises(InputError, match="limit of 1 rows"):
        model.step(torch.tensor([1, 2]), *zero)
    with pytest.raises(InputError, match="empty prompt"):
        model.prefill(torch.zeros(0, dtype=torch.int64))


def test_softplus_exp_log_equals_torch():
    """The prefill graph's softplus equals torch's over the whole float32 range (threshold 20, no inf above 88)."""
    from mambatrt.export.model import softplus_exp_log

    x = torch.cat([torch.linspace(-120.0, 120.0, 20001), torch.tensor([-1e30, 1e30, 19.999, 20.0, 20.001, 88.8])])
    got, want = softplus_exp_log(x), torch.nn.functional.softplus(x)
    excess = (got - want).abs() / (2e-7 + 1e-7 * want.abs())  # absolute 2e-7 near 0, about one rounding above
    print(f"worst |softplus_exp_log - softplus| / (2e-7 + 1e-7 |softplus|) = {excess.max().item():.3g}")
    assert torch.isfinite(got).all() and excess.max() <= 1.0


@pytest.mark.parametrize("kernels", [False, True], ids=["fused", "kernels"])
@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_fused_path_equals_portable(checkpoint_factory, name, kernels):
    """forward_fused (the fused and kernels flavours' body, eager ops) == forward_rows for a prompt and
    forward_step for a batch."""
    model = load_model(checkpoint_factory(name))
    v = model.config.vocab_size
    flavour = "kernels" if kernels else "fused"
    ids = _prompt(v, 37, seed=5)
    conv0, ssm0 = (torch.randn(s) * 0.1 for s in (model.config.conv_state_shape, model.config.ssm_state_shape))
    want = model.forward_rows(ids, conv0, ssm0, "sequential")
    got = model.forward_fused(ids, conv0[None], ssm0[None], decode=False, kernels=kernels)
    for what, a, b in zip(("logits", "conv", "ssm"), got, want, strict=True):
        assert_close(f"{name} {flavour} prefill {what}", a[0], b[0] if what == "logits" else b, RTOL_FP32)
    batch = _prompt(v, 5, seed=6)
    convs, ssms = conv0.expand(5, *conv0.shape) * torch.rand(5, 1, 1, 1), ssm0.expand(5, *ssm0.shape).clone()
    want = model.forward_step(batch, convs, ssms)
    got = model.forward_fused(batch, convs, ssms, decode=True, kernels=kernels)
    for what, a, b in zip(("logits", "conv", "ssm"), got, want, strict=True):
        assert_close(f"{name} {flavour} decode {what}", a, b, RTOL_FP32)
