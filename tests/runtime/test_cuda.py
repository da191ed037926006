"""onnxruntime's CUDA runner and slot pool (IOBinding, states on the device in alternating buffers, captured CUDA
graphs, the kernels graphs on streams of their own): the tokens and states of the CPU and of HF."""

import numpy as np
import pytest

from mambatrt.contract import PREFILL
from mambatrt.errors import InputError
from mambatrt.runtime.bundle import load_bundle
from mambatrt.runtime.engine import Engine, EngineConfig, Sampling
from mambatrt.runtime.runners import open_runner
from mambatrt.runtime.runners.ort.cpu import OrtCpuRunner
from mambatrt.runtime.runners.ort.cuda import OrtCudaRunner, PlainGraph
from mambatrt.testing import ReferenceLoop, assert_close, hf_greedy

ort = pytest.importorskip("onnxruntime")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        "CUDAExecutionProvider" not in ort.get_available_providers(),
        reason="onnxruntime has no CUDA execution provider here (needs onnxruntime-gpu and a GPU)",
    ),
]


def _plain(runner: OrtCudaRunner) -> OrtCudaRunner:
    """``runner`` with its graphs run node by node (the fallback where onnxruntime cannot capture): the reference
    the captured replays are held to. A slot pool opened on it runs its launches plainly too."""
    runner.graph_runners = {graph: PlainGraph(runner, graph) for graph in runner.graphs}
    runner.reset()
    return runner


@pytest.mark.parametrize("prompt_len", [1, 63, 64, 65, 130])
def test_cuda_split_and_single_equal_cpu_and_hf(bundle_factory, checkpoint_factory, prompt_len):
    prompt = np.random.default_rng(prompt_len).integers(0, 203, prompt_len).tolist()
    tokens = {}
    for layout in ("split", "single"):
        for device in ("cuda", "cpu"):
            bundle = load_bundle(bundle_factory("tiny-odd", layout, plans="none"))
            gen = ReferenceLoop(open_runner(bundle, device), eos_id=0)
            tokens[layout, device] = gen.generate(prompt, Sampling(max_new_tokens=12))
    want = hf_greedy(checkpoint_factory("tiny-odd"), prompt, 12)
    print(tokens, want)
    assert all(t == want for t in tokens.values())


def test_cuda_states_equal_token_by_token(bundle_factory):
    bundle = load_bundle(bundle_factory("tiny-odd", "split", plans="none"))
    backend = OrtCudaRunner(bundle)
    prompt = np.random.default_rng(3).integers(0, 203, 130)
    gen = ReferenceLoop(backend)
    backend.reset()
    chunked_logits = gen.prefill(prompt)
    chunked = backend.get_state()
    slow = ReferenceLoop(backend, token_by_token=True)
    backend.reset()
    steps_logits = slow.prefill(prompt)
    steps = backend.get_state()
    assert slow.prefill_launches == 130
    assert_close("cuda logits chunked vs steps", chunked_logits, steps_logits, 1e-5)
    assert_close("cuda conv state", chunked[0], steps[0], 1e-5)
    assert_close("cuda ssm state", chunked[1], steps[1], 1e-5)
    backend.set_state(*chunked)
    assert_close("set_state round trip", backend.get_state()[1], chunked[1], 0.0)


def test_cuda_graph_decode_equals_plain_runs(bundle_factory):
    """Decode steps and full prefill chunks replayed as captured CUDA graphs == node-by-node runs, across set_state."""
    bundle = load_bundle(bundle_factory("tiny-odd", "split", plans="none"))
    graphed, plain = OrtCudaRunner(bundle), _plain(OrtCudaRunner(bundle))
    print(graphed.captured, graphed.notes)
    assert graphed.captured["decode"], graphed.notes
    assert not any(plain.captured.values())
    prompt = np.random.default_rng(5).integers(0, 203, 134)  # 64 + 64 (both parities) + 6 rows
    runs = {}
    for name, backend in (("graphed", graphed), ("plain", plain)):
        gen = ReferenceLoop(backend)
        first = gen.generate(prompt, Sampling(max_new_tokens=20, stop_on_eos=False))
        state = backend.get_state()
        more = gen.generate([7, 8, 9], Sampling(max_new_tokens=9, stop_on_eos=False), reset=False)
        backend.set_state(*state)  # rewind: the captured graphs must read the new values at the same addresses
        gen.pending = first[-1]
        again = gen.generate([7, 8, 9], Sampling(max_new_tokens=9, stop_on_eos=False), reset=False)
        logits = backend.run("decode", [11])
        runs[name] = (first, more, again, logits)
    print({k: v[:3] for k, v in runs.items()})
    assert runs["graphed"][:3] == runs["plain"][:3]
    assert runs["graphed"][1] == runs["graphed"][2]
    assert_close("captured vs plain decode logits", runs["graphed"][3], runs["plain"][3], 1e-5)


