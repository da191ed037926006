"""Long prefill launches: the kernels prefill graph takes up to its own rows per launch (2048 in bundles built now),
the portable graphs and plans keep 64. One long launch equals the 64-row chunked path and token-by-token decoding
(fp32: 1e-5 relative on logits and states, the same greedy tokens), split and single bundles; the engine prefills
prompts in long launches within the rows of one launch, and while sequences decode within the rows per iteration.
"""

import json
import shutil
import threading
import time

import numpy as np
import pytest

from mambatrt.contract import DECODE, DEFAULT_KERNELS_PREFILL_ROWS, KERNELS, PORTABLE, PREFILL
from mambatrt.errors import BundleError, InputError
from mambatrt.manifest import MANIFEST, Manifest
from mambatrt.runtime.bundle import load_bundle
from mambatrt.runtime.engine import Engine, EngineConfig, Request, Sampling
from mambatrt.runtime.generation import generate
from mambatrt.runtime.runners.ort.cpu import OrtCpuRunner
from mambatrt.testing import ReferenceLoop, assert_close

RTOL = 1e-5  # fp32
LENGTHS = [1, 63, 64, 65, 511, 512, 513, 2000]
NEW_TOKENS = 8
VOCAB = {"tiny-odd": 203, "tiny-wide": 64}


def _prompt(name: str, n: int) -> np.ndarray:
    return np.random.default_rng(n).integers(0, VOCAB[name], n).astype(np.int64)


def _prefill(runner, graph: str, prompt: np.ndarray, rows: int) -> tuple[np.ndarray, tuple]:
    """The prompt from zero states in launches of ``rows`` rows on ``graph``: the last logits and the states."""
    runner.reset()
    for start in range(0, prompt.size, rows):
        logits = runner.run(graph, prompt[start : start + rows])
    return logits[: runner.config.vocab_size], runner.get_state()


def _greedy(runner, logits: np.ndarray, state: tuple, n: int) -> list[int]:
    """n greedy tokens after a prefill that gave ``logits`` and ``state`` (one decode launch per token)."""
    runner.set_state(*state)
    tokens = [int(np.argmax(logits))]
    while len(tokens) < n:
        tokens.append(int(np.argmax(runner.run(DECODE, [tokens[-1]])[: runner.config.vocab_size])))
    return tokens


def _paths(split, single, prompt: np.ndarray) -> dict[str, tuple]:
    """(logits, states, greedy tokens) of the prompt on every path: the kernels graph's one long launch, its 64-row
    chunks, the portable graphs' 64-row chunks, token by token on the split bundle's decode graph and on the single
    bundle's."""
    kernels, portable, steps = OrtCpuRunner(split, KERNELS), OrtCpuRunner(split), OrtCpuRunner(single, KERNELS)
    assert prompt.size <= kernels.max_rows[PREFILL]  # one launch
    runs = {
        "long launch": (kernels, PREFILL, prompt.size),
        "kernels, 64-row chunks": (kernels, PREFILL, 64),
        "portable, 64-row chunks": (portable, PREFILL, 64),
        "split, token by token": (kernels, DECODE, 1),
        "single, token by token": (steps, DECODE, 1),
    }
    out = {}
    for name, (runner, graph, rows) in runs.items():
        logits, state = _prefill(runner, graph, prompt, rows)
        out[name] = (logits, state, _greedy(runner, logits, state, NEW_TOKENS))
    return out


@pytest.mark.parametrize("prompt_len", LENGTHS)
@pytest.mark.parametrize("name", ["tiny-odd", pytest.param("tiny-wide", marks=pytest.mark.slow)])
def test_long_launch_equals_chunked_and_token_by_token(bundle_factory, name, prompt_len):
    split = load_bundle(bundle_factory(name, "split", plans="none"))
    single = load_bundle(bundle_factory(name, "single", plans="none"))
    prompt = _prompt(name, prompt_len)
    paths = _paths(split, single, prompt)
    logits, (conv, ssm), tokens = paths.pop("long launch")
    for path, (other_logits, (other_conv, other_ssm), other_tokens) in paths.items():
        label = f"{name} {prompt_len} tokens, long launch vs {path}"
        assert_close(f"{label}: logits", logits, other_logits, RTOL)
        assert_close(f"{label}: conv state", conv, other_conv, RTOL)
        assert_close(f"{label}: ssm state", ssm, other_ssm, RTOL)
        print(label, tokens, other_tokens)
        assert tokens == other_tokens


