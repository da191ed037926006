"""The "kernels" graph flavour (mambatrt's own op library) against the portable graphs, on the CPU EP."""

import json

import numpy as np
import onnx
import pytest

from mambatrt.contract import DECODE, KERNELS, PORTABLE, PREFILL
from mambatrt.runtime.bundle import load_bundle
from mambatrt.runtime.engine import Sampling
from mambatrt.runtime.runners.ort.cpu import OrtCpuRunner
from mambatrt.testing import ReferenceLoop, assert_close

RTOL_FP32 = 1e-5
RTOL_FP16 = 2e-2  # as compare uses for fp16 bundles
# the ops outside the default domain in each flavour
SKIP_NORM = ("com.microsoft", "SkipSimplifiedLayerNormalization")
FLAVOUR_OPS = {KERNELS: {("mambatrt", "MambaConv"), ("mambatrt", "MambaScan"), SKIP_NORM}}


def test_bundle_records_every_flavour(bundle_factory):
    bundle = load_bundle(bundle_factory("tiny-odd", "split", plans="none"))
    assert bundle.flavours == (PORTABLE, KERNELS)
    assert bundle.kernels_library.is_file() and bundle.manifest.kernels_library["compiler"]
    assert bundle.kernels_library.stat().st_mode & 0o044 == 0o044  # readable by others, like the bundle's files
    for graph in (DECODE, PREFILL):
        portable = onnx.load(str(bundle.graph_path(graph)), load_external_data=False)
        assert not any(n.domain for n in portable.graph.node)  # TensorRT's parser knows every portable op
        counts = [len(portable.graph.node)]
        for flavour, want in FLAVOUR_OPS.items():
            proto = onnx.load(str(bundle.graph_path(graph, flavour)), load_external_data=False)
            ops = {(n.domain, n.op_type) for n in proto.graph.node if n.domain}
            print(graph, flavour, len(proto.graph.node), "nodes", sorted(ops))
            assert ops == want
            counts.append(len(proto.graph.node))
            meta = {p.key: p.value for p in proto.metadata_props}
            assert meta["mambatrt.flavour"] == flavour and json.loads(meta["mambatrt.contract"])["graph"] == graph
        assert counts == sorted(counts, reverse=True) and len(set(counts)) == 2  # portable > kernels


@pytest.mark.parametrize("name", ["tiny-odd", "tiny-bias", "tiny-n8-k3"])
def test_kernels_launches_equal_portable(bundle_factory, name):
    """One launch of each graph from the same (non-zero) states: logits and both states within 1e-5."""
    bundle = load_bundle(bundle_factory(name, "split", plans="none"))
    launches = ((DECODE, 5, 5), (PREFILL, 1, 1), (PREFILL, 1, 37), (PREFILL, 1, 64))
    _launches_equal_portable(bundle, KERNELS, launches, RTOL_FP32, f"{name} kernels")


def _launches_equal_portable(bundle, flavour: str, launches, rtol: float, label: str) -> None:
    """Each (graph, batch, rows) launch from the same random (non-zero) states in ``flavour`` and in the portable
    graphs: logits and both states within ``rtol``."""
    c = bundle.config
    backends = {f: OrtCpuRunner(bundle, f) for f in (PORTABLE, flavour)}
    rng = np.random.default_rng(1)
    for graph, batch, rows in launches:
        ids = rng.integers(0, c.vocab_size, rows).astype(np.int64)
        conv = (rng.standard_normal((batch, *c.conv_state_shape)) * 0.3).astype(np.float32)
        ssm = (rng.standard_normal((batch, *c.ssm_state_shape)) * 0.3).astype(np.float32)
        out = {f: b.run_states(graph, ids, conv, ssm) for f, b in backends.items()}
        for what, a, want in zip(("logits", "conv", "ssm"), out[flavour], out[PORTABLE], strict=True):
            assert_close(f"{label} {graph} {rows} rows: {what}", a, want, rtol)