@pytest.mark.parametrize("flavour", ["portable", "kernels"])
@pytest.mark.parametrize("cuda_graph", [True, False])
@pytest.mark.parametrize("cache_mib", [0, 64])
def test_cuda_engine_equals_each_alone_on_cpu(bundle_factory, flavour, cuda_graph, cache_mib):
    """Continuous batching with the slots on the device (admit, move, padded batch buckets, captured replays), and
    prompts staged on the device, several per prefill launch with the kernels graphs (captured when a launch of
    full chunks repeats)."""
    from tests.runtime.test_engine import LENGTHS, _alone, _run_all

    bundle = load_bundle(bundle_factory("tiny-odd", "split", plans="none"))
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 203, n).tolist() for n in [128] * 6 + LENGTHS]
    prompts.append(prompts[4] + [9, 8, 7])
    backend = OrtCudaRunner(bundle, flavour)
    if not cuda_graph:
        _plain(backend)
    engine = Engine(backend, EngineConfig(max_batch=6, cache_bytes=int(cache_mib * 2**20)))
    if cache_mib:  # half the cases start warm (as `serve` does): every shape captured before the first request
        shapes, _ = engine.warm()
        want = 2 * len(engine.pool.buckets) + engine.pool.staging_rows if cuda_graph else 0
        assert shapes == want and (not cuda_graph or len(engine.pool.prompts.replays) == engine.pool.staging_rows)
    try:
        first = _run_all(engine, prompts, 12, start=True)  # all queued first: the first launches take several
        again = _run_all(engine, prompts, 12)
    finally:
        engine.stop()
    print(backend.notes, engine.pool.captured, engine.pool.prompts.replays.keys(), "pipelined", engine.pipelined)
    assert engine.pool.captured == cuda_graph
    # pipelined: the kernels graphs on two streams, once no capture can happen beside it
    assert engine.pipelined == (flavour == "kernels" and (bool(cache_mib) or not cuda_graph))
    assert engine.feeding == engine.pipelined  # every request is greedy: fed launches too
    assert engine.pool.staging_rows == (1 if flavour == "portable" else bundle.manifest.max_prefill_batch)
    if cuda_graph and flavour != "portable":  # batched launches ran (and, warm, every full one was captured)
        assert any(k > 1 for _, k, _ in engine.pool.prompts.seen)
    assert engine.pool.device_greedy  # every request is greedy: tokens picked on the GPU, logits fetched to cache
    for i, prompt in enumerate(prompts):
        want = _alone(bundle, prompt, 12)
        print(i, len(prompt), first[i][0], want, again[i][1].cached_tokens)
        assert first[i][0] == want and again[i][0] == want
        # the second round restores each prompt's cached state (kept in device memory) instead of prefilling it
        assert again[i][1].cached_tokens == (len(prompt) if cache_mib else 0)


