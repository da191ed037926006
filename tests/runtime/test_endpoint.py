"""The endpoint as users qualify and expose it, on the shipped default model served on 127.0.0.1: logprobs and echo
against HF transformers, n completions, chat through a template, the API key, /tokenize, load shedding and the
drain on SIGTERM."""

import concurrent.futures
import functools
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.runtime.test_server import serving

pytestmark = pytest.mark.slow
DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "models" / "default"
PROMPT = "The module provides a way to handle multiple unrelated exceptions"


def _complete(url, headers=None, **body):
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)


def _stream(url, path, body, headers=None):
    """The parsed chunks of a streamed response, and whether it ended with [DONE]."""
    chunks, done = [], False
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, headers=headers, timeout=120) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunks.append(json.loads(line[6:]))
    return chunks, done


def _hf_logprobs(ids: list[int]) -> np.ndarray:
    """log-softmax of transformers' MambaForCausalLM (fp32, TF32 off) over the prompt ``ids``: [len, V]."""
    import torch
    from transformers import MambaForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    model = MambaForCausalLM.from_pretrained(DEFAULT_MODEL, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, dim=-1).numpy()


def test_echo_logprobs_equal_hf_and_n_streaming_agree(default_bundle):
    """echo + logprobs with max_tokens 0 scores the prompt as HF transformers does (1e-3 absolute, fp32); each
    greedy token's logprob is its top logprob; n=3 at temperature 0 gives three equal completions; a stream's
    logprobs are the whole response's."""
    with serving(default_bundle.path) as (url, _):
        ids = httpx.post(f"{url}/tokenize", json={"prompt": PROMPT}).json()["tokens"]
        scored = _complete(url, prompt=PROMPT, max_tokens=0, echo=True, logprobs=5)
        assert scored.status_code == 200, scored.text
        choice = scored.json()["choices"][0]
        lp = choice["logprobs"]
        want = _hf_logprobs(ids)
        got = np.array(lp["token_logprobs"][1:])
        ref = np.array([want[i - 1, t] for i, t in enumerate(ids) if i > 0])
        worst = float(np.abs(got - ref).max())
        print(f"worst |served - HF| logprob over {len(ref)} prompt tokens: {worst:.2e}")
        assert choice["text"] == PROMPT and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert len(lp["tokens"]) == len(ids) and worst < 1e-3
        for i, top in enumerate(lp["top_logprobs"][1:], 1):  # the 5 best (+ the prompt's token), as HF ranks them
            best = np.sort(want[i - 1])[::-1][:5]
            assert np.allclose(sorted(top.values(), reverse=True)[:5], best, atol=1e-3)

        body = dict(prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2, n=3, ignore_eos=True)
        whole = _complete(url, **body).json()
        texts = [c["text"] for c in whole["choices"]]
        assert [c["index"] for c in whole["choices"]] == [0, 1, 2] and len(set(texts)) == 1 and texts[0]
        assert whole["usage"]["completion_tokens"] == 36 and whole["usage"]["prompt_tokens"] == len(ids)
        first = whole["choices"][0]["logprobs"]
        for token_lp, top in zip(first["token_logprobs"], first["top_logprobs"], strict=True):
            assert token_lp == max(top.values())  # greedy: the token's logprob is its top logprob
        chunks, done = _stream(url, "/v1/completions", body)
        assert done
        for index in range(3):
            parts = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
            streamed = {k: sum((p["logprobs"][k] for p in parts if p["logprobs"]), []) for k in first}
            assert streamed == whole["choices"][index]["logprobs"]
            assert "".join(p["text"] for p in parts) == texts[index]
        # echo with generation: the prompt, then the completion, one list of logprobs
        both = _complete(url, prompt=PROMPT, max_tokens=12, temperature=0, echo=True, logprobs=1, ignore_eos=True)
        both = both.json()
        assert both["choices"][0]["text"] == PROMPT + texts[0]
        assert both["choices"][0]["logprobs"]["token_logprobs"][len(ids) :] == first["token_logprobs"]