def test_batched_prefill_equals_one_sequence_launches(bundle_factory):
    """One prefill launch of B sequences (token ids one sequence after the other, states [B, ..]) equals B portable
    launches of one sequence each, from different states: logits and both states within 1e-5, for B up to the
    bundle's max_prefill_batch and chunks of 1, 7 and 64 rows."""
    bundle = load_bundle(bundle_factory("tiny-odd", "split", plans="none"))
    c, limit = bundle.config, bundle.manifest.max_prefill_batch
    assert bundle.manifest.schema_version == 4 and limit > 1 and bundle.prefill_batch(KERNELS) == limit
    assert bundle.prefill_batch(PORTABLE) == 1
    portable, batched = OrtCpuRunner(bundle), OrtCpuRunner(bundle, KERNELS)
    rng = np.random.default_rng(2)
    for batch, rows in ((2, 1), (3, 7), (limit, 64), (limit, 5)):
        ids = rng.integers(0, c.vocab_size, (batch, rows)).astype(np.int64)
        conv = (rng.standard_normal((batch, *c.conv_state_shape)) * 0.3).astype(np.float32)
        ssm = (rng.standard_normal((batch, *c.ssm_state_shape)) * 0.3).astype(np.float32)
        got = batched.run_states(PREFILL, ids.reshape(-1), conv, ssm)
        assert got[0].shape == (batch, c.vocab_padded) and got[1].shape == conv.shape
        for b in range(batch):
            want = portable.run_states(PREFILL, ids[b], conv[b : b + 1], ssm[b : b + 1])
            for what, a, w in zip(("logits", "conv", "ssm"), got, want, strict=True):
                assert_close(f"kernels batch {batch} x {rows} rows, sequence {b}: {what}", a[b : b + 1], w, RTOL_FP32)


@pytest.mark.parametrize("layout", ["split", "single"])
def test_kernels_greedy_tokens_equal_portable(bundle_factory, layout):
    bundle = load_bundle(bundle_factory("tiny-odd", layout, plans="none"))
    for n in (1, 64, 65, 130, 300):
        prompt = np.random.default_rng(n).integers(0, 203, n).tolist()
        tokens = {}
        for flavour in (PORTABLE, KERNELS):
            loop = ReferenceLoop(OrtCpuRunner(bundle, flavour))
            tokens[flavour] = loop.generate(prompt, Sampling(max_new_tokens=16, stop_on_eos=False))
        print(layout, n, tokens)
        assert tokens[KERNELS] == tokens[PORTABLE]