@pytest.mark.parametrize("how", ["greedy", "sampled"])
def test_cuda_engine_looking_ahead(bundle_factory, how):
    """Pipelined: each decode launch begun from the last one's picks before they are handled, its slots' states
    in the other buffer and its logits in their own while the next runs: every prompt (mixed lengths, several
    ending in each launch) gives its tokens alone on the CPU, greedy and seeded with a temperature (the device
    sampler); a completion's cached entry holds the logits after its fed tokens alone, and its states give the
    exact prefix the tokens it gives alone, its first one from those logits with no launch."""
    from tests.runtime.test_engine import LENGTHS, _alone, _run_all

    bundle = load_bundle(bundle_factory("tiny-odd", "split", plans="none"))
    rng = np.random.default_rng(13)
    prompts = [rng.integers(0, 203, n).tolist() for n in [128] * 6 + LENGTHS]
    news = [3 + i % 7 for i in range(len(prompts))]  # sequences end in different launches
    extra = {"temperature": 0.8} if how == "sampled" else {}
    samplings = [Sampling(max_new_tokens=k, stop_on_eos=False, seed=i, **extra) for i, k in enumerate(news)]
    engine = Engine(OrtCudaRunner(bundle, "kernels"), EngineConfig(max_batch=6, cache_bytes=2**26))
    engine.warm()
    try:
        results = _run_all(engine, prompts, 0, start=True, samplings=samplings)
        tokens = results[0][0]
        exact = prompts[0] + tokens[:-1]
        found, (_, _, logits) = engine.cache.longest_prefix(exact)
        logits = np.array(logits, copy=True)
        ((again, event),) = _run_all(engine, [exact], 4).values()
    finally:
        engine.stop()
    assert engine.pipelined and engine.pool.async_decode
    for i, prompt in enumerate(prompts):
        want = _alone(bundle, prompt, news[i], samplings[i])
        print(i, len(prompt), results[i][0], want)
        assert results[i][0] == want
    assert found == len(exact)
    alone = OrtCpuRunner(bundle)
    for start in range(0, len(exact), 64):
        want_logits = alone.run("prefill", np.asarray(exact[start : start + 64], np.int64))
    want_logits = np.asarray(want_logits).reshape(-1)[: logits.size]
    assert_close("the completion's entry, looking ahead: logits", logits, want_logits, 1e-5)
    assert event.cached_tokens == len(exact) and event.prefill_launches == 0
    assert again == _alone(bundle, exact, 4)


@pytest.mark.parametrize("cache_mib", [0, 64])
def test_cuda_engine_fed_launches(default_bundle, cache_mib):
    """Feeding on the GPU: while the slots stay the same, each greedy decode launch is queued on the decode stream
    behind the last one, its ids that launch's picks (a device-to-device copy), before the host has them. 18
    prompts of the default model (a trained one: its greedy tokens follow what it is fed) through 16 slots, ending
    in different launches: each gives its tokens alone on the CPU, and with a cache the states of its exact
    prefix alone; launches were fed."""
    from tests.runtime.test_engine import check_fed_launches

    runner = OrtCudaRunner(default_bundle, "kernels")
    engine = Engine(runner, EngineConfig(max_batch=16, cache_bytes=cache_mib << 20))  # pipelined: the default
    engine.warm()
    check_fed_launches(engine, default_bundle, cache_mib)
    assert engine.pipelined and engine.feeding and engine.pool.async_decode


def test_cuda_kernels_run_on_each_sessions_stream(bundle_factory):
    """The kernels library launches on the stream onnxruntime reports for the running session (OrtApi slot 193):
    a prefill launch on the runner's stream, the pool's decode launch on the pool's own, two non-blocking streams
    (so that one runs beside the other)."""
    import ctypes

    bundle = load_bundle(bundle_factory("tiny-odd", "split", plans="none"))
    backend = OrtCudaRunner(bundle, "kernels")
    pool = backend.open_pool(4)
    assert backend.concurrent and pool.concurrent and backend.stream and pool.stream
    library = ctypes.CDLL(str(bundle.kernels_library))
    library.mambatrt_ops_last_stream.restype = ctypes.c_void_p
    pool.stage(0)
    pool.prefill(PREFILL, 0, np.arange(1, 65, dtype=np.int64)[None])  # a first shape runs plainly: KernelCompute
    prefill_stream = library.mambatrt_ops_last_stream()
    pool.admit(0, 0)
    pool.decode(np.array([3], np.int64))  # a first bucket is captured: its kernels are launched once
    decode_stream = library.mambatrt_ops_last_stream()
    print("backend", backend.stream, "pool", pool.stream, "seen", prefill_stream, decode_stream)
    assert prefill_stream == backend.stream and decode_stream == pool.stream != backend.stream


