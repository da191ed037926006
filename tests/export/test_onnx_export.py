"""ONNX export: onnxruntime equals the PyTorch model; chunked prefill equals decode steps; weights stored once."""

import os
import shutil

import numpy as np
import onnx
import pytest
import torch

from mambatrt.contract import DECODE, PREFILL, graph_contract
from mambatrt.errors import InputError
from mambatrt.export.checkpoint import load_model
from mambatrt.export.graphs import FORBIDDEN_OPS
from mambatrt.export.onnx_export import export_onnx
from mambatrt.export.scan_rows import MAX_CONCAT_INPUTS
from mambatrt.export.weights import WEIGHTS_FILE
from mambatrt.testing import assert_close

ort = pytest.importorskip("onnxruntime")

RTOL_FP32 = 1e-5
# fp16 keeps 11 mantissa bits (unit roundoff 4.9e-4), bf16 8 (3.9e-3). Logits pass through ~10 matrix products
# and 2-3 residual layers, so we allow ~20 unit roundoffs relative to the largest logit.
RTOL_HALF = {"fp16": 1e-2, "bf16": 8e-2}


def _session(path):
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def _run(session, ids, conv, ssm):
    """One sequence through a graph: its states get (and lose) the contract's batch axis, a batch of one."""
    feed = {"token_ids": np.asarray(ids, dtype=np.int64), "conv_state": np.asarray(conv)[None]}
    logits, conv_out, ssm_out = session.run(None, {**feed, "ssm_state": np.asarray(ssm)[None]})
    return logits, conv_out[0], ssm_out[0]


@pytest.fixture(scope="module")
def exported(checkpoint_factory, tmp_path_factory):
    """name -> (model, export dir) for fp32 exports (the portable graphs), cached per module."""
    cache = {}

    def get(name):
        if name not in cache:
            ckpt = checkpoint_factory(name)
            out = tmp_path_factory.mktemp(f"onnx-{name}")
            export_onnx(ckpt, out, kernels=False, progress=False)
            cache[name] = (load_model(ckpt), out)
        return cache[name]

    return get


def _random_states(model, seed):
    g = torch.Generator().manual_seed(seed)
    c = model.config
    return torch.randn(c.conv_state_shape, generator=g), torch.randn(c.ssm_state_shape, generator=g) * 0.5


@pytest.mark.parametrize("rows", [1, 2, 37, 64])
def test_prefill_onnx_equals_torch(exported, rows):
    model, out = exported("tiny")
    conv, ssm = _random_states(model, rows)
    ids = torch.randint(0, model.config.vocab_size, (rows,), generator=torch.Generator().manual_seed(rows))
    want = model.rows(ids, conv, ssm, scan="sequential")
    got = _run(_session(out / "prefill.onnx"), ids, conv, ssm)
    for name, g, w in zip(("logits", "conv_state_out", "ssm_state_out"), got, want, strict=True):
        assert g.dtype == np.float32 and g.shape == tuple(w.shape)
        assert_close(f"prefill rows={rows} {name}", g, w, RTOL_FP32)
    assert int(got[0].argmax()) == int(want[0].argmax())


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_score_onnx_gives_every_rows_logits(exported, rows):
    """score.onnx: every row's logits, row j that of prefill.onnx over the first j + 1 rows, the states the same."""
    model, out = exported("tiny")
    conv, ssm = _random_states(model, 100 + rows)
    ids = torch.randint(0, model.config.vocab_size, (rows,), generator=torch.Generator().manual_seed(rows))
    logits, conv_out, ssm_out = _run(_session(out / "score.onnx"), ids, conv, ssm)
    prefill = _session(out / "prefill.onnx")
    assert logits.shape == (rows, model.config.vocab_padded)
    for j in range(rows):
        want, want_conv, want_ssm = _run(prefill, ids[: j + 1], conv, ssm)
        assert_close(f"score row {j} of {rows}", logits[j], want[0], RTOL_FP32)
    assert_close("score conv_state_out", conv_out, want_conv, RTOL_FP32)
    assert_close("score ssm_state_out", ssm_out, want_ssm, RTOL_FP32)


