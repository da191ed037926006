"""`mambatrt serve` as a real process on 127.0.0.1: OpenAI protocol, concurrency, errors, disconnects, SIGTERM."""

import concurrent.futures
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from mambatrt.runtime.bundle import load_bundle
from mambatrt.runtime.engine import Sampling
from mambatrt.runtime.runners.ort.cpu import OrtCpuRunner
from mambatrt.testing import ReferenceLoop

pytestmark = pytest.mark.slow
DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "models" / "default"
SCHEMA1 = Path(__file__).resolve().parents[1] / "data" / "schema1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(bundle, *args):
    """A `mambatrt serve` process on a free loopback port; stopped (SIGTERM, then kill) when the block ends."""
    port = _free_port()
    cmd = [sys.executable, "-m", "mambatrt.cli", "serve", str(bundle), "--port", str(port), *map(str, args)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            assert proc.poll() is None, proc.communicate()[1]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.2)
        else:
            raise AssertionError("the server did not become healthy in 60 s")
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _alone(bundle_dir, prompt, n):
    gen = ReferenceLoop(OrtCpuRunner(load_bundle(bundle_dir)))
    return gen.generate(prompt, Sampling(max_new_tokens=n, stop_on_eos=False))


def _complete(url, **body):
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


@pytest.mark.parametrize("layout", ["split", "single"])
def test_concurrent_requests_equal_run(bundle_factory, layout):
    """8+ concurrent greedy requests (prompts of 1, 63, 64, 65 and 200 tokens, token ids) each return exactly the
    tokens the same prompt gives alone, with and without the state cache (with it, through two HTTP front-end
    processes)."""
    bundle = bundle_factory("tiny-odd", layout, plans="none")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 203, n).tolist() for n in (1, 63, 64, 65, 200, 1, 64, 200, 9, 130)]
    body = dict(max_tokens=10, temperature=0, ignore_eos=True, return_token_ids=True)
    for cache in ("0", "64"):
        front_ends = "1" if cache == "0" else "2"
        args = ("--state-cache-mib", cache, "--max-batch", 4, "--api-server-count", front_ends)
        with serving(bundle, *args) as (url, _):
            for round_ in range(2):  # the second round meets its prompts in the cache
                with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
                    replies = list(pool.map(lambda p: _complete(url, prompt=p, **body), prompts))
                for prompt, reply in zip(prompts, replies, strict=True):
                    assert reply.status_code == 200, reply.text
                    data = reply.json()
                    assert data["prompt_token_ids"] == prompt
                    assert data["choices"][0]["token_ids"] == _alone(bundle, prompt, 10)
                    assert data["usage"]["completion_tokens"] == 10 and data["choices"][0]["finish_reason"] == "length"
                    cached = data["usage"]["prompt_tokens_details"]["cached_tokens"]
                    if cache == "0":
                        assert cached == 0
                    elif round_ == 1:  # every prompt of the first round is cached whole
                        assert cached == len(prompt)