def test_device_choice(bundle_factory, cli):
    """On the CPU, `run` runs the kernels graphs (the library's vectorized CPU kernels); TensorRT where no
    TensorRT runtime runs plans is a one-line error."""
    path = bundle_factory("tiny-odd", "split")
    code, out, err = cli("run", path, "--prompt-ids", "5,6,7", "--max-new-tokens", "4", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["graphs"] == KERNELS and data["device"] == "cpu" and data["runner"] == "onnxruntime"
    code, out, err = cli("run", path, "--prompt-ids", "5,6,7", "--device", "tensorrt")
    assert code == 2 and "cannot run TensorRT plans here" in err and "Traceback" not in err, err


def test_bundle_without_kernels(checkpoint_factory, tmp_path, cli, monkeypatch):
    """--kernels none: no kernels flavour; onnxruntime then runs the portable graphs and says so; --kernels cuda
    without nvcc is refused before the export."""
    ckpt = checkpoint_factory("tiny")
    code, _, err = cli("bundle", ckpt, "--out", tmp_path / "b", "--plans", "none", "--kernels", "none", "--quiet")
    assert code == 0, err
    bundle = load_bundle(tmp_path / "b")
    assert bundle.flavours == (PORTABLE,) and bundle.kernels_library is None
    assert not list((tmp_path / "b").glob("*kernels*")) and not list((tmp_path / "b").glob("*.so"))
    code, out, err = cli("run", tmp_path / "b", "--prompt-ids", "5,6", "--max-new-tokens", "2", "--json")
    assert code == 0 and json.loads(out)["graphs"] == PORTABLE, err
    assert any("no kernels graphs" in note and "slower" in note for note in json.loads(out)["notes"])
    monkeypatch.setenv("MAMBATRT_NVCC", str(tmp_path / "no-nvcc"))
    code, _, err = cli("bundle", ckpt, "--out", tmp_path / "c", "--plans", "none", "--kernels", "cuda")
    assert code == 2 and "needs nvcc" in err and not (tmp_path / "c").exists(), err


def test_old_bundle_runs_portable(cli):
    """A bundle built before the graph flavours runs its portable graphs."""
    from pathlib import Path

    old = Path(__file__).parent.parent / "data" / "schema1" / "bundle"
    assert load_bundle(old).flavours == (PORTABLE,)
    code, out, err = cli("run", old, "--prompt-ids", "5,6,7", "--max-new-tokens", "3", "--json", "--device", "cpu")
    assert code == 0 and json.loads(out)["graphs"] == PORTABLE, err


def test_greedy_picker_graph(bundle_factory):
    """greedy.onnx: argmax over the real vocabulary only (padding columns ignored), first index on ties."""
    import onnxruntime as ort

    bundle = load_bundle(bundle_factory("tiny-odd", "split", plans="none"))
    c = bundle.config
    assert bundle.greedy_path is not None and c.vocab_padded > c.vocab_size
    session = ort.InferenceSession(str(bundle.greedy_path), providers=["CPUExecutionProvider"])
    logits = np.random.default_rng(0).standard_normal((5, c.vocab_padded)).astype(np.float32)
    logits[:, c.vocab_size :] = 100.0  # padding columns must never win
    logits[3, 7] = logits[3, 9] = 50.0  # a tie: the first index
    (picked,) = session.run(None, {"logits": logits})
    print(picked)
    assert picked.tolist() == np.argmax(logits[:, : c.vocab_size], axis=1).tolist() and picked[3] == 7


def test_kernels_fp16_takes_half_without_casts(bundle_factory):
    """An fp16 bundle's kernels graphs use MambaConv16/MambaScan16 (xz and y in float16) and MambaAddNorm16 (out_proj's
    float16 output into the float32 stream, the normed stream out in float16): no Cast inside the layers, three in
    all (the embedding, layer 0's in_proj input, the logits); launches equal the portable graphs' within the fp16
    tolerance."""
    bundle = load_bundle(bundle_factory("tiny-odd", "split", precision="fp16", plans="none"))
    c = bundle.config
    for graph in (DECODE, PREFILL):
        proto = onnx.load(str(bundle.graph_path(graph, KERNELS)), load_external_data=False)
        ops = [n.op_type for n in proto.graph.node]
        print(graph, {op: ops.count(op) for op in set(ops)})
        assert ops.count("MambaConv16") == ops.count("MambaScan16") == c.n_layer
        assert ops.count("MambaAddNorm16") == c.n_layer  # layers 1.. and the final norm
        assert ops.count("Cast") <= 3
        assert "Split" not in ops  # each layer's states come as tensors of their own
        if graph == DECODE:  # the ops take a step's rows as [B, C]
            assert not {"Squeeze", "Unsqueeze", "Reshape", "Concat"} & set(ops)
    _launches_equal_portable(bundle, KERNELS, ((DECODE, 4, 4), (PREFILL, 1, 37)), RTOL_FP16, "fp16 kernels")


@pytest.mark.parametrize("graph", [DECODE, PREFILL])
def test_kernels_graphs_take_each_layers_states(bundle_factory, graph):
    """The fp32 kernels graphs (schema 4) take and give each layer's states as tensors of their own, [batch, E, ..],
    so they have no Split or Concat of the states (each a copy of every state per launch); the decode graph has no
    Squeeze, Unsqueeze or Reshape either (each a run of its own on the CPU provider): its ops take a step's rows as
    [B, C]."""
    bundle = load_bundle(bundle_factory("tiny-odd", "split", plans="none"))
    c = bundle.config
    proto = onnx.load(str(bundle.graph_path(graph, KERNELS)), load_external_data=False)
    ops = [n.op_type for n in proto.graph.node]
    names = [i.name for i in proto.graph.input]
    print({op: ops.count(op) for op in set(ops)}, names)
    layers = [f"{kind}_{i}" for kind in ("conv_state", "ssm_state") for i in range(c.n_layer)]
    assert names == ["token_ids", *layers]
    assert [o.name for o in proto.graph.output] == ["logits", *(n.replace("state", "state_out") for n in layers)]
    assert "Split" not in ops
    if graph == DECODE:
        assert not {"Concat", "Squeeze", "Unsqueeze", "Reshape"} & set(ops)
    contract = bundle.contract(graph, KERNELS)
    assert contract.layered and contract.spec("ssm_state_0").shape == ("batch", c.d_inner, c.d_state)


def test_kernels_cuda_copies_equal_kernels_graphs(bundle_factory):
    """A bundle whose op library has the CUDA kernels keeps CUDA copies of its kernels graphs with fp32 products as
    MambaLinear: with CUTLASS in the library the decode and prefill graphs', each layer's three projections and the
    LM head; without it the decode graph's projections only (the head a Gemm, no prefill copy). On the CPU provider
    (MambaLinear's CPU loop) launches of a copy equal the kernels graph's within 1e-5, logits and states. A model
    with projection biases keeps those Gemms (MambaLinear takes no bias; x_proj has none). MambaLinear's CUDA
    kernel: tests/runtime/test_cuda.py, whose CUDA sessions run the copies."""
    import onnxruntime as ort

    from mambatrt.runtime.runners.ort.loader import session_options
    from mambatrt.runtime.runners.states import StateLayout

    bundle = load_bundle(bundle_factory("tiny-odd", "split", plans="none"))
    if not bundle.kernels_cuda:
        pytest.skip("the kernels library was built without nvcc: its bundles have no CUDA copies")
    cutlass = bool(bundle.manifest.kernels_library.get("cutlass"))
    c = bundle.config
    opts = session_options(ort, bundle, KERNELS)
    rng = np.random.default_rng(3)
    graphs = (DECODE, PREFILL) if cutlass else (DECODE,)
    print("CUTLASS in the library:", cutlass, "copies:", bundle.cuda_graphs)
    assert sorted(bundle.cuda_graphs) == sorted(graphs)
    if not cutlass:
        assert bundle.graph_path(PREFILL, KERNELS, cuda=True) == bundle.graph_path(PREFILL, KERNELS)
    for graph in graphs:
        plain, copy = bundle.graph_path(graph, KERNELS), bundle.graph_path(graph, KERNELS, cuda=True)
        assert copy != plain and copy.name == f"{graph}.kernels-cuda.onnx"
        ops = [(n.op_type, n.input[1] if len(n.input) > 1 else "") for n in onnx.load(str(copy)).graph.node]
        linear = [w for op, w in ops if op == "MambaLinear"]
        print(graph, len(linear), "MambaLinear;", [w for op, w in ops if op == "Gemm"])
        assert len(linear) == 3 * c.n_layer + cutlass and [op for op, _ in ops].count("Gemm") == 1 - cutlass
        sessions = [ort.InferenceSession(str(p), opts, providers=["CPUExecutionProvider"]) for p in (plain, copy)]
        layout = StateLayout(bundle.contract(graph, KERNELS), c)
        rows = 1 if graph == DECODE else 9
        for batch in (1, 5, 16) if graph == DECODE else (1, 3):
            ids = rng.integers(0, c.vocab_size, batch * rows).astype(np.int64)
            conv = (rng.standard_normal((batch, *c.conv_state_shape)) * 0.3).astype(np.float32)
            ssm = (rng.standard_normal((batch, *c.ssm_state_shape)) * 0.3).astype(np.float32)
            feed = {"token_ids": ids, **layout.feed(conv, ssm)}
            want, got = (layout.stacked(s.run(None, feed)) for s in sessions)
            for what, a, w in zip(("logits", "conv", "ssm"), got, want, strict=True):
                assert_close(f"{graph} batch {batch}: {what}", a, w, RTOL_FP32)
    biased = load_bundle(bundle_factory("tiny-bias", "split", plans="none"))
    ops = [n.op_type for n in onnx.load(str(biased.graph_path(DECODE, KERNELS, cuda=True))).graph.node]
    n_layer = biased.config.n_layer
    assert ops.count("MambaLinear") == n_layer + cutlass and ops.count("Gemm") == 2 * n_layer + 1 - cutlass


def test_manifest_pairs_kernels_graphs_with_library(bundle_factory, tmp_path):
    """kernels_graphs without kernels_library (or the other way round) is a one-line BundleError, not a crash later."""
    import shutil

    from mambatrt.errors import BundleError

    copy = tmp_path / "b"
    shutil.copytree(bundle_factory("tiny-odd", "split", plans="none"), copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    del manifest["kernels_library"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="'kernels_graphs' and 'kernels_library' come together"):
        load_bundle(copy)


def _plain_kernels_runner(bundle):
    """A one-thread CPU runner of the kernels graphs whose sessions run the kernels graphs themselves (their Gemms),
    not the CPU copies: the reference the copies are held to."""
    import onnxruntime as ort

    from mambatrt.runtime.runners.ort.loader import session_options

    runner = OrtCpuRunner(bundle, KERNELS, 1)
    opts = session_options(ort, bundle, KERNELS, 1)
    for graph in runner.graphs:
        path = str(bundle.graph_path(graph, KERNELS))
        runner.sessions[graph] = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    return runner


def test_kernels_cpu_copies_equal_kernels_graphs(bundle_factory):
    """Every bundle with the op library keeps CPU copies of its kernels graphs, every fp32 product (each layer's
    three projections and the LM head) as MambaLinear. A one-thread CPU backend runs them where the library packs
    (AVX-512): decode launches equal the kernels graph's within 1e-5 (logits and states) at batches 1, 5, 16 and
    the bundle's max_batch, a batch's rows equal bit for bit each row launched alone and the same launch on two
    threads (the products' columns split between them); prefill launches of 1, 37 and 64 rows (one sequence) and
    3 x 64 (three) within 1e-5; greedy tokens equal the kernels graphs'. A library that does not pack keeps the
    kernels graphs. A model with projection biases keeps those Gemms."""
    from mambatrt.runtime.runners.ort.loader import _cpu_linear_library, cpu_linear_copy

    bundle = load_bundle(bundle_factory("tiny-odd", "split", plans="none"))
    c = bundle.config
    assert sorted(bundle.cpu_graphs) == sorted((DECODE, PREFILL))
    for graph in (DECODE, PREFILL):
        copy = bundle.graph_path(graph, KERNELS, cpu=True)
        assert copy.name == f"{graph}.kernels-cpu.onnx" and copy != bundle.graph_path(graph, KERNELS)
        ops = [n.op_type for n in onnx.load(str(copy)).graph.node]
        assert ops.count("MambaLinear") == 3 * c.n_layer + 1 and "Gemm" not in ops
    packs = _cpu_linear_library(str(bundle.kernels_library))  # the library's own answer
    print("the library packs (AVX-512):", packs)
    assert cpu_linear_copy(bundle, KERNELS) == packs and not cpu_linear_copy(bundle, PORTABLE)
    if not packs:
        assert not any(OrtCpuRunner(bundle, KERNELS, 1).cpu_linear.values())
        pytest.skip("this CPU has no AVX-512: MambaLinear's CPU kernel is the plain loop, the copy is not run")
    linear, two = OrtCpuRunner(bundle, KERNELS, 1), OrtCpuRunner(bundle, KERNELS, 2)
    plain = _plain_kernels_runner(bundle)  # the kernels graphs' own sessions: their Gemms
    assert linear.cpu_linear[DECODE] and linear.cpu_linear[PREFILL]
    for graph in (DECODE, PREFILL):
        ran = [b.sessions[graph].get_modelmeta().custom_metadata_map.get("mambatrt.linear") for b in (linear, plain)]
        print(graph, "sessions' mambatrt.linear:", ran)
        assert ran == [f"MambaLinear x {3 * c.n_layer + 1}", None]
    rng = np.random.default_rng(5)
    for batch in (1, 5, 16, bundle.manifest.max_batch):
        ids = rng.integers(0, c.vocab_size, batch).astype(np.int64)
        conv = (rng.standard_normal((batch, *c.conv_state_shape)) * 0.3).astype(np.float32)
        ssm = (rng.standard_normal((batch, *c.ssm_state_shape)) * 0.3).astype(np.float32)
        got, want = (b.run_states(DECODE, ids, conv, ssm) for b in (linear, plain))
        for what, a, w in zip(("logits", "conv", "ssm"), got, want, strict=True):
            assert_close(f"CPU copy, batch {batch}: {what}", a, w, RTOL_FP32)
        last = linear.run_states(DECODE, ids[-1:], conv[-1:], ssm[-1:])
        for what, a, w in zip(("logits", "conv", "ssm"), last, got, strict=True):
            assert np.array_equal(a[0], w[-1]), f"batch {batch}: the last sequence's {what} differs alone"
        for what, a, w in zip(("logits", "conv", "ssm"), two.run_states(DECODE, ids, conv, ssm), got, strict=True):
            assert np.array_equal(a, w), f"batch {batch}: {what} differs on two threads"
    for batch, rows in ((1, 1), (1, 37), (1, 64), (3, 64)):
        ids = rng.integers(0, c.vocab_size, batch * rows).astype(np.int64)
        conv = (rng.standard_normal((batch, *c.conv_state_shape)) * 0.3).astype(np.float32)
        ssm = (rng.standard_normal((batch, *c.ssm_state_shape)) * 0.3).astype(np.float32)
        got, want = (b.run_states(PREFILL, ids, conv, ssm) for b in (linear, plain))
        for what, a, w in zip(("logits", "conv", "ssm"), got, want, strict=True):
            assert_close(f"CPU copy, prefill {batch} x {rows} rows: {what}", a, w, RTOL_FP32)
    prompt = rng.integers(0, c.vocab_size, 70).tolist()
    tokens = [ReferenceLoop(b).generate(prompt, Sampling(max_new_tokens=24)) for b in (linear, plain)]
    print("greedy tokens, CPU copy:", tokens[0])
    assert tokens[0] == tokens[1]
    biased = load_bundle(bundle_factory("tiny-bias", "split", plans="none"))
    for graph in (DECODE, PREFILL):
        ops = [n.op_type for n in onnx.load(str(biased.graph_path(graph, KERNELS, cpu=True))).graph.node]
        n_layer = biased.config.n_layer
        assert ops.count("MambaLinear") == n_layer + 1 and ops.count("Gemm") == 2 * n_layer


@pytest.mark.parametrize(
    "copies, message",
    [({"greedy": "decode.kernels-cuda.onnx"}, "should map graphs of"), ({"decode": "nowhere.onnx"}, "not listed")],
)
def test_manifest_checks_cuda_graphs(bundle_factory, tmp_path, copies, message):
    """kernels_library.cuda_graphs naming a graph the bundle does not have, or a file it does not list, is a one-line
    BundleError at load."""
    import shutil

    from mambatrt.errors import BundleError

    copy = tmp_path / "b"
    shutil.copytree(bundle_factory("tiny-odd", "split", plans="none"), copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["kernels_library"]["cuda_graphs"] = copies
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match=message) as caught:
        load_bundle(copy)
    print(caught.value)
    assert "\n" not in str(caught.value)