@pytest.mark.parametrize("prompt_len", LENGTHS)
def test_engine_prefills_a_prompt_in_long_launches(bundle_factory, prompt_len):
    """`mambatrt run`'s engine (one slot, the kernels graphs on the CPU) prefills a prompt in launches of the kernels
    prefill graph's rows and gives the tokens of the 64-row chunked path (the reference loop on the portable graphs)
    and of token-by-token prefill on a single bundle."""
    split = load_bundle(bundle_factory("tiny-odd", "split", plans="none"))
    single = load_bundle(bundle_factory("tiny-odd", "single", plans="none"))
    prompt = _prompt("tiny-odd", prompt_len).tolist()
    sampling = Sampling(max_new_tokens=NEW_TOKENS, stop_on_eos=False)
    engine = Engine(OrtCpuRunner(split, KERNELS), EngineConfig(max_batch=1))
    got = generate(engine, prompt, sampling)
    chunked = ReferenceLoop(OrtCpuRunner(split)).generate(prompt, sampling)
    steps = generate(Engine(OrtCpuRunner(single, KERNELS), EngineConfig(max_batch=1)), prompt, sampling)
    print(prompt_len, got.prefill_launches, got.tokens, chunked, steps.tokens)
    assert got.tokens == chunked == steps.tokens
    assert got.prefill_launches == -(-prompt_len // DEFAULT_KERNELS_PREFILL_ROWS) == 1


def _run(engine, prompts: list[list[int]], news: list[int], start: bool = False) -> dict[int, list[int]]:
    """Submit the prompts (greedy, EOS ignored, news[i] tokens each) to the engine, started already or (``start``)
    once all are queued; their tokens."""
    out, done = {i: [] for i in range(len(prompts))}, threading.Event()
    ended = set()

    def emit(i, event):
        if event.token is not None:
            out[i].append(event.token)
        if event.finish_reason is not None:
            ended.add(i)
            if len(ended) == len(prompts):
                done.set()

    for i, (prompt, n) in enumerate(zip(prompts, news, strict=True)):
        sampling = Sampling(max_new_tokens=n, stop_on_eos=False)
        engine.submit(Request(prompt, sampling, lambda e, i=i: emit(i, e)))
    if start:
        engine.start()
    assert done.wait(300), f"only {len(ended)} of {len(prompts)} ended"
    return out


def _record_launches(engine) -> list[tuple[int, int, int]]:
    """(sequences decoding, prompts, rows per prompt) of every prefill launch the engine plans from now on."""
    launches, plan = [], engine.scheduler.plan_prefill

    def planned():
        out = plan()
        running = len(engine.scheduler.running)
        launches.extend((running, *launch.ids.shape) for launch in out if not launch.score)
        return out

    engine.scheduler.plan_prefill = planned
    return launches


@pytest.mark.slow
@pytest.mark.parametrize("pipelined", [False, True])
def test_batched_long_prompts_equal_each_alone(bundle_factory, pipelined):
    """Prompts of 3 to 2000 tokens queued together, with a cache in play: launches of several prompts each share
    the rows of one launch (B x T within 2048), a long prompt goes in launches of up to 2048 rows while nothing
    decodes and of at most the rows per iteration while sequences decode; each prompt gives the tokens of the
    64-row chunked path alone, the second round from cached states too. The two prompts of 600 tokens come first:
    the first launch, planned before anything decodes, takes both (later ones share launches only where equal
    chunks meet while nothing decodes, which depends on how fast the decode launches run)."""
    bundle = load_bundle(bundle_factory("tiny-odd", "split", plans="none"))
    lengths = [600, 600, 2000, 1500, 513, 3, 65, 64, 64, 2000, 130]
    prompts = [_prompt("tiny-odd", n).tolist() for n in lengths]
    prompts[-1] = prompts[0][:130]  # a prefix of a long prompt
    news = [4 + 3 * (i % 5) for i in range(len(prompts))]
    runner = OrtCpuRunner(bundle, KERNELS)
    config = EngineConfig(max_batch=3, cache_bytes=2**26, pipelined=pipelined)
    engine = Engine(runner, config)
    launches = _record_launches(engine)
    try:  # all queued before the engine plans its first launch, so that prompts share launches however fast it runs
        first = _run(engine, prompts, news, start=True)
        again = _run(engine, prompts, news)
    finally:
        engine.stop()
    print(launches)
    limit, iteration = runner.launch_rows[PREFILL], engine.scheduler.prefill_rows
    assert limit == DEFAULT_KERNELS_PREFILL_ROWS and iteration < limit
    assert all(k * rows <= (iteration if running else limit) for running, k, rows in launches)
    assert any(k * rows > 64 * 16 for running, k, rows in launches if not running)  # longer than the old launches
    assert any(k > 1 for _, k, _ in launches)
    for i, prompt in enumerate(prompts):
        want = ReferenceLoop(OrtCpuRunner(bundle)).generate(prompt, Sampling(max_new_tokens=news[i], stop_on_eos=False))
        assert first[i] == want and again[i] == want, (len(prompt), first[i], again[i], want)


def _beside(bundle, long: list[int], rows: int | None) -> tuple[Engine, list, list[int]]:
    """``long`` submitted while a short prompt decodes (``prefill_rows`` = ``rows``): the engine, its prefill
    launches and the long prompt's tokens."""
    engine = Engine(OrtCpuRunner(bundle, KERNELS), EngineConfig(max_batch=2, prefill_rows=rows))
    launches, tokens = _record_launches(engine), []
    sampling = Sampling(max_new_tokens=400, stop_on_eos=False)
    engine.submit(Request(_prompt("tiny-odd", 5).tolist(), sampling, lambda e: tokens.append(e.token)))
    engine.start()
    try:
        while len(tokens) < 3:  # the short prompt decodes
            time.sleep(0.001)
        got = _run(engine, [long], [4])[0]
    finally:
        engine.stop()
    return engine, launches, got


@pytest.mark.parametrize("rows", [None, 500])
def test_prefill_beside_decode_keeps_to_the_rows_per_iteration(bundle_factory, rows):
    """A 2000-token prompt arriving while a sequence decodes goes in launches of at most ``prefill_rows`` rows (CPU
    default: four 64-row chunks), one per decode launch, so the decoding sequence gets a token after each; with
    ``prefill_rows`` set, that many. The prompt gives the tokens it gives alone."""
    bundle = load_bundle(bundle_factory("tiny-odd", "split", plans="none"))
    long = _prompt("tiny-odd", 2000).tolist()
    engine, launches, got = _beside(bundle, long, rows)
    budget = engine.scheduler.prefill_rows
    beside = [(k, r) for running, k, r in launches if running]
    print(rows, budget, beside)
    assert budget == (rows or 4 * 64)
    assert beside and all(k * r <= budget for k, r in beside)
    assert sum(k * r for k, r in beside) >= 2000 - budget  # the prompt went in beside the decoding sequence
    assert got == ReferenceLoop(OrtCpuRunner(bundle)).generate(long, Sampling(max_new_tokens=4, stop_on_eos=False))


def test_rows_by_flavour_in_manifest_graphs_and_plans(bundle_factory):
    """A bundle records the kernels prefill graph's rows (2048): its contract and metadata say so; the portable
    graphs, the scoring graph and the TensorRT plans keep 64. Runners take their flavour's limit."""
    import onnx

    bundle = load_bundle(bundle_factory("tiny-odd", "split"))  # plans where a TensorRT module imports
    m = bundle.manifest
    data = json.loads((bundle.path / MANIFEST).read_text())
    assert data["max_kernels_prefill_rows"] == m.kernels_prefill_rows == DEFAULT_KERNELS_PREFILL_ROWS
    assert data["max_prefill_rows"] == m.max_prefill_rows == 64 and data["contract"][PREFILL]["rows"] == [1, 64]
    assert m.contract(PREFILL, KERNELS).max_rows == m.prefill_launch_rows(KERNELS) == 2048
    assert m.prefill_rows(PORTABLE) == m.prefill_launch_rows(PORTABLE) == 64
    for flavour, rows in ((PORTABLE, "64"), (KERNELS, "2048")):
        proto = onnx.load(str(bundle.graph_path(PREFILL, flavour)), load_external_data=False)
        assert {p.key: p.value for p in proto.metadata_props}["mambatrt.max_rows"] == rows
    if PREFILL in m.plans:
        assert m.plans[PREFILL].profile["token_ids"] == {"min": [1], "opt": [32], "max": [64]}
    kernels, portable = OrtCpuRunner(bundle, KERNELS), OrtCpuRunner(bundle)
    assert kernels.max_rows[PREFILL] == 2048 and portable.max_rows[PREFILL] == 64
    assert kernels.chunk_rows(PREFILL, 16) == 128 and portable.chunk_rows(PREFILL, 1) == 64
    assert kernels.scorer().max_rows == 64
    for runner, rows in ((kernels, 2049), (portable, 65)):
        with pytest.raises(InputError, match="exceeds the prefill graph's limit"):
            runner.run(PREFILL, np.zeros(rows, np.int64))
    assert Manifest.from_json(m.to_json()) == m


def test_bundle_without_kernels_rows_keeps_64_rows(bundle_factory, tmp_path):
    """A manifest without ``max_kernels_prefill_rows`` (bundles built before it): the kernels prefill graph takes
    64 rows per sequence and 64 x its batch per launch, as it did; the engine's tokens are unchanged. The field
    beside no kernels prefill graph, or below 1, is refused."""
    path = tmp_path / "old"
    shutil.copytree(bundle_factory("tiny-odd", "split", plans="none"), path)
    data = json.loads((path / MANIFEST).read_text())
    del data["max_kernels_prefill_rows"]
    (path / MANIFEST).write_text(json.dumps(data))
    bundle = load_bundle(path)
    m = bundle.manifest
    assert m.kernels_prefill_rows is None and m.prefill_rows(KERNELS) == 64
    assert m.prefill_launch_rows(KERNELS) == 64 * m.max_prefill_batch
    runner = OrtCpuRunner(bundle, KERNELS)
    assert runner.max_rows[PREFILL] == 64 and runner.chunk_rows(PREFILL, m.max_prefill_batch) == 64
    prompt = _prompt("tiny-odd", 130).tolist()
    sampling = Sampling(max_new_tokens=NEW_TOKENS, stop_on_eos=False)
    got = generate(Engine(runner, EngineConfig(max_batch=1)), prompt, sampling)
    assert got.prefill_launches == 3 and got.tokens == ReferenceLoop(OrtCpuRunner(bundle)).generate(prompt, sampling)
    portable_only = {k: v for k, v in data.items() if k not in ("kernels_graphs", "kernels_library")}
    for bad in ({**data, "max_kernels_prefill_rows": 0}, {**portable_only, "max_kernels_prefill_rows": 2048}):
        with pytest.raises(BundleError, match="max_kernels_prefill_rows"):
            Manifest.from_json(bad)


# -- on a GPU: the same numerics on onnxruntime's CUDA provider (skip where there is none) ----------------------------
def _cuda():
    ort = pytest.importorskip("onnxruntime")
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime has no CUDA execution provider here (needs onnxruntime-gpu and a GPU)")
    from mambatrt.runtime.runners.ort.cuda import OrtCudaRunner

    return OrtCudaRunner


@pytest.mark.gpu
@pytest.mark.parametrize("prompt_len", LENGTHS)
def test_cuda_long_launch_equals_chunked_and_token_by_token(bundle_factory, prompt_len):
    """On CUDA (the kernels graphs, captured where they repeat): one long launch, 64-row chunks and token by token
    give the CPU's long launch's logits and states within 1e-5 and its greedy tokens; a single bundle too."""
    cuda = _cuda()
    split = load_bundle(bundle_factory("tiny-odd", "split", plans="none"))
    single = load_bundle(bundle_factory("tiny-odd", "single", plans="none"))
    prompt = _prompt("tiny-odd", prompt_len)
    cpu = OrtCpuRunner(split, KERNELS)
    want_logits, want_state = _prefill(cpu, PREFILL, prompt, prompt.size)
    want_tokens = _greedy(cpu, want_logits, want_state, NEW_TOKENS)
    runner, steps = cuda(split, KERNELS), cuda(single, KERNELS)
    for label, (r, graph, rows) in {
        "long launch": (runner, PREFILL, prompt.size),
        "64-row chunks": (runner, PREFILL, 64),
        "token by token": (runner, DECODE, 1),
        "single, token by token": (steps, DECODE, 1),
    }.items():
        for repeat in range(2):  # the second time from captured graphs where the row count repeats
            logits, state = _prefill(r, graph, prompt, rows)
            name = f"cuda {prompt_len} tokens, {label} (run {repeat}) vs the CPU's long launch"
            assert_close(f"{name}: logits", logits, want_logits, RTOL)
            assert_close(f"{name}: ssm state", state[1], want_state[1], RTOL)
            assert _greedy(r, logits, state, NEW_TOKENS) == want_tokens


@pytest.mark.gpu
@pytest.mark.parametrize("pipelined", [False, True])
def test_cuda_engine_long_prompts_equal_cpu_alone(bundle_factory, pipelined):
    """The CUDA slot pool (warmed as `serve` warms it: a captured staging launch per batch size, each the longest
    chunk a launch of that many prompts takes) prefills prompts of 1 to 2000 tokens in long launches within 2048
    rows; each gives the tokens of the CPU's 64-row chunked path alone."""
    cuda = _cuda()
    bundle = load_bundle(bundle_factory("tiny-odd", "split", plans="none"))
    prompts = [_prompt("tiny-odd", n).tolist() for n in [2000, 600, 600, 1500, 513, 3, 65, 64, 64, 2000, 1]]
    runner = cuda(bundle, KERNELS)
    engine = Engine(runner, EngineConfig(max_batch=4, cache_bytes=2**26, pipelined=pipelined))
    shapes, _ = engine.warm()
    staging = engine.pool.prompts
    assert len(staging.replays) == engine.pool.staging_rows
    assert all(k * rows <= runner.launch_rows[PREFILL] for _, k, rows in staging.replays)
    launches = _record_launches(engine)
    engine.start()
    try:
        got = _run(engine, prompts, [NEW_TOKENS] * len(prompts))
    finally:
        engine.stop()
    print(launches, runner.notes)
    assert all(k * rows <= runner.launch_rows[PREFILL] for _, k, rows in launches)
    sampling = Sampling(max_new_tokens=NEW_TOKENS, stop_on_eos=False)
    for i, prompt in enumerate(prompts):
        assert got[i] == ReferenceLoop(OrtCpuRunner(bundle)).generate(prompt, sampling), len(prompt)


@pytest.mark.gpu
def test_cuda_captured_row_counts_are_bounded(bundle_factory):
    """A runner captures at most CAPTURED_ROWS row counts of its prefill graph (both parities each); other row
    counts run plainly from one ids buffer. Every launch equals the CPU's."""
    cuda = _cuda()
    from mambatrt.runtime.runners.ort.cuda import CAPTURED_ROWS

    bundle = load_bundle(bundle_factory("tiny-odd", "split", plans="none"))
    runner, cpu = cuda(bundle, KERNELS), OrtCpuRunner(bundle, KERNELS)
    graph = runner.graph_runners[PREFILL]
    assert graph.captured, runner.notes
    for rows in list(range(1, CAPTURED_ROWS + 20)) * 2 + [2048, 2048, 777, 777]:
        prompt = _prompt("tiny-odd", rows)
        got = _prefill(runner, PREFILL, prompt, rows)
        want = _prefill(cpu, PREFILL, prompt, rows)
        assert_close(f"cuda {rows} rows: logits", got[0], want[0], RTOL)
    print(sorted(graph.ids))
    assert len(graph.ids) <= CAPTURED_ROWS and len(graph.replays) <= 2 * CAPTURED_ROWS