def test_text_stream_equals_whole_and_run(cli, tmp_path):
    """With the default model's tokenizer: streamed text == non-streamed text == `mambatrt run`, usage included."""
    from mambatrt.compile.bundle import build_bundle

    bundle = build_bundle(DEFAULT_MODEL, tmp_path / "b", plans="none", quiet=True)
    code, run_out, _ = cli("run", bundle, "--prompt", "The module provides", "--max-new-tokens", "24", "--json")
    want = json.loads(run_out)
    with serving(bundle) as (url, _):
        whole = _complete(url, prompt="The module provides", max_tokens=24, temperature=0).json()
        chunks, done = [], False
        body = {"prompt": "The module provides", "max_tokens": 24, "temperature": 0, "stream": True}
        body["stream_options"] = {"include_usage": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as reply:
            assert reply.headers["content-type"].startswith("text/event-stream")
            for line in reply.iter_lines():
                if line.startswith("data: "):
                    if line == "data: [DONE]":
                        done = True
                    else:
                        chunks.append(json.loads(line[6:]))
        again = _complete(url, prompt="The module provides", max_tokens=24, temperature=0).json()
        stopped = _complete(url, prompt="The module provides", max_tokens=24, temperature=0, stop=" use").json()
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    print(repr(want["text"]), repr(whole["choices"][0]["text"]), repr(text))
    assert done and text == whole["choices"][0]["text"] == want["text"]
    assert chunks[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"] == len(want["tokens"])
    assert again["choices"][0]["text"] == want["text"] and again["usage"]["prompt_tokens_details"]["cached_tokens"] == 3
    assert stopped["choices"][0]["finish_reason"] == "stop" and want["text"].startswith(stopped["choices"][0]["text"])
    assert " use" not in stopped["choices"][0]["text"]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(bundle_factory):
    bundle = bundle_factory("tiny-odd", "split", plans="none")
    with serving(bundle, "--served-model-name", "tiny") as (url, _):
        post = f"{url}/v1/completions"
        cases = [
            (httpx.post(post, content=b"{not json", headers={"content-type": "application/json"}), 400),
            (_complete(url, prompt=[1, 203]), 400),  # outside the vocabulary
            (_complete(url, prompt=[]), 400),
            (_complete(url, prompt="text"), 400),  # no tokenizer in this bundle
            (_complete(url, prompt=[1], max_tokens=0), 400),
            (_complete(url, prompt=[1], temperature=-1), 400),
            (_complete(url, prompt=[1], top_p=0), 400),
            (_complete(url, prompt=[1], best_of=2), 400),  # refused, not ignored
            (_complete(url, prompt=[1], n=65), 400),
            (_complete(url, prompt=[1], suffix="x"), 400),
            (_complete(url, prompt=[1], presence_penalty=2.5), 400),
            (_complete(url, prompt=[1], logit_bias={"x": 1}), 400),
            (_complete(url, prompt=[1], logit_bias={"\u00b2": 1}), 400),  # a digit to str.isdigit, not to int()
            (_complete(url, prompt=[1], logit_bias={"5": 101}), 400),
            (_complete(url, prompt=[1], logit_bias={"203": 1}), 400),  # outside the vocabulary
            (_complete(url, prompt=[1], stop="x"), 400),  # stop strings need a tokenizer
            (_complete(url, prompt=[1], model="gpt-4"), 404),
            (httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}]}), 404),
            (httpx.get(f"{url}/v1/nothing"), 404),
        ]
        assert cases[0][0].json()["error"]["param"] is None  # malformed JSON names no field
        assert [r.json()["error"]["param"] for r, _ in cases[11:15]] == ["logit_bias"] * 4
        for reply, status in cases:
            print(reply.status_code, reply.text)
            assert reply.status_code == status
            error = reply.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"]
            assert "Traceback" not in reply.text
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "tiny"
        ok = _complete(url, prompt=[1, 2], max_tokens=3, temperature=0, model="tiny")
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        # a bias applies (greedy: the biased token every time), also to a sampled request
        for temperature in (0, 1):
            biased = _complete(url, prompt=[1, 2], max_tokens=5, temperature=temperature, logit_bias={"77": 100},
                               return_token_ids=True, seed=1)  # fmt: skip
            assert biased.json()["choices"][0]["token_ids"] == [77] * 5, biased.text
        port = url.rsplit(":", 1)[1]  # a second server on the same port: a clear error, exit 2
        second = subprocess.run(
            [sys.executable, "-m", "mambatrt.cli", "serve", str(bundle), "--port", port],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert second.returncode == 2 and "could not listen on 127.0.0.1" in second.stderr
        assert "Traceback" not in second.stderr


def test_queue_full_disconnect_metrics_and_sigterm(bundle_factory):
    bundle = bundle_factory("tiny-odd", "split", plans="none")
    with serving(bundle, "--max-batch", 1, "--max-queue", 1) as (url, proc):
        body = dict(prompt=[1, 2, 3], max_tokens=3000, temperature=0, ignore_eos=True)
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            replies = list(pool.map(lambda _: _complete(url, **body), range(6)))
        codes = sorted(r.status_code for r in replies)
        print(codes)
        assert 429 in codes and 200 in codes
        assert all(r.json()["error"]["type"] == "rate_limit_error" for r in replies if r.status_code == 429)
        # a client that goes away mid-stream frees its slot
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=30) as reply:
            next(reply.iter_lines())
        deadline = time.time() + 10
        while time.time() < deadline and "mambatrt_num_requests_running 1.0" in httpx.get(f"{url}/metrics").text:
            time.sleep(0.1)
        metrics = httpx.get(f"{url}/metrics").text
        assert "mambatrt_num_requests_running 0.0" in metrics
        assert "mambatrt_time_to_first_token_seconds_count" in metrics and "mambatrt_generation_tokens_total" in metrics
        values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in metrics.splitlines() if line[:1] not in "#"}
        print({k: v for k, v in values.items() if "engine" in k or "prefill" in k or "sampled" in k})
        assert values['mambatrt_engine_busy_seconds_total{phase="decode"}'] > 0
        # one slot (max batch 1): the host picks every token, none is picked by the pool
        assert values['mambatrt_pool_sampled_tokens_total{token="next"}'] == 0
        assert values['mambatrt_pool_sampled_tokens_total{token="first"}'] == 0
        assert values["mambatrt_engine_iterations_total"] >= 1 and values["mambatrt_prefill_launches_total"] >= 1
        assert values["mambatrt_prefill_rows_total"] >= values["mambatrt_prefill_launches_total"]
        assert _complete(url, prompt=[4], max_tokens=2).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_sigterm_aborts_requests_that_outlast_the_grace(bundle_factory):
    """SIGTERM with a stream that cannot finish before shutdown's deadline (a million tokens) and a plain request
    likewise: the server cancels them itself (SHUTDOWN_ABORT_S), so the stream ends with finish reason "abort" and
    [DONE] and the plain request gets an OpenAI-shaped 503, not a connection cut mid-stream; exit 0, no traceback."""
    from mambatrt.runtime.serve.client import SHUTDOWN_ABORT_S, SHUTDOWN_GRACE_S

    bundle = bundle_factory("tiny-odd", "split", plans="none")
    body = dict(prompt=[1, 2, 3], max_tokens=1_000_000, temperature=0, ignore_eos=True)
    with serving(bundle, "--max-batch", 2) as (url, proc), concurrent.futures.ThreadPoolExecutor(1) as pool:
        plain = pool.submit(_complete, url, **body)
        streamed = {**body, "stream": True, "return_token_ids": True}  # a chunk per token (no tokenizer: no text)
        with httpx.stream("POST", f"{url}/v1/completions", json=streamed, timeout=60) as reply:
            lines = reply.iter_lines()
            next(line for line in lines if line.startswith("data:"))  # streaming
            started = time.time()
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data:")]
        took = time.time() - started
        answer = plain.result()
        assert proc.wait(30) == 0
        err = proc.stderr.read()
    print(rest[-2:], round(took, 1), answer.status_code, answer.text[:200])
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][len("data: ") :])["choices"][0]["finish_reason"] == "abort"
    assert SHUTDOWN_ABORT_S - 1 < took < SHUTDOWN_GRACE_S
    assert answer.status_code == 503 and answer.json()["error"]["type"] == "server_error"
    assert "Traceback" not in err, err


