"""Runtime: split and single bundles generate the tokens of transformers' greedy generate; states and errors."""

import json
from dataclasses import replace

import numpy as np
import pytest

from mambatrt.errors import InputError
from mambatrt.runtime.bundle import load_bundle
from mambatrt.runtime.engine import Engine, EngineConfig, Sampling
from mambatrt.runtime.engine.sampling import adjusted_logits, sample_token
from mambatrt.runtime.generation import generate
from mambatrt.runtime.runners import open_runner
from mambatrt.runtime.runners.ort.cpu import OrtCpuRunner
from mambatrt.runtime.tokenizer import eos_id
from mambatrt.testing import ReferenceLoop, assert_close, hf_greedy

NEW_TOKENS = 12


def _engine(path):
    """What `mambatrt run` generates with: the engine with one slot on the CPU."""
    bundle = load_bundle(path)
    return Engine(open_runner(bundle, "cpu"), EngineConfig(max_batch=1), eos_id=eos_id(bundle))


def _reference(path):
    bundle = load_bundle(path)
    return ReferenceLoop(OrtCpuRunner(bundle), eos_id=eos_id(bundle))


@pytest.mark.parametrize("prompt_len", [1, 63, 64, 65, 130])
def test_split_and_single_equal_hf_generate(bundle_factory, checkpoint_factory, prompt_len):
    name = "tiny-odd"
    prompt = np.random.default_rng(prompt_len).integers(0, 203, prompt_len).tolist()
    split = _engine(bundle_factory(name, "split", plans="none"))
    single = _engine(bundle_factory(name, "single", plans="none"))
    a = generate(split, prompt, Sampling(max_new_tokens=NEW_TOKENS))
    b = generate(single, prompt, Sampling(max_new_tokens=NEW_TOKENS))
    want = hf_greedy(checkpoint_factory(name), prompt, NEW_TOKENS)
    print(f"prompt {prompt_len}: split {a.tokens} single {b.tokens} hf {want}")
    assert a.tokens == b.tokens == want
    rows = split.runner.max_rows["prefill"]  # the kernels prefill graph's (the CPU runs it): one launch here
    assert a.prefill_launches == -(-prompt_len // rows) == 1 and b.prefill_launches == prompt_len


@pytest.mark.parametrize("prompt_len", [64, 65, 130])
def test_prefill_states_equal_token_by_token(bundle_factory, prompt_len):
    prompt = np.random.default_rng(7).integers(0, 203, prompt_len)
    split = _reference(bundle_factory("tiny-odd", "split", plans="none"))
    split.runner.reset()
    logits_chunked = split.prefill(prompt)
    chunked = split.runner.get_state()
    runner = split.runner
    runner.reset()
    for t in prompt:
        logits_steps = runner.run("decode", [t])[: runner.config.vocab_size]
    steps = runner.get_state()
    assert split.prefill_launches == -(-prompt_len // 64)
    assert_close("logits", logits_chunked, logits_steps, 1e-5)
    assert_close("conv state", chunked[0], steps[0], 1e-5)
    assert_close("ssm state", chunked[1], steps[1], 1e-5)


def test_prefill_wrapper_refuses_oversized_chunk(bundle_factory):
    runner = OrtCpuRunner(load_bundle(bundle_factory("tiny", "split", plans="none")))
    with pytest.raises(InputError, match="chunk of 65 rows exceeds the prefill graph's limit of 64 rows"):
        runner.run("prefill", np.zeros(65, np.int64))
    with pytest.raises(InputError, match="limit of 1 rows"):
        runner.run("decode", [1, 2])
    with pytest.raises(InputError, match="outside the vocabulary"):
        runner.run("decode", [96])


def test_continue_from_saved_state_equals_one_pass(bundle_factory, tmp_path):
    """A conversation continued from the states of a finished request (and its last token, not fed yet) gives the
    tokens of one pass over the whole text; the states also survive a round trip through a state file."""
    from mambatrt.runtime.engine.state_file import read_state, write_state

    path = bundle_factory("tiny", "split", plans="none")
    first, second = [5, 6, 7, 8], [9, 10, 11]
    a = generate(_engine(path), first, Sampling(max_new_tokens=3), keep_state=True)
    identity = load_bundle(path).identity
    write_state(tmp_path / "s.npz", identity, *a.final.state, a.tokens[-1])
    conv, ssm, pending = read_state(tmp_path / "s.npz", identity, 96)
    assert pending == a.tokens[-1]
    b = generate(_engine(path), [pending] + second, Sampling(max_new_tokens=5), state=(conv, ssm))
    whole = generate(_engine(path), first + a.tokens + second, Sampling(max_new_tokens=5))
    assert b.tokens == whole.tokens


def test_sampling_is_seeded_and_respects_top_k(bundle_factory):
    engine = _engine(bundle_factory("tiny", "split", plans="none"))
    s = Sampling(max_new_tokens=20, temperature=1.5, top_k=5, seed=3, stop_on_eos=False)
    a, b = generate(engine, [1, 2, 3], s), generate(engine, [1, 2, 3], s)
    other = Sampling(max_new_tokens=20, temperature=1.5, top_k=5, seed=4, stop_on_eos=False)
    c = generate(engine, [1, 2, 3], other)
    assert a.tokens == b.tokens and a.tokens != c.tokens
    nucleus = generate(engine, [1, 2, 3], Sampling(max_new_tokens=20, temperature=1.0, top_p=1e-6, seed=9))
    greedy = generate(engine, [1, 2, 3], Sampling(max_new_tokens=20))
    assert nucleus.tokens == greedy.tokens  # a vanishing nucleus keeps only the top token


class _Draw:
    """An RNG whose one draw is given."""

    def __init__(self, u: float) -> None:
        self.u = u

    def random(self) -> float:
        return self.u


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sample_token_inverts_the_cdf(dtype):
    """A temperature alone: the first token whose running probability exceeds the draw (index order), the
    temperature applied before the softmax; the caller's logits are left as they were (the work is in place on a
    copy)."""
    logits = np.log(np.array([0.1, 0.2, 0.3, 0.4])).astype(dtype)
    original = logits.copy()
    one = Sampling(temperature=1.0)
    picks = [sample_token(logits, one, _Draw(u)) for u in (0.0, 0.05, 0.15, 0.35, 0.65, 0.95, 1 - 1e-12)]
    print(picks)
    assert picks == [0, 0, 1, 2, 3, 3, 3]
    # T = 0.5 squares the probabilities: 0.01, 0.04, 0.09, 0.16 of 0.30; a draw of 0.2 (0.06) lands on token 2
    assert sample_token(logits, Sampling(temperature=0.5), _Draw(0.2)) == 2
    assert np.array_equal(logits, original) and logits.dtype == dtype


def _inverse_cdf_reference(weights, u):
    """The sequential definition: a running sum over every entry in index order."""
    cdf = np.cumsum(weights)
    return min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), weights.size - 1)


