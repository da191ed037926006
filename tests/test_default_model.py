"""The shipped default model (models/default): real text, cloze accuracy above a unigram baseline, and the same
accuracy from the split and single bundles and the PyTorch model; fp16 within one point of fp32."""

import json
from pathlib import Path

import numpy as np
import pytest

from mambatrt.compile.bundle import build_bundle
from mambatrt.runtime.bundle import load_bundle
from mambatrt.runtime.engine import Engine, EngineConfig, Sampling
from mambatrt.runtime.evaluate import evaluate, read_cloze, unigram_baseline
from mambatrt.runtime.generation import generate
from mambatrt.runtime.runners import open_runner
from mambatrt.runtime.tokenizer import Tokenizer, eos_id

DEFAULT = Path(__file__).resolve().parents[1] / "models" / "default"
CLOZE = DEFAULT / "cloze.jsonl"


@pytest.fixture(scope="module")
def bundles(tmp_path_factory, default_bundle):
    """split fp32 (conftest's, shared with the engine tests), single fp32, split fp16 bundles of the default model
    (ONNX-only: onnxruntime runs them)."""
    root = tmp_path_factory.mktemp("default")
    made = {"split": default_bundle}
    for name, layout, precision in (
        ("single", "single", "fp32"),
        ("fp16", "split", "fp16"),
    ):
        made[name] = load_bundle(
            build_bundle(DEFAULT, root / name, precision=precision, layout=layout, plans="none", quiet=True)
        )
    return made


@pytest.fixture(scope="module")
def scores(bundles):
    """name -> EvalResult on the shipped cloze set."""
    from mambatrt.reference.torch_runner import TorchRunner

    items = read_cloze(CLOZE, Tokenizer(bundles["split"]))
    out = {name: evaluate(_engine(b), items, progress=False) for name, b in bundles.items()}
    torch = Engine(TorchRunner(bundles["split"], DEFAULT), EngineConfig(max_batch=1))
    out["torch"] = evaluate(torch, items, progress=False)
    counts = np.asarray(json.loads((DEFAULT / "unigram_counts.json").read_text()), dtype=np.float64)
    out["unigram"] = unigram_baseline(items, counts)
    for name, r in out.items():
        print(f"{name}: accuracy {100 * r.accuracy:.2f} %, perplexity {r.perplexity:.2f} over {r.count}")
    return out


def _engine(bundle):
    """What `run` and `eval` generate with on the CPU: the engine with one slot."""
    return Engine(open_runner(bundle, "cpu"), EngineConfig(max_batch=1), eos_id=eos_id(bundle))


def test_shipped_files():
    assert (DEFAULT / "model.safetensors").stat().st_size <= 16 * 2**20
    for name in ("config.json", "tokenizer.json", "cloze.jsonl", "unigram_counts.json", "train_log.json"):
        assert (DEFAULT / name).is_file(), name
    assert sum(1 for _ in CLOZE.open()) >= 200


def test_accuracy_clearly_above_unigram(scores):
    model, uni = scores["split"], scores["unigram"]
    assert model.accuracy >= uni.accuracy + 0.05
    assert model.perplexity <= 0.5 * uni.perplexity


def test_split_single_and_pytorch_agree(scores):
    assert scores["split"].accuracy == scores["single"].accuracy == scores["torch"].accuracy
    assert scores["split"].perplexity == pytest.approx(scores["single"].perplexity, rel=1e-4)
    assert scores["split"].perplexity == pytest.approx(scores["torch"].perplexity, rel=1e-4)


def test_fp16_within_one_point(scores):
    assert abs(scores["fp16"].accuracy - scores["split"].accuracy) <= 0.01


def test_generates_readable_text(bundles):
    bundle = bundles["split"]
    tok = Tokenizer(bundle)
    out = generate(_engine(bundle), tok.encode("The module provides"), Sampling(max_new_tokens=30))
    text = tok.decode(out.tokens)
    print(repr(text))
    words = text.split()
    assert len(words) >= 5
    assert sum(w.strip(".,;:()'\"").isalpha() for w in words) >= 0.6 * len(words)


def test_hf_loads_the_checkpoint_and_agrees(bundles):
    from mambatrt.testing import hf_greedy

    bundle = bundles["split"]
    prompt = Tokenizer(bundle).encode("Return a new list of the")
    ours = generate(_engine(bundle), prompt, Sampling(max_new_tokens=12)).tokens
    assert ours == hf_greedy(DEFAULT, prompt, 12)


def test_stream_decodes_multibyte_characters(bundles, cli):
    """Tokens arriving one at a time (streaming) decode to the same text as the whole sequence, also when a character
    of several bytes is split across tokens; `run --stream` prints what `run` prints."""
    tok = Tokenizer(bundles["split"])
    text = "café – 日本語 naïve ✓ ok"
    ids = tok.encode(text)
    assert any(tok.decode([i]) == "\ufffd" for i in ids)  # some characters really are split across tokens
    step = tok.stream()
    assert "".join(step(i) for i in ids) == tok.decode(ids) == text
    argv = ["run", bundles["split"].path, "--prompt", "Größe: 日本", "--max-new-tokens", "20"]
    code, plain, _ = cli(*argv)
    code_s, streamed, _ = cli(*argv, "--stream")
    print(repr(plain), repr(streamed))
    assert code == code_s == 0 and streamed == plain and "\ufffd" not in streamed


def test_eval_refuses_bad_inputs_before_evaluating(bundles, cli, tmp_path):
    """Eval data of the wrong type or encoding and unigram counts of the wrong shape: one line, exit 2."""
    path = bundles["split"].path
    cases = {
        "latin1.jsonl": ('{"text": "caf\xe9 au lait"}\n'.encode("latin-1"), "not UTF-8"),
        "number.jsonl": (b'{"text": 42}\n', "'text' should be a string"),
    }
    for name, (data, match) in cases.items():
        (tmp_path / name).write_bytes(data)
        code, _, err = cli("eval", path, "--data", tmp_path / name)
        assert code == 2 and len(err.strip().splitlines()) == 1 and match in err, err
    (tmp_path / "counts.json").write_text("[1, 2, 3]")
    code, _, err = cli("eval", path, "--data", CLOZE, "--unigram", tmp_path / "counts.json")
    assert code == 2 and "non-negative counts" in err and len(err.strip().splitlines()) == 1, err