def test_prefill_other_max_rows(checkpoint_factory, tmp_path):
    """A chunk limit that is not a power of two (20: blocks of 4, 5 blocks) exports and runs like the model."""
    ckpt = checkpoint_factory("tiny")
    export_onnx(ckpt, tmp_path, max_rows=20, graphs=(PREFILL,), kernels=False, progress=False)
    model, session = load_model(ckpt, max_rows=20), _session(tmp_path / "prefill.onnx")
    for rows in (1, 9, 20):
        conv, ssm = _random_states(model, rows)
        ids = torch.randint(0, model.config.vocab_size, (rows,), generator=torch.Generator().manual_seed(rows))
        want = model.rows(ids, conv, ssm, scan="sequential")
        got = _run(session, ids, conv, ssm)
        for name, g, w in zip(("logits", "conv_state_out", "ssm_state_out"), got, want, strict=True):
            assert_close(f"max_rows=20 rows={rows} {name}", g, w, RTOL_FP32)


def test_decode_onnx_equals_torch(exported):
    model, out = exported("tiny")
    conv, ssm = _random_states(model, 5)
    want = model.step(torch.tensor([7]), conv, ssm)
    got = _run(_session(out / "decode.onnx"), [7], conv, ssm)
    for name, g, w in zip(("logits", "conv_state_out", "ssm_state_out"), got, want, strict=True):
        assert_close(f"decode {name}", g, w, RTOL_FP32)
    assert int(got[0].argmax()) == int(want[0].argmax())


@pytest.mark.parametrize("name", ["tiny-odd", "tiny-n8-k3", "tiny-bias"])
def test_75_tokens_prefill_64_plus_11_equals_75_decode_steps(exported, name):
    model, out = exported(name)
    prefill, decode = _session(out / "prefill.onnx"), _session(out / "decode.onnx")
    ids = np.random.default_rng(75).integers(0, model.config.vocab_size, 75)
    conv, ssm = (s.numpy() for s in model.zero_states())
    _, c1, s1 = _run(prefill, ids[:64], conv, ssm)
    chunk = _run(prefill, ids[64:], c1, s1)
    step = (None, conv, ssm)
    for t in range(75):
        step = _run(decode, ids[t : t + 1], step[1], step[2])
    for label, g, w in zip(("logits", "conv_state_out", "ssm_state_out"), chunk, step, strict=True):
        assert_close(f"{name} 64+11 vs 75 steps {label}", g, w, RTOL_FP32)
    assert int(chunk[0].argmax()) == int(step[0].argmax())


def test_graph_contract_checker_and_ops(exported):
    model, out = exported("tiny")
    for graph in (DECODE, PREFILL):
        proto = onnx.load(str(out / f"{graph}.onnx"), load_external_data=False)
        onnx.checker.check_model(str(out / f"{graph}.onnx"))
        contract = graph_contract(model.config, graph)
        assert [i.name for i in proto.graph.input] == [t.name for t in contract.inputs]
        assert [o.name for o in proto.graph.output] == [t.name for t in contract.outputs]
        dims = [d.dim_param or d.dim_value for d in proto.graph.input[0].type.tensor_type.shape.dim]
        assert dims == (["rows"] if graph == PREFILL else ["batch"])
        ops = {n.op_type for n in proto.graph.node}
        assert not ops & set(FORBIDDEN_OPS), ops & set(FORBIDDEN_OPS)
        # softplus's threshold branch is folded into a plain Softplus; the decode step indexes no rows
        assert "Softplus" in ops and not ops & {"Where", "Greater"}, ops
        if graph == DECODE:
            inputs = {"token_ids", "conv_state", "ssm_state"}
            row_gathers = [n.name for n in proto.graph.node if n.op_type == "Gather" and not inputs & set(n.input)]
            assert not row_gathers, row_gathers
        assert proto.producer_name == "mambatrt"
        assert proto.opset_import[0].version >= 17
        meta = {p.key: p.value for p in proto.metadata_props}
        assert meta["mambatrt.graph"] == graph and meta["mambatrt.precision"] == "fp32"