def test_inverse_cdf_in_blocks_equals_the_running_sum():
    """inverse_cdf (block sums, then a running sum inside the block found) picks what a running sum over every
    entry picks: sizes around the block's (one block, one and a part, whole blocks, a 50k vocabulary), draws at
    the ends, draws on the boundaries of the integer weights' exact sums, weights of very different sizes."""
    from mambatrt.runtime.engine.sampling import CDF_BLOCK, inverse_cdf

    rng = np.random.default_rng(3)
    sizes = [1, 2, CDF_BLOCK - 1, CDF_BLOCK, CDF_BLOCK + 1, 3 * CDF_BLOCK, 3 * CDF_BLOCK + 5, 4096, 50280]
    checked = ties = 0
    for v in sizes:
        for trial in range(60):
            if trial % 3 == 0:
                weights = rng.integers(0, 4, v).astype(np.float64)  # exact sums: boundaries land on draws
                weights[rng.integers(v)] += 1  # not all zero
            else:
                weights = np.exp(rng.standard_normal(v) * rng.uniform(0.1, 12))
            draws = [0.0, 1 - 2**-53, *rng.random(4)]
            if trial % 3 == 0:  # integer weights: sums are exact, so a draw can sit exactly on a boundary
                cuts = np.cumsum(weights)[: min(v, 8)] / weights.sum()
                draws += [c for c in cuts if c < 1]
            for u in draws:
                got, want = inverse_cdf(weights, float(u)), _inverse_cdf_reference(weights, float(u))
                checked += 1
                if got == want:
                    continue
                # sums grouped otherwise round otherwise: a different pick only where the running sum between the
                # two picks stays within rounding of the target (never with integer weights: their sums are exact)
                cdf = np.cumsum(weights)
                lo, hi = sorted((got, want))
                print("rounding tie", v, trial, u, got, want)
                assert trial % 3 and np.all(np.abs(cdf[lo:hi] - u * cdf[-1]) <= 1e-12 * cdf[-1]), (v, trial, u)
                ties += 1
    print("picks checked", checked, "rounding ties", ties)
    assert ties <= checked // 100


