"""Every command fed hostile values: each is one line naming the problem, exit 2, no traceback, nothing written.

Hostile numbers, wrong files, output paths that cannot be used. Each case runs the real command in-process on real
bundles and checkpoints.
"""

import pytest

NUM = "99999999999999999999999"


@pytest.fixture(scope="module")
def places(tmp_path_factory, checkpoint_factory, bundle_factory):
    root = tmp_path_factory.mktemp("hostile")
    a_file = root / "a-file.txt"
    a_file.write_text("not a folder")
    bad_json = root / "bad.jsonl"
    bad_json.write_text("{not json\n")
    return {
        "bundle": bundle_factory("tiny", "split", plans="none"),
        "ckpt": checkpoint_factory("tiny"),
        "file": a_file,
        "bad_json": bad_json,
        "root": root,
    }


CASES = [
    # run
    ("run {bundle} --prompt-ids 1 --max-new-tokens -3", "--max-new-tokens must be >= 0"),
    ("run {bundle} --prompt-ids " + NUM, "is outside the vocabulary"),
    ("run {bundle} --prompt-ids 1 --top-k -1", "--top-k must be >= 0"),
    ("run {bundle} --prompt-ids 1 --top-p 1.5", "--top-p must be in (0, 1]"),
    ("run {bundle} --prompt-ids 1 --temperature -1", "--temperature must be a finite number >= 0"),
    ("run {bundle} --prompt-ids 1 --seed " + NUM, "--seed must be in"),
    ("run {bundle} --prompt-ids 1 --load-state {file}", "not a mambatrt-state v1 file"),
    ("run {bundle} --prompt-ids 1 --save-state {file}/s.npz", "folder not found"),
    ("run {file} --prompt-ids 1", "is a file, not a bundle directory"),
    ("run {ckpt} --prompt-ids 1", "this is not a mambatrt bundle"),
    # bench
    ("bench {bundle} --prompt-lengths " + NUM, "prompt lengths go up to"),
    ("bench {bundle} --prompt-lengths 0", "every prompt length must be >= 1"),
    ("bench {bundle} --repeat -1", "--repeat"),
    ("bench {bundle} --reference hf --checkpoint {root}/none", "no checkpoint for --reference hf"),
    # eval
    ("eval {bundle} --data {bad_json} --limit 0", "--limit must be >= 1"),
    ("eval {bundle} --data {root}/none.jsonl", "has no tokenizer.json"),
    # compare
    ("compare {bundle} --prompt-len -4", "--prompt-len must be >= 1"),
    ("compare {bundle} --checkpoint {file}", "not valid JSON"),
    # bundle
    ("bundle {ckpt} --out {file}", "is a file; --out takes a folder"),
    ("bundle {ckpt} --out {root}/b --max-rows " + NUM, "--max-rows must be in 1..4096"),
    ("bundle {ckpt} --out {root}/b --precision fp7", "unknown precision 'fp7'"),
    ("bundle {file} --out {root}/b", "not valid JSON"),
    ("bundle {root}/none --out {root}/b", "config file not found"),
    ("bundle {ckpt} --out {file}/b", "not a writable folder"),
    ("bundle {ckpt} --out {root}/b --max-rows -1", "--max-rows must be in 1..4096"),
    ("bundle {ckpt} --out {root}/b --max-batch 0", "--max-batch must be in 1..4096"),
    ("bundle {ckpt} --out {root}/b --max-prefill-batch 0", "--max-prefill-batch must be in 1..4096"),
    ("bundle {ckpt} --out {root}/b --max-prefill-batch 5000", "--max-prefill-batch must be in 1..4096"),
    ("bundle {ckpt} --out {ckpt} --force", "is the checkpoint or a folder holding it"),
    # serve and its load client (refused before any server starts)
    ("serve {bundle} --prefill-rows 0", "--prefill-rows must be >= 1"),
    ("serve {bundle} --api-server-count 0", "--api-server-count must be >= 1"),
    ("serve {bundle} --device cpu --port 0", "--port must be in 1..65535"),
    ("serve {bundle} --max-queue 0", "--max-queue must be >= 1"),
    ("serve {bundle} --state-cache-mib nan", "--state-cache-mib must be >= 0"),
    ("serve {bundle} --threads -2", "--threads must be >= 0"),
    ("bench-serve --url http://127.0.0.1:9 --model m --concurrency 0", "--concurrency, --input-tokens"),
    ("bench-serve --url http://127.0.0.1:9 --model m --seed -1", "--seed must be >= 0"),
    ("bench-serve --url http://127.0.0.1:9 --model m --temperature -1", "--temperature must be a finite number"),
    ("bench-serve --url http://127.0.0.1:9 --model m --temperature 0.0001", "too small to sample with"),
    ("bench-serve --url http://127.0.0.1:9 --model m", "no OpenAI-compatible server answers"),
    ("eval --data {file}", "a BUNDLE_DIR or --url URL"),
    ("eval --url http://127.0.0.1:9 --data {file} --concurrency 0", "--concurrency must be >= 1"),
    ("eval --url http://127.0.0.1:9 --data {file} --reference {root}/none", "no checkpoint (config.json)"),
    ("eval --url http://127.0.0.1:9 --data {file}", "no OpenAI-compatible server answers"),
]


@pytest.mark.parametrize("argv, match", CASES, ids=[c[0].split(" {")[0] + ": " + c[1] for c in CASES])
def test_hostile_input_is_one_line(places, cli, capsys, argv, match):
    capsys.readouterr()  # fixtures' own output
    before = sorted(p.name for p in places["root"].iterdir())
    code, out, err = cli(*argv.format(**places).split())
    print(err)
    assert code == 2, (code, out, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert match in err
    assert sorted(p.name for p in places["root"].iterdir()) == before  # nothing written