def _external_refs(path):
    proto = onnx.load(str(path), load_external_data=False)
    refs = {}
    for t in proto.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            info = {e.key: e.value for e in t.external_data}
            refs[t.name] = (info["location"], int(info["offset"]), tuple(t.dims))
    return refs


@pytest.mark.parametrize("name", ["tiny", "tiny-bias"])
def test_weights_stored_once(exported, name):
    model, out = exported(name)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    weights = (out / WEIGHTS_FILE).stat().st_size
    print(f"{name}: weights.bin {weights} bytes for {param_bytes} parameter bytes")
    assert weights <= 1.05 * param_bytes
    decode, prefill = _external_refs(out / "decode.onnx"), _external_refs(out / "prefill.onnx")
    assert {loc for loc, _, _ in list(decode.values()) + list(prefill.values())} == {WEIGHTS_FILE}
    heads = [ref for refs in (decode, prefill) for key, ref in refs.items() if "embeddings" in key or "lm_head" in key]
    emb_offsets = {off for _, off, _ in heads}
    # tied: one embedding matrix serves Gather and lm_head in both graphs; untied: embedding + lm_head
    assert len(emb_offsets) == (1 if model.config.tie_embeddings else 2)


def test_kernels_graphs(checkpoint_factory, tmp_path):
    """The kernels flavour's graphs: mambatrt's ops, each layer's states an input and an output of their own
    (contract schema 4), a batched prefill, the weights shared with the portable graphs (weights.bin holds each
    once); their CPU copies take every product, the LM head's too, as MambaLinear."""
    from mambatrt.contract import DEFAULT_MAX_PREFILL_BATCH, KERNELS

    ckpt = checkpoint_factory("tiny")
    model = load_model(ckpt)
    result = export_onnx(ckpt, tmp_path / "k", cpu_linear=True, progress=False)
    assert set(result.flavoured) == {KERNELS} and set(result.cpu_graphs) == {DECODE, PREFILL} and not result.cuda_graphs
    for graph in (DECODE, PREFILL):
        contract = graph_contract(model.config, graph, prefill_batch=DEFAULT_MAX_PREFILL_BATCH, layered=True)
        proto = onnx.load(str(result.flavoured[KERNELS][graph]), load_external_data=False)
        assert [i.name for i in proto.graph.input] == [t.name for t in contract.inputs]
        assert [o.name for o in proto.graph.output] == [t.name for t in contract.outputs]
        assert len(proto.graph.input) == 1 + 2 * model.config.n_layer
        dims = [d.dim_param or d.dim_value for d in proto.graph.input[1].type.tensor_type.shape.dim]
        assert dims == ["batch", model.config.d_inner, model.config.d_conv - 1]  # conv_state_0 [B, E, K-1]
        ops = result.op_counts[f"{graph}.{KERNELS}"]
        assert ops["MambaConv"] == ops["MambaScan"] == model.config.n_layer and not set(ops) & set(FORBIDDEN_OPS)
        meta = {p.key: p.value for p in proto.metadata_props}
        assert meta["mambatrt.flavour"] == KERNELS and meta["mambatrt.graph"] == graph
        assert result.op_counts[f"{graph}.{KERNELS}-cpu"]["MambaLinear"] == 3 * model.config.n_layer + 1
        refs = _external_refs(result.cpu_graphs[graph])
        assert {loc for loc, _, _ in refs.values()} == {WEIGHTS_FILE}
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"weights.bin {result.weights_bytes} bytes for {param_bytes} parameter bytes, both flavours")
    assert result.weights_bytes <= 1.05 * param_bytes


def test_exported_dir_loads_from_elsewhere(exported, tmp_path, monkeypatch):
    model, out = exported("tiny")
    moved = tmp_path / "elsewhere" / "graphs"
    shutil.copytree(out, moved)
    monkeypatch.chdir(tmp_path)
    os.makedirs("cwd")
    monkeypatch.chdir("cwd")
    conv, ssm = model.zero_states()
    got = _run(_session(moved.resolve() / "prefill.onnx"), [1, 2, 3], conv, ssm)
    want = model.rows(torch.tensor([1, 2, 3]), conv, ssm)
    assert_close("moved export logits", got[0], want[0], RTOL_FP32)