def test_logit_bias_and_penalties():
    """OpenAI's adjustments: a bias adds to a token's logit; presence subtracts once per generated token,
    frequency once per time it was generated; out-of-range values are refused."""
    logits = np.array([1.0, 0.5, 0.8, 0.0], np.float32)
    original = logits.copy()
    greedy = Sampling(max_new_tokens=1)
    assert sample_token(logits, greedy, None) == 0
    assert sample_token(logits, replace(greedy, logit_bias=((3, 1.5),)), None) == 3
    generated = [0, 0, 2]
    want = logits - np.array([2 * 0.25 + 0.1, 0, 0.25 + 0.1, 0], np.float32)
    adjusted = adjusted_logits(logits, Sampling(presence_penalty=0.1, frequency_penalty=0.25), generated)
    print(adjusted, want)
    assert np.allclose(adjusted, want) and np.array_equal(logits, original)  # a copy
    assert sample_token(logits, replace(greedy, presence_penalty=0.1, frequency_penalty=0.25), None, generated) == 1
    for bad in ({"presence_penalty": 2.5}, {"frequency_penalty": float("nan")}, {"logit_bias": ((1, 101.0),)},
                {"logit_bias": ((1, 1.0), (1, 2.0))}, {"logit_bias": ((-1, 1.0),)}):  # fmt: skip
        with pytest.raises(InputError):
            Sampling(**bad)


def test_logit_bias_reaches_the_tokens(bundle_factory):
    """A request's logit bias reaches the tokens the engine picks (the server's logit_bias)."""
    engine = _engine(bundle_factory("tiny", "split", plans="none"))
    biased = Sampling(max_new_tokens=4, logit_bias=((7, 100.0),))
    assert generate(engine, [1, 2], biased).tokens == [7, 7, 7, 7]