def test_chat_template_streams_the_completion_of_its_prompt(default_bundle, tmp_path):
    """--chat-template: a chat request's streamed text equals the completion of the rendered prompt."""
    template = tmp_path / "chat.jinja"
    template.write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    messages = [{"role": "system", "content": "The module"}, {"role": "user", "content": "provides a way"}]
    rendered = "system: The module\nuser: provides a way\nassistant:"
    with serving(default_bundle.path, "--chat-template", template) as (url, _):
        body = {"messages": messages, "max_tokens": 16, "temperature": 0}
        chunks, done = _stream(url, "/v1/chat/completions", body)
        plain = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
        want = _complete(url, prompt=rendered, max_tokens=16, temperature=0).json()["choices"][0]["text"]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    print(repr(text), repr(want))
    assert done and chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert text == want and plain["choices"][0]["message"] == {"role": "assistant", "content": want}
    assert plain["object"] == "chat.completion" and plain["usage"]["completion_tokens"] > 0


def test_api_key_guards_the_api_not_health(default_bundle):
    with serving(default_bundle.path, "--api-key", "sesame") as (url, _):
        body = dict(prompt="The module", max_tokens=2)
        refused = _complete(url, **body)
        wrong = _complete(url, headers={"Authorization": "Bearer nope"}, **body)
        allowed = _complete(url, headers={"Authorization": "Bearer sesame"}, **body)
        assert refused.status_code == wrong.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_api_key"
        assert allowed.status_code == 200, allowed.text
        assert httpx.post(f"{url}/tokenize", json={"prompt": "x"}).status_code == 401
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/metrics").status_code == 200


def test_bad_fields_load_shedding_and_drain(default_bundle):
    """Unknown fields, NaN and bytes that are not UTF-8 get one clear 400; a full queue answers 429 with
    Retry-After; during the drain after SIGTERM a new request gets an OpenAI-shaped 503 while the one in flight
    finishes; an idle server exits within 2 s of SIGTERM."""
    with serving(default_bundle.path, "--max-batch", 1, "--max-queue", 1) as (url, proc):
        unknown = _complete(url, prompt="x", colour="blue")
        post = functools.partial(httpx.post, f"{url}/v1/completions", headers={"Content-Type": "application/json"})
        nan, bad_bytes = post(content=b'{"prompt": "x", "temperature": NaN}'), post(content=b'{"prompt": "\xff"}')
        form = httpx.post(f"{url}/v1/completions", data={"prompt": "x"})  # curl -d without a JSON content type
        for reply, param, words in ((unknown, "colour", "unknown field"), (nan, "temperature", "finite"),
                                    (bad_bytes, None, "UTF-8"), (form, None, "JSON object")):  # fmt: skip
            print(reply.status_code, reply.text)
            assert reply.status_code == 400 and reply.json()["error"]["param"] == param
            assert words in reply.json()["error"]["message"]
        assert _complete(url, prompt="x", max_tokens=1, user="someone").status_code == 200  # ignored, documented

        body = dict(prompt="The module", max_tokens=400, temperature=0, ignore_eos=True)
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            replies = list(pool.map(lambda _: _complete(url, **body), range(6)))
        full = [r for r in replies if r.status_code == 429]
        assert full and all(r.headers.get("retry-after") == "1" for r in full)

        started = threading.Event()

        def stream_long():  # ~2 s of decode on a 2-core machine: in flight when SIGTERM comes
            with httpx.stream("POST", f"{url}/v1/completions", json={**body, "max_tokens": 3000, "stream": True},
                              timeout=120) as reply:  # fmt: skip
                lines = [started.set() or line for line in reply.iter_lines() if line.startswith("data: ")]
            return reply.status_code, json.loads(lines[-2][6:])["choices"][0]["finish_reason"], lines[-1]

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            running = pool.submit(stream_long)
            assert started.wait(60)
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            late = _complete(url, prompt="x", max_tokens=1)
            finished = running.result()
        print(late.status_code, late.text, finished)
        assert late.status_code == 503 and late.json()["error"]["type"] == "server_error"
        assert finished == (200, "length", "data: [DONE]")
        assert proc.wait(30) == 0

    with serving(default_bundle.path) as (url, proc):
        with httpx.Client() as client:  # a keep-alive connection left open, as a client's pool leaves one
            client.get(f"{url}/v1/models")
            start = time.time()
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(30)
        took = time.time() - start
    print(f"idle server exited {code} {took:.2f} s after SIGTERM")
    assert code == 0 and took < 2