def _half_logits(out, precision, ids, conv, ssm):
    """Run a half-precision prefill graph: onnxruntime for fp16; for bf16, onnxruntime's CPU provider has no
    bf16 Gemm kernel, so the graph runs on onnx's reference evaluator (bf16 runs on TensorRT and CUDA)."""
    path = out / "prefill.onnx"
    if precision == "fp16":
        return _run(_session(path), ids, conv, ssm)
    from onnx.reference import ReferenceEvaluator

    feed = {"token_ids": np.asarray(ids, dtype=np.int64), "conv_state": conv[None], "ssm_state": ssm[None]}
    logits, conv_out, ssm_out = ReferenceEvaluator(str(path)).run(None, feed)
    return logits, conv_out[0], ssm_out[0]


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_half_precision_exports(exported, checkpoint_factory, tmp_path, precision):
    model, out32 = exported("tiny")
    out = tmp_path / precision
    export_onnx(checkpoint_factory("tiny"), out, precision=precision, progress=False)
    ids = np.array([5, 17, 3, 88, 42, 9, 61, 23, 70, 1, 33, 12])
    conv, ssm = (s.numpy() for s in model.zero_states())
    ref = _run(_session(out32 / "prefill.onnx"), ids, conv, ssm)
    got = _half_logits(out, precision, ids, conv, ssm)
    for g in got:
        assert g.dtype == np.float32  # logits and states stay float32
    assert_close(f"{precision} vs fp32 logits", got[0], ref[0], RTOL_HALF[precision])
    assert_close(f"{precision} vs fp32 ssm state", got[2], ref[2], RTOL_HALF[precision])
    assert int(got[0].argmax()) == int(ref[0].argmax())
    types = {t.data_type for t in onnx.load(str(out / "prefill.onnx"), load_external_data=False).graph.initializer}
    half = onnx.TensorProto.FLOAT16 if precision == "fp16" else onnx.TensorProto.BFLOAT16
    assert half in types
    full = (out32 / WEIGHTS_FILE).stat().st_size
    # in/out projections and embeddings in half; the small x/dt projections stay fp32 (a larger share in "tiny")
    assert (out / WEIGHTS_FILE).stat().st_size < 0.7 * full