def _front_ends(pid: int) -> list[int]:
    """The HTTP front-end processes of the server ``pid`` (its children started by multiprocessing's spawn)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != pid:
                continue
            if b"spawn_main" in (stat.parent / "cmdline").read_bytes():
                found.append(int(stat.parent.name))
    return found


def _gone(pids: list[int], seconds: float) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if not any(Path(f"/proc/{p}").exists() and "Z" not in _state(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def _state(pid: int) -> str:
    with contextlib.suppress(OSError, IndexError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return "X"


def test_front_ends_share_counts_and_a_lost_process_ends_serving(bundle_factory):
    """--api-server-count 2: /metrics (whichever front end answers) counts every request; a killed front end ends
    the server (exit 1, one line saying so) and a killed engine process takes its front ends with it."""
    bundle = bundle_factory("tiny-odd", "split", plans="none")
    body = dict(max_tokens=4, temperature=0, ignore_eos=True)
    with serving(bundle, "--api-server-count", 2) as (url, proc):
        kids = _front_ends(proc.pid)
        print(proc.pid, kids)
        assert len(kids) == 2
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(lambda i: _complete(url, prompt=[i + 1, 7], **body), range(8)))
        assert all(r.status_code == 200 for r in replies)
        deadline, metrics = time.time() + 5, ""
        while time.time() < deadline:  # the front ends send their latencies every 0.25 s
            metrics = httpx.get(f"{url}/metrics").text
            if "mambatrt_time_to_first_token_seconds_count 8.0" in metrics:
                break
            time.sleep(0.1)
        assert 'mambatrt_requests_total{finish_reason="length"} 8.0' in metrics
        assert "mambatrt_time_to_first_token_seconds_count 8.0" in metrics
        assert "mambatrt_inter_token_latency_seconds_count 24.0" in metrics
        os.kill(kids[0], signal.SIGKILL)
        assert proc.wait(30) == 1
        err = proc.stderr.read()
        print(err)
        assert "HTTP front end 0 exited" in err or "HTTP front end 1 exited" in err
        assert "Traceback" not in err and _gone(kids, 10)
    with serving(bundle, "--api-server-count", 2) as (url, proc):
        kids = _front_ends(proc.pid)
        proc.kill()
        proc.wait()
        assert _gone(kids, 15), [_state(p) for p in kids]


def test_sigterm_while_front_ends_start_leaves_nothing_behind(bundle_factory):
    """SIGTERM as soon as the front-end processes exist (still importing, or just serving): exit 0, no traceback, no
    process left, and the port is free again."""
    bundle = bundle_factory("tiny-odd", "split", plans="none")
    port = _free_port()
    cmd = [sys.executable, "-m", "mambatrt.cli", "serve", str(bundle), "--port", str(port), "--api-server-count", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while not _front_ends(proc.pid) and time.time() < deadline and proc.poll() is None:
            time.sleep(0.02)
        kids = _front_ends(proc.pid)
        assert kids, proc.communicate()[1] if proc.poll() is not None else "no front end started in 60 s"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()
    print(kids, err)
    assert "Traceback" not in err and _gone(kids, 10)
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # free again


def test_old_schema_bundle_served(tmp_path):
    bundle = tmp_path / "old"
    shutil.copytree(SCHEMA1 / "bundle", bundle)
    with serving(bundle) as (url, _):
        reply = _complete(url, prompt=[5, 6, 7], max_tokens=6, temperature=0, ignore_eos=True, return_token_ids=True)
    assert reply.status_code == 200 and reply.json()["choices"][0]["token_ids"] == _alone(bundle, [5, 6, 7], 6)


def _cached_prompt_tokens(url: str) -> float:
    """The server's count of prompt tokens served from its state cache (GET /metrics)."""
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("mambatrt_cached_prompt_tokens_total "):
            return float(line.split()[1])
    raise AssertionError("no mambatrt_cached_prompt_tokens_total in /metrics")