def test_cuda_engine_prefill_on_sm_partition(bundle_factory):
    """Serving: the runner's (prefill) stream in a green context of half the GPU's SMs (at least, after the driver's
    rounding, and fewer than all of them where the GPU has 16 or more), said by no note, the pool's decode stream on
    the whole GPU; prefill launches (captured and plain) beside decode give every prompt the tokens it gets alone
    on the CPU. The portable graphs, whose prefill never runs beside decode, keep the whole GPU without a note; more
    SMs than the device has is a one-line error."""
    from mambatrt.runtime.runners import cudart
    from mambatrt.runtime.runners.ort.loader import partition_stream
    from tests.runtime.test_engine import LENGTHS, _alone, _run_all

    bundle = load_bundle(bundle_factory("tiny-odd", "split", plans="none"))
    backend = OrtCudaRunner(bundle, "kernels", prefill_beside_decode=True)
    sms = cudart.sm_count()
    print("SMs", sms, "granted", backend.prefill_sms, backend.notes)
    assert sms // 2 <= backend.prefill_sms and (sms < 16 or backend.prefill_sms < sms) and not backend.notes
    engine = Engine(backend, EngineConfig(max_batch=6))
    engine.warm()
    rng = np.random.default_rng(12)
    prompts = [rng.integers(0, 203, n).tolist() for n in [128] * 6 + LENGTHS]
    try:
        results = _run_all(engine, prompts, 12, start=True)
    finally:
        engine.stop()
    assert engine.pipelined and engine.pool.stream != backend.stream
    for i, prompt in enumerate(prompts):
        want = _alone(bundle, prompt, 12)
        print(i, len(prompt), results[i][0], want)
        assert results[i][0] == want
    portable = OrtCudaRunner(bundle, "portable", prefill_beside_decode=True)
    assert portable.prefill_sms == 0 and not portable.notes
    with pytest.raises(InputError, match="no stream on 100000 SMs"):  # more SMs than the device has: no stream
        partition_stream(bundle, 100000)


def test_cuda_pool_samples_on_device_as_the_host(bundle_factory):
    """The kernels library's sampler picks, for each row, the token sample_token picks from the same logits:
    greedy rows and rows of a temperature, in one batch; at a 50k vocabulary too; a prefill launch's rows. The
    engine samples requests of a temperature alone on the device, their first tokens too, and a seed gives the
    tokens `run` gives on the CPU."""
    from mambatrt.runtime.engine.sampling import sample_token
    from tests.runtime.test_engine import _alone, _run_all
    from tests.runtime.test_generate import _Draw

    bundle = load_bundle(bundle_factory("tiny-odd", "split", plans="none"))
    backend = OrtCudaRunner(bundle, "kernels")
    pool = backend.open_pool(8)
    assert pool.device_sample
    rng = np.random.default_rng(5)
    temps = [0.0, 0.5, 1.0, 2.0, 0.0, 0.7, 1.3, 1.0]
    vocab = backend.config.vocab_size
    for step in range(6):
        ids = rng.integers(0, vocab, 8)
        u = rng.random(8)
        u[0], u[2] = 0.0, 1.0 - 1e-12  # the ends of the cdf
        picked = pool.decode_sample(ids, np.stack([temps, u], axis=1))
        want = [
            sample_token(pool.last_logits(r)[:vocab], Sampling(temperature=temps[r]), _Draw(u[r])) for r in range(8)
        ]
        print(step, picked.tolist(), want)
        assert picked.tolist() == want
    big = (rng.standard_normal((64, 50304)) * 4).astype(np.float32)  # [rows, Vp], a vocabulary of 50280
    device = backend.ort.OrtValue.ortvalue_from_numpy(big, "cuda", 0)
    params = np.stack([np.tile([0.0, 0.6, 1.0, 1.7], 16), rng.random(64)], axis=1)
    out = np.empty(64, np.int64)
    assert pool.sampler(device.data_ptr(), 64, 50304, 50280, params.ctypes.data, out.ctypes.data, pool.stream) is None
    want = [sample_token(big[r, :50280], Sampling(temperature=params[r, 0]), _Draw(params[r, 1])) for r in range(64)]
    print("50k", out.tolist()[:8], want[:8])
    assert out.tolist() == want
    # a prefill launch's rows (prompts' first tokens), from the launch's logits
    for k, rows in ((3, 64), (5, 7)):
        for row in range(k):
            pool.stage(row)
        pool.prefill(PREFILL, 0, rng.integers(0, vocab, (k, rows)))
        params = np.stack([temps[:k], rng.random(k)], axis=1)
        picked = pool.prefill_sample(params)
        want = [
            sample_token(pool.prefill_logits(r)[:vocab], Sampling(temperature=params[r, 0]), _Draw(params[r, 1]))
            for r in range(k)
        ]
        print("prefill", k, rows, picked.tolist(), want)
        assert picked.tolist() == want
    # through the engine: seeded requests of a temperature alone (some greedy), the tokens of each alone on the CPU;
    # the pool picks every token, the first ones too
    engine = Engine(backend, EngineConfig(max_batch=8))
    prompts = [rng.integers(0, 203, n).tolist() for n in (5, 64, 70, 9, 128, 1)]
    samplings = [Sampling(max_new_tokens=10, stop_on_eos=False, temperature=t, seed=i) for i, t in
                 enumerate([0.8, 1.0, 0.0, 1.5, 0.6, 1.0])]  # fmt: skip
    try:
        results = _run_all(engine, prompts, 10, start=True, samplings=samplings)
    finally:
        engine.stop()
    for i, prompt in enumerate(prompts):
        want = _alone(bundle, prompt, 10, samplings[i])
        print(i, results[i][0], want)
        assert results[i][0] == want
    stats = engine.stats()
    print(stats)
    assert stats["pool_first_tokens"] == len(prompts)
    assert stats["pool_next_tokens"] == 9 * len(prompts)


