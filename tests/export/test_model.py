"""The PyTorch model equals transformers' MambaForCausalLM; chunked prefill equals single steps; resuming works."""

import numpy as np
import pytest
import torch

from mambatrt.errors import InputError
from mambatrt.export.checkpoint import load_model
from mambatrt.export.model import SCANS
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
    _, conv64, ssm64 = model.rows(ids[:64], conv, ssm, scan="blocked")
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
    with pytest.raises(InputError, match="unknown prefill scan 'hillis-steele'; choose from blocked, sequential"):
        model.rows(torch.tensor([1, 2]), *zero, scan="hillis-steele")


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_kernels_path_equals_portable(checkpoint_factory, name):
    """forward_kernels (the kernels flavour's body, eager ops, each layer's states a tensor of their own) ==
    forward_rows for prompts (one, and three at once) and forward_step for a batch."""
    model = load_model(checkpoint_factory(name))
    v, c = model.config.vocab_size, model.config
    ids = _prompt(v, 3 * 37, seed=5)
    conv0, ssm0 = (torch.randn(3, *s) * 0.1 for s in (c.conv_state_shape, c.ssm_state_shape))  # [3, L, E, ..]
    logits, convs, ssms = model.forward_kernels(ids, list(conv0.unbind(1)), list(ssm0.unbind(1)), decode=False)
    assert logits.shape == (3, c.vocab_padded) and len(convs) == len(ssms) == c.n_layer
    for i in range(3):  # three prompts of 37 rows in one launch, each as forward_rows computes it alone
        want = model.forward_rows(ids[37 * i : 37 * (i + 1)], conv0[i], ssm0[i], "sequential")
        got = (logits[i : i + 1], torch.stack([s[i] for s in convs]), torch.stack([s[i] for s in ssms]))
        for what, a, b in zip(("logits", "conv", "ssm"), got, want, strict=True):
            assert_close(f"{name} kernels prefill {i} {what}", a, b, RTOL_FP32)
    batch = _prompt(v, 5, seed=6)
    convs, ssms = conv0[:1].expand(5, -1, -1, -1) * torch.rand(5, 1, 1, 1), ssm0[:1].expand(5, -1, -1, -1).clone()
    want = model.forward_step(batch, convs, ssms)
    logits, conv_out, ssm_out = model.forward_kernels(batch, list(convs.unbind(1)), list(ssms.unbind(1)), decode=True)
    for what, a, b in zip(
        ("logits", "conv", "ssm"), (logits, torch.stack(conv_out, 1), torch.stack(ssm_out, 1)), want, strict=True
    ):
        assert_close(f"{name} kernels decode {what}", a, b, RTOL_FP32)
