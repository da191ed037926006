"""onnxruntime CUDA EP (IOBinding, states on the device in alternating buffers): same tokens and states as CPU/HF."""

import numpy as np
import pytest

from mambatrt.runtime.backends import OrtCudaBackend, open_backend
from mambatrt.runtime.bundle import load_bundle
from mambatrt.runtime.generate import Generator, Sampling
from mambatrt.testing import assert_close, hf_greedy

ort = pytest.importorskip("onnxruntime")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        "CUDAExecutionProvider" not in ort.get_available_providers(),
        reason="onnxruntime has no CUDA execution provider here (needs onnxruntime-gpu and a GPU)",
    ),
]


@pytest.mark.parametrize("prompt_len", [1, 63, 64, 65, 130])
def test_cuda_split_and_single_equal_cpu_and_hf(bundle_factory, checkpoint_factory, prompt_len):
    prompt = np.random.default_rng(prompt_len).integers(0, 203, prompt_len).tolist()
    tokens = {}
    for layout in ("split", "single"):
        for device in ("cuda", "cpu"):
            bundle = load_bundle(bundle_factory("tiny-odd", layout, engines="none"))
            gen = Generator(open_backend(bundle, "ort", device), eos_id=0)
            tokens[layout, device] = gen.generate(prompt, Sampling(max_new_tokens=12)).tokens
    want = hf_greedy(checkpoint_factory("tiny-odd"), prompt, 12)
    print(tokens, want)
    assert all(t == want for t in tokens.values())


def test_cuda_states_equal_token_by_token(bundle_factory):
    bundle = load_bundle(bundle_factory("tiny-odd", "split", engines="none"))
    backend = OrtCudaBackend(bundle)
    prompt = np.random.default_rng(3).integers(0, 203, 130)
    gen = Generator(backend)
    gen.reset()
    chunked_logits, _ = gen.prefill(prompt)
    chunked = backend.get_state()
    slow = Generator(backend, token_by_token=True)
    slow.reset()
    steps_logits, launches = slow.prefill(prompt)
    steps = backend.get_state()
    assert launches == 130
    assert_close("cuda logits chunked vs steps", chunked_logits, steps_logits, 1e-5)
    assert_close("cuda conv state", chunked[0], steps[0], 1e-5)
    assert_close("cuda ssm state", chunked[1], steps[1], 1e-5)
    backend.set_state(*chunked)
    assert_close("set_state round trip", backend.get_state()[1], chunked[1], 0.0)


def test_cuda_graph_decode_equals_plain_runs(bundle_factory):
    """Decode steps and full prefill chunks replayed as captured CUDA graphs == node-by-node runs, across set_state."""
    bundle = load_bundle(bundle_factory("tiny-odd", "split", engines="none"))
    graphed, plain = OrtCudaBackend(bundle, cuda_graph=True), OrtCudaBackend(bundle, cuda_graph=False)
    print(graphed.captured, graphed.notes)
    assert graphed.captured["decode"], graphed.notes
    assert not any(plain.captured.values())
    prompt = np.random.default_rng(5).integers(0, 203, 134)  # 64 + 64 (both parities) + 6 rows
    runs = {}
    for name, backend in (("graphed", graphed), ("plain", plain)):
        gen = Generator(backend)
        first = gen.generate(prompt, Sampling(max_new_tokens=20, stop_on_eos=False))
        state = backend.get_state()
        more = gen.generate([7, 8, 9], Sampling(max_new_tokens=9, stop_on_eos=False), reset=False)
        backend.set_state(*state)  # rewind: the captured graphs must read the new values at the same addresses
        gen.pending = first.tokens[-1]
        again = gen.generate([7, 8, 9], Sampling(max_new_tokens=9, stop_on_eos=False), reset=False)
        logits = backend.run("decode", [11])
        runs[name] = (first.tokens, more.tokens, again.tokens, logits)
    print({k: v[:3] for k, v in runs.items()})
    assert runs["graphed"][:3] == runs["plain"][:3]
    assert runs["graphed"][1] == runs["graphed"][2]
    assert_close("captured vs plain decode logits", runs["graphed"][3], runs["plain"][3], 1e-5)