def test_bench_serve_load_and_cloze(cli, tmp_path):
    """The project's load client against a real server: every request completes with the asked tokens, figures are
    filled; `eval --url` gives through the server the accuracy `mambatrt eval` gives for the same passages."""
    from mambatrt.compile.bundle import build_bundle

    bundle = build_bundle(DEFAULT_MODEL, tmp_path / "b", plans="none", quiet=True)
    code, out, err = cli("eval", bundle, "--data", DEFAULT_MODEL / "cloze.jsonl", "--limit", 30, "--json")
    assert code == 0, err
    want = json.loads(out)
    with serving(bundle) as (url, _):
        figures = tmp_path / "load.json"
        code, out, err = cli(
            "bench-serve", "--url", url, "--model", "b", "--concurrency", 1, 3, "--requests", 6,
            "--input-tokens", 20, "--output-tokens", 7, "--json", figures,
        )  # fmt: skip
        print(out, err)
        assert code == 0, err
        levels = json.loads(figures.read_text())
        assert [r["concurrency"] for r in levels] == [1, 3]
        for r in levels:
            assert r["requests"] == 6 and r["errors"] == 0 and r["output_sequence_length"] == 7
            itl = r["inter_token_latency"]
            assert r["output_token_throughput"] > 0 and 0 < itl["p50"] <= itl["p99"]
        # --seed: the default sends level 1's first prompts again (the state cache serves them), another seed new ones
        again = ("bench-serve", "--url", url, "--model", "b", "--requests", 3, "--input-tokens", 20)
        cached = [_cached_prompt_tokens(url)]
        for seed in (0, 7):
            code, out, err = cli(*again, "--output-tokens", 7, "--seed", seed)
            assert code == 0, err
            cached.append(_cached_prompt_tokens(url))
        print("cached prompt tokens", cached)
        assert cached[1] - cached[0] >= 3 * 19 and cached[2] == cached[1]
        code, out, err = cli(
            "bench-serve", "--url", url, "--model", "b", "--concurrency", 2, "--requests", 4, "--input-tokens", 20,
            "--output-tokens", 7, "--temperature", 1, "--json", figures,
        )  # fmt: skip
        assert code == 0, err
        (sampled,) = json.loads(figures.read_text())  # sampled requests, ignore_eos: 7 tokens each
        assert sampled["requests"] == 4 and sampled["errors"] == 0 and sampled["output_sequence_length"] == 7
        cloze = ("eval", "--data", DEFAULT_MODEL / "cloze.jsonl", "--limit", 30, "--url", url)
        code, out, err = cli(*cloze, "--concurrency", 3, "--json")
        assert code == 0, err
        got = json.loads(out)
        print(out, want)
        assert got["count"] == 30 and got["accuracy"] == want["accuracy"] and got["task_call_ms"]["p50"] > 0
        code, out, err = cli(*cloze, "--reference", DEFAULT_MODEL, "-q")
        print(out)
        assert code == 0, err
        assert f"accuracy {want['accuracy']:.2f} vs " in out and out.rstrip().endswith(": pass")
        code, out, err = cli("eval", bundle, *cloze[1:])
        assert code == 2 and "one of them, not both" in err
        code, out, err = cli("bench-serve", "--url", url, "--model", "nope")
        assert code == 2 and "not 'nope'" in err