@pytest.mark.parametrize("cuda_graph", [True, False])
def test_cuda_engine_single_layout(bundle_factory, cuda_graph):
    """A "single" bundle on the device: prompts go token by token through the batched decode graph, several staged
    prompts per launch; tokens equal each prompt alone on the CPU."""
    from tests.runtime.test_engine import _alone, _run_all

    bundle = load_bundle(bundle_factory("tiny-odd", "single", plans="none"))
    prompts = [np.random.default_rng(n).integers(0, 203, n).tolist() for n in (1, 5, 9, 9, 30)]
    runner = OrtCudaRunner(bundle, "kernels")
    if not cuda_graph:
        _plain(runner)
    engine = Engine(runner, EngineConfig(max_batch=4)).start()
    try:
        got = _run_all(engine, prompts, 8)
    finally:
        engine.stop()
    assert engine.pool.staging_rows == 4
    for i, prompt in enumerate(prompts):
        assert got[i][0] == _alone(bundle, prompt, 8), (len(prompt), got[i][0])


def _prefilled(bundle, device, graphs, cuda_graph, prompt):
    """(runner, reference loop, logits after ``prompt``) of a fresh runner of ``graphs`` on ``device``."""
    runner = OrtCpuRunner(bundle, graphs) if device == "cpu" else OrtCudaRunner(bundle, graphs)
    if device == "cuda" and not cuda_graph:
        _plain(runner)
    gen = ReferenceLoop(runner)
    runner.reset()
    return runner, gen, gen.prefill(prompt)


@pytest.mark.parametrize("layout", ["split", "single"])
def test_cuda_kernels_equal_portable(bundle_factory, layout):
    """The kernels flavour on CUDA: greedy tokens equal the portable graphs' (CUDA and CPU) for prompts of 1, 64,
    65, 130, 300 tokens; logits after the prompt within 1e-5; captured and plain runs alike."""
    bundle = load_bundle(bundle_factory("tiny-odd", layout, plans="none"))
    for n in (1, 64, 65, 130, 300):
        prompt = np.random.default_rng(n).integers(0, 203, n).tolist()
        runs = {}
        for name, device, graphs, graph in (
            ("cpu portable", "cpu", "portable", True),
            ("cuda portable", "cuda", "portable", True),
            ("cuda kernels", "cuda", "kernels", True),
            ("cuda kernels plain", "cuda", "kernels", False),
        ):
            _, gen, logits = _prefilled(bundle, device, graphs, graph, prompt)
            tokens = gen.generate(prompt, Sampling(max_new_tokens=12, stop_on_eos=False))
            runs[name] = (logits, tokens)
        print(layout, n, {k: v[1] for k, v in runs.items()})
        for name, (logits, tokens) in runs.items():
            assert_close(f"{layout} {n} {name} logits", logits, runs["cpu portable"][0], 1e-5)
            assert tokens == runs["cpu portable"][1], name


