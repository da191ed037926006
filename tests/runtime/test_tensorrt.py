"""TensorRT backend: plans give the tokens and states of onnxruntime. Needs a TensorRT runtime that runs plans."""

import numpy as np
import pytest

from mambatrt.runtime.backends import OrtCpuBackend, TrtBackend, tensorrt_runtime_available
from mambatrt.runtime.bundle import load_bundle
from mambatrt.runtime.generate import Generator, Sampling
from mambatrt.testing import assert_close

REASON = tensorrt_runtime_available()
pytestmark = [pytest.mark.tensorrt, pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=str(REASON))]


@pytest.mark.parametrize("layout", ["split", "single"])
@pytest.mark.parametrize("prompt_len", [1, 64, 65, 130])
def test_trt_generation_equals_ort(bundle_factory, layout, prompt_len):
    bundle = load_bundle(bundle_factory("tiny-odd", layout, plans="auto"))
    prompt = np.random.default_rng(prompt_len).integers(0, 203, prompt_len)
    trt, ort = TrtBackend(bundle), OrtCpuBackend(bundle)
    try:
        got = Generator(trt).generate(prompt, Sampling(max_new_tokens=10))
        want = Generator(ort).generate(prompt, Sampling(max_new_tokens=10))
        assert got.tokens == want.tokens
        trt_state, ort_state = trt.get_state(), ort.get_state()
        assert_close("trt vs ort ssm state", trt_state[1], ort_state[1], 1e-4)
        assert_close("trt vs ort conv state", trt_state[0], ort_state[0], 1e-4)
    finally:
        trt.close()
