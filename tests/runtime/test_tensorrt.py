"""TensorRT runner: plans give the tokens and states of onnxruntime, one sequence and served in slots. Needs a
TensorRT runtime that runs plans (skipped with its reason elsewhere)."""

import threading

import numpy as np
import pytest

from mambatrt.runtime.bundle import load_bundle
from mambatrt.runtime.engine import Engine, EngineConfig, Request, Sampling
from mambatrt.runtime.runners.ort.cpu import OrtCpuRunner
from mambatrt.runtime.runners.trt.loader import tensorrt_runtime_available
from mambatrt.testing import ReferenceLoop, assert_close

REASON = tensorrt_runtime_available()
pytestmark = [pytest.mark.tensorrt, pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=str(REASON))]


@pytest.mark.parametrize("layout", ["split", "single"])
@pytest.mark.parametrize("prompt_len", [1, 64, 65, 130])
def test_trt_generation_equals_ort(bundle_factory, layout, prompt_len):
    from mambatrt.runtime.runners.trt.runner import TrtRunner

    bundle = load_bundle(bundle_factory("tiny-odd", layout, plans="auto"))
    prompt = np.random.default_rng(prompt_len).integers(0, 203, prompt_len)
    trt, ort = TrtRunner(bundle), OrtCpuRunner(bundle)
    try:
        got = ReferenceLoop(trt).generate(prompt, Sampling(max_new_tokens=10))
        want = ReferenceLoop(ort).generate(prompt, Sampling(max_new_tokens=10))
        assert got == want
        trt_state, ort_state = trt.get_state(), ort.get_state()
        assert_close("trt vs ort ssm state", trt_state[1], ort_state[1], 1e-4)
        assert_close("trt vs ort conv state", trt_state[0], ort_state[0], 1e-4)
    finally:
        trt.close()


@pytest.mark.parametrize("layout", ["split", "single"])
def test_trt_slots_serve_each_prompt_as_alone(bundle_factory, layout):
    """The TensorRT slot pool: concurrent prompts of mixed lengths in slots, with the prefix cache, each give the
    tokens they give alone on onnxruntime."""
    from mambatrt.runtime.runners.trt.runner import TrtRunner

    bundle = load_bundle(bundle_factory("tiny-odd", layout, plans="auto"))
    prompts = [np.random.default_rng(n).integers(0, 203, n).tolist() for n in (1, 63, 64, 65, 130, 7)]
    sampling = Sampling(max_new_tokens=8, stop_on_eos=False)
    want = [ReferenceLoop(OrtCpuRunner(bundle)).generate(p, sampling) for p in prompts]
    got, done = {i: [] for i in range(len(prompts))}, threading.Semaphore(0)
    with TrtRunner(bundle) as runner:
        engine = Engine(runner, EngineConfig(max_batch=4, cache_bytes=2**24)).start()
        try:
            for rounds in range(2):  # the second round starts from cached states
                for i, p in enumerate(prompts):
                    got[i] = []
                    engine.submit(Request(p, sampling, lambda e, i=i: _collect(e, got[i], done)))
                assert all(done.acquire(timeout=120) for _ in prompts)
                print(rounds, got, want)
                assert [got[i] for i in range(len(prompts))] == want
        finally:
            engine.stop()


def _collect(event, tokens: list, done: threading.Semaphore) -> None:
    if event.token is not None:
        tokens.append(event.token)
    if event.finish_reason is not None:
        done.release()