def test_cuda_auto_picks_kernels(bundle_factory):
    """On CUDA: the kernels graphs when the bundle's library has CUDA kernels (built with nvcc), else the portable
    graphs with a note naming the cost."""
    bundle = load_bundle(bundle_factory("tiny-odd", "split", plans="none"))
    runner = open_runner(bundle, "cuda")
    print(runner.flavour, runner.notes)
    assert runner.flavour == ("kernels" if bundle.kernels_cuda else "portable")
    assert bool(runner.notes) == (not bundle.kernels_cuda)


def test_cuda_fp16_kernels_equal_portable(bundle_factory):
    """An fp16 bundle's kernels graphs on CUDA (MambaConv16, MambaScan16, MambaAddNorm16: no Cast inside a layer)
    give the logits of its portable graphs on the CPU within the fp16 tolerance, after prompts of 1, 65 and 130
    tokens and after decode steps, captured and plain."""
    bundle = load_bundle(bundle_factory("tiny-odd", "split", precision="fp16", plans="none"))
    for n in (1, 65, 130):
        prompt = np.random.default_rng(n).integers(0, 203, n).tolist()
        runs = {}
        for name, device, graphs, graph in (
            ("cpu portable", "cpu", "portable", True),
            ("cuda kernels", "cuda", "kernels", True),
            ("cuda kernels plain", "cuda", "kernels", False),
        ):
            backend, _, logits = _prefilled(bundle, device, graphs, graph, prompt)
            steps = [backend.run("decode", [t]) for t in (5, 17, 200)]
            runs[name] = [logits, *steps]
        for name, got in runs.items():
            for i, (a, b) in enumerate(zip(got, runs["cpu portable"], strict=True)):
                assert_close(f"fp16 {n} {name} launch {i}", a, b, 2e-2)


@pytest.mark.parametrize("config", ["tiny-odd", "tiny", "tiny-rank", "tiny-r32", "tiny-r48", "tiny-r160"])
def test_cuda_batched_launches_equal_portable_on_cpu(bundle_factory, config):
    """Batched launches on CUDA from random (non-zero) states: decode batches of 1, 3, 4, 5, 9 and 33 sequences (the
    scan step's blocks of four, full and partial; two sequences per thread from 32) and prefill launches of 1, 3
    and 16 prompts; each sequence's logits and states within 1e-5 of its own launch of the portable graphs on the
    CPU. ``tiny`` has 16 state elements, as real models do: the scan kernels' float4 paths (``tiny-odd``'s 12 take
    the element-wise ones); ``tiny-rank``'s dt rank of 120 takes the step's dt inputs in several rounds;
    ``tiny-r32``'s rank of 32 and ``tiny-r48``'s 48 the step's dt inputs as float4s, counted at run time and fixed
    at compile time as for mamba-130m (``tiny``'s 4 and ``tiny-rank``'s 120 as scalars). Ranks from 96
    (``tiny-rank``, ``tiny-r160``) and launches of 128 rows or more take the chunk scan's dt products from a GEMM;
    ``tiny-r160``'s 16 x 64 rows at 1024 channels run it on CUTLASS's 64 x 64 tiles, whose shared memory the scan's
    own file raises."""
    from mambatrt.runtime.runners.ort.loader import kernels_stream, session_options
    from mambatrt.runtime.runners.states import StateLayout

    flavour = "kernels"
    bundle = load_bundle(bundle_factory(config, "split", plans="none"))
    c, cpu = bundle.config, OrtCpuRunner(bundle)
    cuda = {"use_tf32": "0", "user_compute_stream": str(kernels_stream(bundle))}
    providers = [("CUDAExecutionProvider", cuda)]
    opts = session_options(ort, bundle, flavour)
    sessions = {
        g: ort.InferenceSession(str(bundle.graph_path(g, flavour, cuda=True)), opts, providers=providers)
        for g in bundle.graphs
    }
    rng = np.random.default_rng(5)
    launches = [("decode", b, 1) for b in (1, 3, 4, 5, 9, 33)] + [
        ("prefill", 1, 64),
        ("prefill", 3, 7),
        ("prefill", 16, 64),
    ]
    for graph, batch, rows in launches:
        ids = rng.integers(0, c.vocab_size, batch * rows).astype(np.int64)
        conv = (rng.standard_normal((batch, *c.conv_state_shape)) * 0.3).astype(np.float32)
        ssm = (rng.standard_normal((batch, *c.ssm_state_shape)) * 0.3).astype(np.float32)
        layout = StateLayout(bundle.contract(graph, flavour), c)  # schema 4's kernels graphs: each layer's states
        got = layout.stacked(sessions[graph].run(None, {"token_ids": ids, **layout.feed(conv, ssm)}))
        for b in range(batch):
            want = cpu.run_states(graph, ids[b * rows : (b + 1) * rows], conv[b : b + 1], ssm[b : b + 1])
            for what, a, w in zip(("logits", "conv", "ssm"), got, want, strict=True):
                assert_close(f"{flavour} {graph} {batch} x {rows}, sequence {b}: {what}", a[b : b + 1], w, 1e-5)


