"""The shipped default model (models/default): real text, cloze accuracy above a unigram baseline, and the same
accuracy from the split and single bundles and the PyTorch model; fp16 within one point of fp32."""

import json
from pathlib import Path

import numpy as np
import pytest

from mambatrt.compile.bundle import build_bundle
from mambatrt.runtime.backends import OrtBackend
from mambatrt.runtime.bundle import load_bundle
from mambatrt.runtime.evaluate import evaluate, read_cloze, unigram_baseline
from mambatrt.runtime.generate import Generator, Sampling
from mambatrt.runtime.tokenizer import Tokenizer, eos_id

DEFAULT = Path(__file__).resolve().parents[1] / "models" / "default"
CLOZE = DEFAULT / "cloze.jsonl"


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    """split fp32, single fp32, split fp16 bundles of the default model (ONNX-only: onnxruntime runs them)."""
    root = tmp_path_factory.mktemp("default")
    made = {}
    for name, layout, precision in (
        ("split", "split", "fp32"),
        ("single", "single", "fp32"),
        ("fp16", "split", "fp16"),
    ):
        made[name] = load_bundle(
            build_bundle(DEFAULT, root / name, precision=precision, layout=layout, engines="none", quiet=True)
        )
    return made


@pytest.fixture(scope="module")
def scores(bundles):
    """name -> EvalResult on the shipped cloze set."""
    from mambatrt.export.torch_backend import TorchBackend

    items = read_cloze(CLOZE, Tokenizer(bundles["split"]))
    out = {name: evaluate(Generator(OrtBackend(b)), items, progress=False) for name, b in bundles.items()}
    out["torch"] = evaluate(Generator(TorchBackend(bundles["split"], DEFAULT)), items, progress=False)
    counts = np.asarray(json.loads((DEFAULT / "unigram_counts.json").read_text()), dtype=np.float64)
    out["unigram"] = unigram_baseline(items, counts)
    for name, r in out.items():
        print(f"{name}: accuracy {100 * r.accuracy:.2f} %, perplexity {r.perplexity:.2f} over {r.count}")
    return out


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
    gen = Generator(OrtBackend(bundle), eos_id=eos_id(bundle))
    out = gen.generate(tok.encode("The module provides"), Sampling(max_new_tokens=30))
    text = tok.decode(out.tokens)
    print(repr(text))
    words = text.split()
    assert len(words) >= 5
    assert sum(w.strip(".,;:()'\"").isalpha() for w in words) >= 0.6 * len(words)


def test_hf_loads_the_checkpoint_and_agrees(bundles):
    from mambatrt.testing import hf_greedy

    bundle = bundles["split"]
    prompt = Tokenizer(bundle).encode("Return a new list of the")
    ours = Generator(OrtBackend(bundle), eos_id=eos_id(bundle)).generate(prompt, Sampling(max_new_tokens=12)).tokens
    assert ours == hf_greedy(DEFAULT, prompt, 12)