def test_bad_arguments_leave_nothing(tiny_checkpoint, tmp_path):
    with pytest.raises(InputError, match="unknown precision 'int4'"):
        export_onnx(tiny_checkpoint, tmp_path / "x", precision="int4", progress=False)
    with pytest.raises(InputError, match="unknown graph 'encoder'"):
        export_onnx(tiny_checkpoint, tmp_path / "y", graphs=("encoder",), progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.slow
def test_model_over_2gb_exports_and_runs(tmp_path):
    """2.5 GB of fp32 weights: beyond protobuf's 2 GB limit, so only external data works."""
    from mambatrt.testing import write_hf_checkpoint

    ckpt = write_hf_checkpoint(tmp_path / "big", vocab_size=60000, hidden_size=5120, num_hidden_layers=2)
    result = export_onnx(ckpt, tmp_path / "onnx", progress=False)
    print(f"exported {result.param_bytes / 2**30:.2f} GiB of parameters in {result.seconds:.1f} s")
    assert result.param_bytes > 2**31
    assert result.weights_bytes <= 1.01 * result.param_bytes
    for graph in result.graphs.values():
        assert graph.stat().st_size < 2**20  # the graphs hold no weights
    (ckpt / "model.safetensors").unlink()  # free the disk before running
    conv = np.zeros((2, 10240, 3), np.float32)
    ssm = np.zeros((2, 10240, 16), np.float32)
    logits, _, _ = _run(_session(result.graphs["decode"]), [7], conv, ssm)
    assert logits.shape == (1, 60000) and np.isfinite(logits).all()


def test_many_layers_keep_concats_capturable(tmp_path):
    """40 layers: every Concat has at most 32 inputs (onnxruntime's limit under CUDA graph capture; mamba-2.8b
    has 64 layers), and the grouped state stack still equals the PyTorch model."""
    from mambatrt.testing import write_hf_checkpoint

    ckpt = write_hf_checkpoint(tmp_path / "deep", vocab_size=64, hidden_size=16, num_hidden_layers=40, state_size=4)
    result = export_onnx(ckpt, tmp_path / "onnx", graphs=(DECODE,), progress=False)
    proto = onnx.load(str(result.graphs[DECODE]), load_external_data=False)
    widest = max(len(n.input) for n in proto.graph.node if n.op_type == "Concat")
    print(f"widest Concat: {widest} inputs")
    assert widest <= MAX_CONCAT_INPUTS
    model = load_model(ckpt)
    conv, ssm = model.zero_states()
    conv, ssm = conv + 0.5, ssm - 0.25
    want = model.step(torch.tensor([5]), conv, ssm)
    got = _run(_session(result.graphs[DECODE]), [5], conv.numpy(), ssm.numpy())
    for name, g, w in zip(("logits", "conv", "ssm"), got, want, strict=True):
        assert_close(f"40 layers {name}", g, w.numpy(), 1e-5)


@pytest.mark.parametrize("beta", [1.0, 2.0])
def test_softplus_plain_only_for_beta_one(tmp_path, beta):
    """torch's thresholded softplus exports as one Softplus node for beta = 1 (equal in float32) and keeps its
    threshold otherwise; either way the graph computes torch's value."""
    from mambatrt.export.graphs import softplus

    class Soft(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.softplus(x, beta=beta) * 2

    x = torch.linspace(-30, 30, 61).reshape(1, 61)
    table = {torch.ops.aten.softplus.default: softplus}
    program = torch.onnx.export(Soft(), (x,), dynamo=True, custom_translation_table=table, verbose=False)
    model = program.model_proto
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("Softplus") == 1 and ("Where" in ops) == (beta != 1), ops
    path = tmp_path / "soft.onnx"
    onnx.save(model, str(path))
    got = _session(path).run(None, {model.graph.input[0].name: x.numpy()})[0]
    assert_close(f"softplus beta={beta}", got, Soft()(x).numpy(), 1e-6)


def test_export_out_checked_first(tiny_checkpoint, tmp_path):
    """An output folder that is a file, or under a file, is refused before any work; nothing is written."""
    a_file = tmp_path / "notes.txt"
    a_file.write_text("keep")
    for out, match in ((a_file, "is a file; --out takes a folder"), (a_file / "sub", "not a writable folder")):
        with pytest.raises(InputError, match=match):
            export_onnx(tiny_checkpoint, out, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"] and a_file.read_text() == "keep"


@pytest.mark.parametrize("batch", [1, 2, 7, 64])
def test_batched_decode_equals_single_decodes(exported, batch):
    """One decode launch of B sequences at different positions (different states) equals B launches of one, and
    the model's batched step; greedy tokens equal."""
    model, out = exported("tiny")
    session = _session(out / "decode.onnx")
    g = np.random.default_rng(batch)
    conv = g.standard_normal((batch, *model.config.conv_state_shape)).astype(np.float32)
    ssm = (g.standard_normal((batch, *model.config.ssm_state_shape)) * 0.5).astype(np.float32)
    ids = g.integers(0, model.config.vocab_size, batch)
    logits, conv_out, ssm_out = session.run(None, {"token_ids": ids, "conv_state": conv, "ssm_state": ssm})
    assert logits.shape == (batch, model.config.vocab_padded) and conv_out.shape == conv.shape
    for i in range(batch):
        one = _run(session, ids[i : i + 1], conv[i], ssm[i])
        batched = (logits[i : i + 1], conv_out[i], ssm_out[i])
        for name, got, want in zip(("logits", "conv", "ssm"), batched, one, strict=True):
            assert_close(f"batch {batch} row {i} {name}", got, want, 1e-5)
        assert int(logits[i].argmax()) == int(one[0].argmax())
    want = model.steps(torch.tensor(ids), torch.tensor(conv), torch.tensor(ssm))
    assert_close(f"batch {batch} vs torch", logits, want[0], RTOL_FP32)