def test_cuda_mamba_linear_kernel(bundle_factory):
    """MambaLinear's CUDA kernel alone (3xTF32 on the tensor cores): x w^T within 1e-5 of float64 at mamba-130m's
    projection shapes (each a kernel config of its own; in_proj above 16 rows the 2 x 2 tiles) and an odd one, at 1,
    7, 64, 100, 300 and 1100 rows (the last two, and in_proj's 100, on CUTLASS's GEMMs where the library has them;
    out_proj's 64 on the cluster kernel and its 100 on the staged kernel, sm_90; mamba-2.8b's x_proj, 192 x 5120, at
    300 rows with its K split over blocks, serial split-K);
    a batch's last row equal bit for bit to that row alone on the library's own kernel, within 1e-5 on CUTLASS."""
    from mambatrt.testing import check_mamba_linear

    bundle = load_bundle(bundle_factory("tiny-odd", "split", plans="none"))
    print("kernels library with CUTLASS:", bool(bundle.manifest.kernels_library.get("cutlass")))
    check_mamba_linear(bundle.kernels_library, "CUDAExecutionProvider", rows=(1, 7, 64, 100, 300, 1100))


@pytest.mark.parametrize("pipelined", [False, True])
def test_cuda_scored_prompts_equal_cpu_token_by_token(bundle_factory, pipelined):
    """Prompts scored on the scoring graph with onnxruntime's CUDA provider (on the prefill stream, beside the
    kernels' decode launches when pipelined): the log-probabilities, top tokens and greedy flags of the CPU's
    token-by-token path (fp32, TF32 off: 1e-4 absolute), and the same tokens after."""
    from tests.runtime.test_engine import _scored

    bundle = load_bundle(bundle_factory("tiny-odd", "split", plans="none"))
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, 203, n).tolist() for n in [2, 64, 65, 200]]
    config = EngineConfig(max_batch=4, cache_bytes=2**20, pipelined=pipelined)
    engine = Engine(OrtCudaRunner(bundle, "kernels", prefill_beside_decode=True), config)
    assert engine.scorer is not None
    got = _scored(engine, prompts)
    want = _scored(Engine(OrtCpuRunner(bundle, "kernels"), EngineConfig(max_batch=4, token_by_token=True)), prompts)
    for prompt, (scores, tokens), (ref, ref_tokens) in zip(prompts, got, want, strict=True):
        worst = max(abs(a.logprob - b.logprob) for a, b in zip(scores, ref, strict=True))
        print(len(prompt), f"worst |CUDA row-scored - CPU token-by-token| logprob {worst:.2e}")
        assert len(scores) == len(prompt) - 1 and worst < 1e-4
        assert [a.greedy for a in scores] == [b.greedy for b in ref] and tokens == ref_tokens