def test_cli_run_json(bundle_factory, cli):
    path = bundle_factory("tiny", "split", plans="none")
    code, out, _ = cli("run", path, "--prompt-ids", "1,2,3,4", "--max-new-tokens", "6", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["prompt_ids"] == [1, 2, 3, 4] and len(data["tokens"]) <= 6
    assert data["runner"] == "onnxruntime" and data["layout"] == "split" and data["text"] is None
    assert data["prefill_ms"] > 0 and data["device"] == "cpu" and data["graphs"] == "kernels"
    want = _reference(path).generate([1, 2, 3, 4], Sampling(max_new_tokens=6))
    assert data["tokens"] == want


def _one_line_error(cli, *argv, match):
    code, _, err = cli(*argv)
    print(err)
    assert code == 2 and len(err.strip().splitlines()) == 1 and match in err
    return err


def test_cli_bad_input(bundle_factory, cli, tmp_path):
    path = bundle_factory("tiny", "split", plans="none")
    _one_line_error(cli, "run", tmp_path / "none", "--prompt-ids", "1", match="bundle directory not found")
    _one_line_error(cli, "run", path, "--prompt-ids", "1,96", match="token id 96 is outside the vocabulary")
    _one_line_error(cli, "run", path, "--prompt-ids", "", match="empty prompt")
    _one_line_error(cli, "run", path, "--prompt", "hello", match="so text cannot be encoded; pass")
    _one_line_error(cli, "run", path, "--prompt-ids", "1", "--device", "cpu", "--top-p", "0", match="--top-p")
    other = bundle_factory("tiny", "single", plans="none")
    code, _, _ = cli("run", other, "--prompt-ids", "1,2", "--save-state", tmp_path / "other.npz")
    assert code == 0
    _one_line_error(
        cli, "run", path, "--prompt-ids", "3", "--load-state", tmp_path / "other.npz", match="another bundle"
    )
    _one_line_error(
        cli, "run", path, "--prompt-ids", "3", "--load-state", tmp_path / "x.npz", match="state file not found"
    )


def test_cli_corrupt_graph(bundle_factory, cli, tmp_path):
    import shutil

    path = tmp_path / "b"
    shutil.copytree(bundle_factory("tiny", "split", plans="none"), path)
    (path / "decode.onnx").write_bytes(b"garbage")
    _one_line_error(cli, "run", path, "--prompt-ids", "1", match="decode.onnx: 7 bytes, manifest says")


def test_auto_device_without_tensorrt_runtime_is_onnxruntime(bundle_factory):
    """A bundle with plans on a machine whose TensorRT cannot run them: onnxruntime, and a note saying why."""
    runner = open_runner(load_bundle(bundle_factory("tiny", "split")), "auto")
    print(runner.notes)
    assert runner.name == "onnxruntime" and runner.device == "cpu"
    assert any("TensorRT plans do not run here" in note for note in runner.notes)


def test_cli_checks_before_generating(bundle_factory, cli, tmp_path):
    """Output paths are checked before any work; --stream and --json together are refused by the parser."""
    path = bundle_factory("tiny", "split", plans="none")
    _one_line_error(cli, "run", path, "--prompt-ids", "1", "--save-state", tmp_path / "no" / "s.npz", match="not found")
    _one_line_error(cli, "run", path, "--prompt-ids", "1", "--save-state", tmp_path, match="is a folder")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(SystemExit) as exc:
        cli("run", path, "--prompt-ids", "1", "--stream", "--json")
    assert exc.value.code == 2


def test_io_contract_checked():
    """A graph whose inputs or outputs differ from the contract is refused with the name of what differs."""
    from mambatrt.config import MambaConfig
    from mambatrt.contract import graph_contract
    from mambatrt.errors import BundleError
    from mambatrt.runtime.runners.states import check_io

    config = MambaConfig(d_model=16, n_layer=2, vocab_size=64)
    contract = graph_contract(config, "prefill", max_batch=None)  # schema 1: no batch axis
    inputs = [
        ("token_ids", "int64", ["rows"]),
        ("conv_state", "float32", [2, 32, 3]),
        ("ssm_state", "float32", [2, 32, 16]),
    ]
    outputs = [
        ("logits", "float32", ["expr", 64]),
        ("conv_state_out", "float32", [2, 32, 3]),
        ("ssm_state_out", "float32", [2, 32, 16]),
    ]
    check_io(contract, inputs, outputs, "g.onnx")  # a symbolic dimension is not compared
    with pytest.raises(BundleError, match="conv_state is float32 \\[2, 32, 3\\], the contract says float32 \\[1, 2"):
        check_io(graph_contract(config, "prefill"), inputs, outputs, "g.onnx")  # a schema-1 graph, schema 2 read
    with pytest.raises(BundleError, match="ssm_state is float32 \\[2, 32, 8\\]"):
        check_io(contract, inputs[:2] + [("ssm_state", "float32", [2, 32, 8])], outputs, "g.onnx")
    with pytest.raises(BundleError, match="do not match the I/O contract"):
        check_io(contract, inputs, outputs[:2], "g.onnx")
    with pytest.raises(BundleError, match="token_ids is float32"):
        check_io(contract, [("token_ids", "float32", [-1])] + inputs[1:], outputs, "g.onnx")


@pytest.mark.parametrize(
    "args, match",
    [
        (["--prompt-ids", "99999999999999999999"], "token id 99999999999999999999 is outside"),
        (["--prompt-ids", "-5"], "token id -5 is outside"),
        (["--prompt-ids", "1", "--seed", "-1", "--temperature", "1"], "--seed must be in"),
        (["--prompt-ids", "1", "--seed", "99999999999999999999999"], "--seed must be in"),
        (["--prompt-ids", "1", "--temperature", "nan"], "--temperature must be a finite number"),
        (["--prompt-ids", "1", "--temperature", "inf"], "--temperature must be a finite number"),
        (["--prompt-ids", "1", "--temperature", "1e-320"], "too small to sample with"),
        (["--prompt-ids", "1", "--top-p", "nan"], "--top-p must be in"),
        (["--prompt-ids", "1", "--max-new-tokens", "-1"], "--max-new-tokens must be >= 0"),
    ],
)
def test_cli_hostile_numbers(bundle_factory, cli, args, match):
    _one_line_error(cli, "run", bundle_factory("tiny", "split", plans="none"), *args, match=match)


def test_cli_corrupt_state_files(bundle_factory, cli, tmp_path):
    """Random bytes, hand-made archives, pickled objects, wrong fields: one line each, never allow_pickle advice."""
    path = bundle_factory("tiny", "split", plans="none")
    (tmp_path / "random.npz").write_bytes(np.random.default_rng(0).bytes(500))
    np.savez(tmp_path / "missing.npz", format=np.array("mambatrt-state"))
    np.savez(tmp_path / "objects.npz", format=np.array(["a", 1], dtype=object))
    good = tmp_path / "good.npz"
    assert cli("run", path, "--prompt-ids", "1,2", "--save-state", good)[0] == 0
    with np.load(good) as data:
        fields = dict(data)
    np.savez(tmp_path / "nan.npz", **{**fields, "ssm_state": fields["ssm_state"] * np.nan})
    np.savez(tmp_path / "pending.npz", **{**fields, "pending": np.array(10**6)})
    for name, match in [
        ("random", "not a mambatrt-state v1 file"),
        ("missing", "not a mambatrt-state v1 file"),
        ("objects", "not a mambatrt-state v1 file"),
        ("nan", "not finite"),
        ("pending", "not a token id of this model"),
    ]:
        err = _one_line_error(
            cli, "run", path, "--prompt-ids", "3", "--load-state", tmp_path / f"{name}.npz", match=match
        )
        assert "allow_pickle" not in err
    assert cli("run", path, "--prompt-ids", "3", "--load-state", good)[0] == 0


@pytest.mark.parametrize("layout", ["split", "single"])
def test_cli_run_is_the_engine_with_one_slot(bundle_factory, cli, tmp_path, layout):
    """`mambatrt run` goes through the serving engine: saved conversations continue exactly (a prompt saved without
    generating, continued twice, sampled with a seed) as the reference loop on the runner does in one pass."""
    path = bundle_factory("tiny-odd", layout, plans="none")
    a, b, c = list(range(5, 75)), [9, 10, 11], [12]
    s0, s1 = tmp_path / "s0.npz", tmp_path / "s1.npz"

    def run(ids, n, *more):
        ids = ",".join(map(str, ids))
        code, out, err = cli("run", path, "--prompt-ids", ids, "--max-new-tokens", n, "--json", *more)
        assert code == 0, err
        return json.loads(out)

    assert run(a, 0, "--save-state", s0)["tokens"] == []
    first = run(b, 6, "--load-state", s0, "--save-state", s1, "--temperature", "0.9", "--seed", "4")
    second = run(c, 5, "--load-state", s1)
    gen = _reference(path)
    want1 = gen.generate(a + b, Sampling(max_new_tokens=6, temperature=0.9, seed=4))
    want2 = gen.generate(c, Sampling(max_new_tokens=5), reset=False)
    print(first["tokens"], want1, second["tokens"], want2)
    assert first["tokens"] == want1 and second["tokens"] == want2
    assert first["prefill_launches"] == (1 if layout == "split" else 3)