def test_chat_without_template_and_template_errors(default_bundle, tmp_path):
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    run = subprocess.run(
        [sys.executable, "-m", "mambatrt.cli", "serve", str(default_bundle.path), "--chat-template", str(broken)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "not valid Jinja" in run.stderr and "Traceback" not in run.stderr
    strict = tmp_path / "strict.jinja"
    strict.write_text("{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}x")
    with serving(default_bundle.path, "--chat-template", strict) as (url, _):
        reply = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "system", "content": "a"}]})
        assert reply.status_code == 400 and "user first" in reply.json()["error"]["message"]
    with serving(default_bundle.path) as (url, _):
        reply = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}]})
        assert reply.status_code == 404 and "--chat-template" in reply.json()["error"]["message"]


def _memory(url) -> dict[str, float]:
    """The server's memory gauges (/metrics): resident and peak summed over its processes, idle, bound."""
    out = {"resident": 0.0, "peak": 0.0}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("mambatrt_resident_memory_bytes{"):
            out["resident"] += float(value)
        elif name.startswith("mambatrt_peak_resident_memory_bytes{"):
            out["peak"] += float(value)
        elif name == "mambatrt_idle_resident_memory_bytes":
            out["idle"] = float(value)
        elif name == "mambatrt_memory_bound_bytes":
            out["bound"] = float(value)
    return out


def test_long_prompts_scores_and_memory_within_the_bound(default_bundle):
    """A long prompt's scores (an event message longer than a pipe's buffer) reach the client; a request over the
    log-probability limit gets a 400 naming it; /tokenizer_info serves lm-eval's remote tokenizer; long prompts and a
    burst of short requests keep the server within its stated bound, and its memory returns to within 10 % of
    idle."""
    with serving(default_bundle.path) as (url, _):
        info = httpx.get(f"{url}/tokenizer_info").json()
        assert info["eos_token"] == "<|endoftext|>" and info["chat_template"] is None
        ids = np.random.default_rng(0).integers(0, 1000, 3000).tolist()
        scored = _complete(url, prompt=ids, max_tokens=0, echo=True, logprobs=5)
        assert scored.status_code == 200, scored.text
        lp = scored.json()["choices"][0]["logprobs"]
        assert len(lp["token_logprobs"]) == 3000 and lp["token_logprobs"][0] is None
        assert all(1 <= len(top) <= 6 for top in lp["top_logprobs"][1:])  # keyed by text: equal texts merge
        over = _complete(url, prompt=ids * 3, max_tokens=0, echo=True, logprobs=20)
        assert over.status_code == 400 and over.json()["error"]["param"] == "logprobs"
        assert "log-probabilities" in over.json()["error"]["message"]

        memory = _memory(url)
        assert 0 < memory["idle"] < memory["bound"]
        for seed in (1, 2):
            long = np.random.default_rng(seed).integers(0, 1000, 200_000).tolist()
            assert _complete(url, prompt=long, max_tokens=4).status_code == 200
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            codes = list(pool.map(lambda _: _complete(url, prompt=PROMPT, max_tokens=8).status_code, range(200)))
        time.sleep(1.0)  # the front end trims its heap once idle
        after = _memory(url)
    print({k: f"{v / 2**20:.0f} MiB" for k, v in after.items()}, "codes:", {c: codes.count(c) for c in set(codes)})
    assert set(codes) <= {200, 429} and after["peak"] <= after["bound"]
    assert after["resident"] <= 1.1 * after["idle"]


def test_bench_serve_counts_refused_requests(default_bundle, cli, tmp_path):
    """bench-serve against a server that sheds load: the 429s are counted as errors, the table still comes."""
    with serving(default_bundle.path, "--max-batch", 1, "--max-queue", 1) as (url, _):
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        figures = tmp_path / "load.json"
        code, out, err = cli("bench-serve", "--url", url, "--model", model, "--concurrency", 8, "--requests", 8,
                             "--input-tokens", 4, "--output-tokens", 200, "--json", figures)  # fmt: skip
    print(out, err)
    (level,) = json.loads(figures.read_text())
    assert code == 0 and level["errors"] > 0 and level["requests"] + level["errors"] == 8
    assert "HTTP 429" in err