def _metric(url: str, name: str) -> float:
    """One counter of the server's /metrics (its value on the line of that name, labels included)."""
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"no {name} in /metrics")


def test_serve_metrics_count_the_engine_s_work(bundle_factory):
    """/metrics: a 70-token prompt prefilled in one launch of the kernels prefill graph, its first token from the
    prefill and 4 decode launches for the rest; wrong serving options are refused (one line, exit 2)."""
    bundle = bundle_factory("tiny-odd", "split", plans="none")
    with serving(bundle, "--state-cache-mib", 0) as (url, proc):
        # greedy, EOS ignored: exactly 5 tokens, the first from the prefill, then 4 decode launches
        reply = _complete(url, prompt=list(range(1, 71)), max_tokens=5, temperature=0, ignore_eos=True)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 5
        figures = {
            name: _metric(url, name)
            for name in ("mambatrt_prefill_launches_total", "mambatrt_prefill_rows_total",
                         "mambatrt_engine_iterations_total", 'mambatrt_decode_launches_total{ids="host"}')
        }  # fmt: skip
        print(figures)
        assert figures["mambatrt_prefill_launches_total"] == 1 and figures["mambatrt_prefill_rows_total"] == 70
        assert figures['mambatrt_decode_launches_total{ids="host"}'] == 4
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    for bad, what in ((("--max-queue", "0"), "--max-queue"), (("--state-cache-mib", "nan"), "--state-cache-mib"),
                      (("--port", "70000"), "--port"), (("--prefill-rows", "0"), "--prefill-rows")):  # fmt: skip
        code = subprocess.run(
            [sys.executable, "-m", "mambatrt.cli", "serve", str(bundle), *bad], capture_output=True, text=True
        )
        assert code.returncode == 2 and what in code.stderr and "Traceback" not in code.stderr, code.stderr
