"""Continuous batching: concurrent sequences in one engine give exactly the tokens each gives alone."""

import threading
import time

import numpy as np
import pytest

from mambatrt.runtime.bundle import load_bundle
from mambatrt.runtime.engine import Engine, EngineConfig, Request, Sampling, StateCache
from mambatrt.runtime.runners.ort.cpu import OrtCpuRunner
from mambatrt.testing import ReferenceLoop, assert_close

LENGTHS = [1, 63, 64, 65, 200, 5, 130, 17, 2]


def _alone(bundle, prompt, n, sampling=None):
    """What `mambatrt run` gives for this prompt alone (greedy unless ``sampling`` says otherwise, EOS ignored)."""
    sampling = sampling or Sampling(max_new_tokens=n, stop_on_eos=False)
    return ReferenceLoop(OrtCpuRunner(bundle)).generate(prompt, sampling)


def _run_all(engine, prompts, n, start=False, samplings=None):
    """Submit every prompt (from several threads), wait for all; returns the tokens and final events. ``start``:
    the engine is started once all are queued (its first iteration sees them all: batched launches for sure).
    ``samplings``: one per prompt (default greedy, n tokens, EOS ignored)."""
    out, done = {}, threading.Event()

    def submit(i, prompt):
        tokens = []

        def emit(event):
            if event.token is not None:
                tokens.append(event.token)
            if event.finish_reason is not None:
                out[i] = (tokens, event)
                if len(out) == len(prompts):
                    done.set()

        sampling = samplings[i] if samplings else Sampling(max_new_tokens=n, stop_on_eos=False)
        engine.submit(Request(list(prompt), sampling, emit))

    threads = [threading.Thread(target=submit, args=(i, p)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if start:
        engine.start()
    assert done.wait(120), f"only {len(out)} of {len(prompts)} finished"
    return out


@pytest.mark.parametrize("layout", ["split", "single"])
@pytest.mark.parametrize("cache_mib", [0, 64])
def test_concurrent_sequences_equal_each_alone(bundle_factory, layout, cache_mib):
    bundle = load_bundle(bundle_factory("tiny-odd", layout, plans="none"))
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 203, n).tolist() for n in LENGTHS]
    prompts.append(prompts[4] + [9, 8, 7])  # extends a prompt that is (or is being) cached
    engine = Engine(OrtCpuRunner(bundle), EngineConfig(max_batch=4, cache_bytes=int(cache_mib * 2**20))).start()
    try:
        first = _run_all(engine, prompts, 12)
        again = _run_all(engine, prompts, 12)  # the second round can start from cached states
    finally:
        engine.stop()
    for i, prompt in enumerate(prompts):
        want = _alone(bundle, prompt, 12)
        print(len(prompt), first[i][0], again[i][0], want, again[i][1].cached_tokens)
        assert first[i][0] == want and again[i][0] == want
        assert first[i][1].finish_reason == "length" and first[i][1].completion_tokens == 12
    if cache_mib:
        assert all(again[i][1].cached_tokens == len(p) for i, p in enumerate(prompts))  # whole prompts cached
        assert engine.cache.hits >= len(prompts)
    else:
        assert all(ev.cached_tokens == 0 for _, ev in list(first.values()) + list(again.values()))
    assert engine.scheduler.running == [] and not engine.scheduler.waiting


def test_penalties_and_bias_in_a_batch_equal_each_alone(bundle_factory):
    """Presence / frequency penalties count each sequence's own generated tokens, next to sequences without them
    (which the batch must not penalise): every sequence gives the tokens the single-sequence loop gives it."""
    bundle = load_bundle(bundle_factory("tiny-odd", "split", plans="none"))
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 203, n).tolist() for n in (5, 40, 70)]
    plain = Sampling(max_new_tokens=24, stop_on_eos=False)
    penalised = Sampling(max_new_tokens=24, stop_on_eos=False, presence_penalty=2.0, frequency_penalty=2.0)
    biased = Sampling(max_new_tokens=24, stop_on_eos=False, logit_bias=((11, 3.0), (12, -100.0)))
    cases = [(p, s) for p in prompts for s in (plain, penalised, biased)]
    got: dict[int, list[int]] = {}
    done = threading.Event()
    engine = Engine(OrtCpuRunner(bundle), EngineConfig(max_batch=4)).start()
    try:

        def emitter(i):
            def emit(event):
                got.setdefault(i, []).append(event.token)
                if len([k for k in got if got[k] and len(got[k]) == 24]) == len(cases):
                    done.set()

            return emit

        for i, (prompt, sampling) in enumerate(cases):
            engine.submit(Request(prompt, sampling, emitter(i)))
        assert done.wait(120)
    finally:
        engine.stop()
    for i, (prompt, sampling) in enumerate(cases):
        want = ReferenceLoop(OrtCpuRunner(bundle)).generate(prompt, sampling)
        print(i, got[i], want)
        assert got[i] == want
    for j in range(len(prompts)):  # the adjustments changed something: the test would see them ignored
        tokens = [got[3 * j + k] for k in range(3)]
        assert max(np.bincount(tokens[1])) < max(np.bincount(tokens[0])), tokens  # fewer repeats
        assert 12 not in tokens[2]
    assert any(got[3 * j] != got[3 * j + 2] for j in range(len(prompts)))


@pytest.mark.parametrize("cache_mib, pipelined", [(0, False), (64, False), (0, True), (64, True)])
def test_batched_prefill_equals_each_alone(bundle_factory, cache_mib, pipelined):
    """Graphs whose prefill takes a batch (the kernels graphs): prompts are staged together and prefilled several
    per launch (chunks of equal length on consecutive staging rows); each sequence still gives the tokens it gives
    alone (portable graphs, one sequence), with prompts of mixed lengths and a cache in play. ``pipelined``: the
    prefill launches run in the engine's worker thread beside the decode launches, the host's prefill work and the
    events go between a decode launch's begin and finish, each decode launch is begun before the last one's picks
    are handled (sequences end while a launch holds their slots, their cache entries from the launch before), and,
    while the slots stay the same, begun from those picks before the host has them (a GPU's schedule; the CPU pool
    can run it too)."""
    bundle = load_bundle(bundle_factory("tiny-odd", "split", plans="none"))
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 203, n).tolist() for n in [128] * 6 + LENGTHS]
    runner = OrtCpuRunner(bundle, "kernels")
    engine = Engine(runner, EngineConfig(max_batch=5, cache_bytes=int(cache_mib * 2**20), pipelined=pipelined))
    assert engine.pipelined == pipelined
    assert engine.pool.staging_rows == bundle.manifest.max_prefill_batch > 1
    launches = []  # (start row, sequences, rows) of every prefill launch: the real launch runs, its shape is noted
    prefill = engine.pool.prefill
    engine.pool.prefill = lambda graph, start, ids: launches.append((start, *ids.shape)) or prefill(graph, start, ids)
    try:
        first = _run_all(engine, prompts, 10, start=True)
        again = _run_all(engine, prompts, 10)
    finally:
        engine.stop()
    print(launches)
    assert engine.feeding == pipelined and (engine.totals["fed_launches"] > 0) == pipelined
    assert max(k for _, k, _ in launches) >= 4  # the 128-token prompts went in together
    assert {rows for _, _, rows in launches} >= {64, 5}
    for i, prompt in enumerate(prompts):
        want = _alone(bundle, prompt, 10)
        assert first[i][0] == want and again[i][0] == want, (len(prompt), first[i][0], again[i][0], want)
    if cache_mib:
        assert all(again[i][1].cached_tokens == len(p) for i, p in enumerate(prompts))
    assert engine.scheduler.running == [] and engine.scheduler.staging == [] and not engine.scheduler.waiting


def _scored(engine, prompts, n_new=3, logprobs=3, tail=None) -> list:
    """Every prompt scored from its second token (``score_from`` 1; ``tail``: its last ``tail`` tokens only, as
    `eval` scores a word after its context), top ``logprobs``, then ``n_new`` greedy tokens, all submitted before the
    engine starts; per prompt (its scores, its tokens)."""
    out, done = {}, threading.Event()

    def request(i, prompt):
        tokens = []

        def emit(event):
            if event.scores is not None:
                out.setdefault(i, {})["scores"] = event.scores
            if event.token is not None:
                tokens.append(event.token)
            if event.finish_reason is not None:
                out.setdefault(i, {})["tokens"] = tokens
                if sum("tokens" in v for v in out.values()) == len(prompts):
                    done.set()

        sampling = Sampling(max_new_tokens=n_new, stop_on_eos=False)
        score_from = 1 if tail is None else max(1, len(prompt) - tail)
        return Request(prompt, sampling, emit, score_from=score_from, logprobs=logprobs)

    for i, prompt in enumerate(prompts):
        engine.submit(request(i, prompt))
    engine.start()
    assert done.wait(120)
    engine.stop()
    return [(out[i]["scores"], out[i]["tokens"]) for i in range(len(prompts))]


@pytest.mark.parametrize("pipelined, tail", [(False, None), (True, None), (False, 3), (True, 70)])
def test_scored_prompts_on_the_scoring_graph_equal_token_by_token(bundle_factory, pipelined, tail):
    """A prompt to score is prefilled on the scoring graph (every row's logits, a chunk per launch), its rows before
    the first scored one on the prefill graph (batched with other prompts': ``tail``): its log-probabilities, top
    tokens and greedy flags equal those of the same prompt fed one token per decode launch (fp32: 5e-5 absolute on
    log-probabilities), and so do the tokens generated after."""
    bundle = load_bundle(bundle_factory("tiny-odd", "split", plans="none"))
    assert bundle.score_path is not None
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 203, n).tolist() for n in [2, 63, 64, 65, 200, 130]]
    config = EngineConfig(max_batch=4, cache_bytes=2**20, pipelined=pipelined)
    engine = Engine(OrtCpuRunner(bundle, "kernels"), config)
    assert engine.scorer is not None
    launches = []  # the prefill graph's launches: (sequences, rows)
    prefill = engine.pool.prefill
    engine.pool.prefill = lambda graph, start, ids: launches.append(ids.shape) or prefill(graph, start, ids)
    got = _scored(engine, prompts, tail=tail)
    reference = Engine(OrtCpuRunner(bundle, "kernels"), EngineConfig(max_batch=4, token_by_token=True))
    want = _scored(reference, prompts, tail=tail)
    print(launches)
    assert bool(launches) == (tail is not None) and all(k * rows < 200 for k, rows in launches)
    for prompt, (scores, tokens), (ref, ref_tokens) in zip(prompts, got, want, strict=True):
        worst = max(abs(a.logprob - b.logprob) for a, b in zip(scores, ref, strict=True))
        print(len(prompt), f"worst |row-scored - token-by-token| logprob {worst:.2e}")
        assert len(scores) == min(len(prompt) - 1, tail or len(prompt)) and worst < 5e-5
        assert [a.greedy for a in scores] == [b.greedy for b in ref]
        assert [[i for i, _ in a.top] for a in scores] == [[i for i, _ in b.top] for b in ref]
        assert tokens == ref_tokens


@pytest.mark.parametrize("pipelined", [False, True])
def test_prompts_are_served_oldest_first(bundle_factory, pipelined):
    """A prompt staged in a middle row is not passed over by newer ones while requests keep arriving (one chunk of
    prefill per iteration, a new prompt submitted at each first token): prompts get their first tokens in the
    order they arrived. (Feeding from staging row 0 up gave the newest prompt, moved into each freed row, the next
    chunk: the middle rows waited until arrivals stopped.)"""
    bundle = load_bundle(bundle_factory("tiny-odd", "split", plans="none"))
    prompts = [np.random.default_rng(i).integers(0, 203, 128).tolist() for i in range(10)]
    config = EngineConfig(max_batch=10, prefill_rows=bundle.max_prefill_rows, pipelined=pipelined)
    engine = Engine(OrtCpuRunner(bundle, "kernels"), config)
    assert engine.pool.staging_rows >= 4
    firsts, done = [], threading.Event()
    submitted = iter(range(len(prompts)))

    def submit(i):
        engine.submit(Request(prompts[i], Sampling(max_new_tokens=3, stop_on_eos=False), lambda e, i=i: emit(i, e)))

    def emit(i, event):
        if event.completion_tokens == 1 and event.token is not None:  # its first token: one more request arrives
            firsts.append(i)
            nxt = next(submitted, None)
            if nxt is not None:
                submit(nxt)
            if len(firsts) == len(prompts):
                done.set()

    for _ in range(4):
        submit(next(submitted))
    engine.start()
    try:
        assert done.wait(120), firsts
    finally:
        engine.stop()
    print(firsts)
    assert firsts == list(range(len(prompts)))


@pytest.mark.parametrize("pipelined", [False, True])
def test_cached_boundary_states_equal_the_prefix_alone(bundle_factory, pipelined):
    """The prefix cache's entries at a long prompt's chunk boundaries (64 and 128 of 130 tokens: 64 rows per
    iteration) hold the states and logits after those tokens alone. (A small random model's greedy tokens depend
    little on old states: a wrong entry can give the right tokens, so the tokens alone do not show it.)"""
    bundle = load_bundle(bundle_factory("tiny-odd", "split", plans="none"))
    prompt = np.random.default_rng(17).integers(0, 203, 130).tolist()
    config = EngineConfig(max_batch=2, cache_bytes=2**26, pipelined=pipelined, prefill_rows=64)
    engine = Engine(OrtCpuRunner(bundle, "kernels"), config)
    try:
        ((tokens, _),) = _run_all(engine, [prompt], 4, start=True).values()
    finally:
        engine.stop()
    assert tokens == _alone(bundle, prompt, 4)
    alone = OrtCpuRunner(bundle)
    for n in (64, 128):
        found, (conv, ssm, logits) = engine.cache.longest_prefix(prompt[:n])
        assert found == n
        alone.reset()
        for start in range(0, n, 64):
            want_logits = alone.run("prefill", np.asarray(prompt[start : start + 64], np.int64))
        wants = (*alone.get_state(), want_logits)
        for what, got, want in zip(("conv", "ssm", "logits"), (conv, ssm, logits), wants, strict=True):
            got = np.asarray(got)
            want = np.asarray(want).reshape(-1)[: got.size].reshape(got.shape)  # the logits: the vocabulary's
            assert_close(f"the cached entry after {n} tokens: {what}", got, want, 1e-5)


@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("ratio, joined, held", [(0.0, 2, False), (3.0, 2, True), (3.0, 3, False)])
def test_new_prompts_gather_while_sequences_decode(bundle_factory, pipelined, ratio, joined, held):
    """``waiting_served_ratio``: prompts that arrive while a sequence decodes wait until they number ratio x the
    running sequences (here 3) or for ``max_waiting_tokens`` decode iterations (here 6), then go in one launch;
    fewer wait, as many do not; nothing waits without a ratio. They still give the tokens they give alone."""
    bundle = load_bundle(bundle_factory("tiny-odd", "split", plans="none"))
    rng = np.random.default_rng(5)
    first, later = rng.integers(0, 203, 5).tolist(), [rng.integers(0, 203, 20).tolist() for _ in range(joined)]
    config = EngineConfig(max_batch=8, pipelined=pipelined, waiting_served_ratio=ratio, max_waiting_tokens=6)
    engine = Engine(OrtCpuRunner(bundle, "kernels"), config)
    assert engine.pool.staging_rows >= 3
    got = {i: [] for i in range(joined + 1)}
    done, finished = threading.Event(), set()
    scheduler, submitted = engine.scheduler, []
    launched, holding = [], []  # (iteration, prompts) of each prefill launch planned; iterations that held prompts
    plan, hold = scheduler.plan_prefill, scheduler._hold

    def planned():
        launches = plan()
        launched.extend((engine.totals["iterations"], launch.ids.shape[0]) for launch in launches)
        return launches

    def holds():
        held = hold()
        if held:
            holding.append(engine.totals["iterations"])
        return held

    scheduler.plan_prefill, scheduler._hold = planned, holds

    def emit(i, event):
        if event.token is not None:
            got[i].append(event.token)
        if i == 0 and len(got[0]) == 2 and event.token is not None:  # the engine thread: at the next iteration
            submitted.append(engine.totals["iterations"])
            for j, prompt in enumerate(later, 1):
                engine.submit(Request(prompt, Sampling(max_new_tokens=4, stop_on_eos=False), lambda e, j=j: emit(j, e)))
        if event.finish_reason is not None:
            finished.add(i)
            if len(finished) == joined + 1:
                done.set()

    engine.submit(Request(first, Sampling(max_new_tokens=40, stop_on_eos=False), lambda e: emit(0, e)))
    engine.start()
    try:
        assert done.wait(120), got
    finally:
        engine.stop()
    arrived = submitted[0] + 1  # taken from the inbox at the next iteration
    after = [(i, k) for i, k in launched if i >= arrived]
    print(ratio, joined, pipelined, arrived, after, holding)
    assert [k for _, k in after] == [joined]  # the later prompts went in one launch
    waited = after[0][0] - arrived  # iterations from their arrival to their launch
    assert waited == (6 if held else 0)
    assert holding == list(range(arrived, arrived + waited))  # held in exactly those iterations
    for j, prompt in enumerate(later, 1):
        assert got[j] == _alone(bundle, prompt, 4)
    assert got[0] == _alone(bundle, first, 40)


@pytest.mark.parametrize("pipelined", [False, True])
def test_continuation_uses_the_completion_state(bundle_factory, pipelined):
    """A prompt that extends an earlier prompt plus its completion (a chat turn) prefills only the new tokens; the
    completion's entry holds the state after its fed tokens and the logits of the last, so the exact prefix gets
    its first token with no launch. ``pipelined``: the completion ended while the next decode launch ran (fed its
    last token), begun from the last one's picks before the host had them: the entry comes from the launch
    before."""
    bundle = load_bundle(bundle_factory("tiny-odd", "split", plans="none"))
    config = EngineConfig(max_batch=4, cache_bytes=2**26, pipelined=pipelined)
    engine = Engine(OrtCpuRunner(bundle, "kernels"), config).start()
    assert engine.pipelined == engine.feeding == pipelined
    try:
        prompt = list(range(1, 80))
        ((tokens, _),) = _run_all(engine, [prompt], 6).values()
        follow = prompt + tokens + [11, 12, 13]
        ((tokens2, event),) = _run_all(engine, [follow], 6).values()
        exact = prompt + tokens[:-1]
        ((tokens3, event3),) = _run_all(engine, [exact], 4).values()
    finally:
        engine.stop()
    print(tokens, tokens2, tokens3, event.cached_tokens, event3.cached_tokens)
    assert event.cached_tokens == len(prompt) + len(tokens) - 1  # the last generated token was never fed
    assert tokens2 == _alone(bundle, follow, 6)
    assert event3.cached_tokens == len(exact) and event3.prefill_launches == 0  # the first token from the entry
    assert tokens3 == _alone(bundle, exact, 4) and tokens3[0] == tokens[-1]
    assert (engine.totals["fed_launches"] > 0) == pipelined
    # the entry itself (a random tiny model's greedy tokens barely depend on it): the states and logits after
    # ``exact`` alone
    found, (conv, ssm, logits) = engine.cache.longest_prefix(exact)
    assert found == len(exact)
    alone = OrtCpuRunner(bundle)
    for start in range(0, len(exact), 64):
        want_logits = alone.run("prefill", np.asarray(exact[start : start + 64], np.int64))
    wants = (*alone.get_state(), want_logits)
    for what, got, want in zip(("conv", "ssm", "logits"), (conv, ssm, logits), wants, strict=True):
        got = np.asarray(got)
        want = np.asarray(want).reshape(-1)[: got.size].reshape(got.shape)
        assert_close(f"the completion's entry ({'ahead' if pipelined else 'in turn'}): {what}", got, want, 1e-5)


def _fill(value):
    """A ``put`` filler writing ``value`` into every array of the entry."""

    def fill(entry):
        for a in entry:
            a[...] = value

    return fill


def test_state_cache_lru_and_prefix():
    cache = StateCache(max_bytes=3 * 100, shapes=((10,), (10,), (5,)))  # an entry is 100 bytes: three rows
    assert cache.capacity == 3 and cache.rows[0].shape == (3, 10)
    for value, key in enumerate(([1], [1, 2], [1, 2, 3])):
        cache.put(key, _fill(value))
    assert cache.longest_prefix([1, 2, 3, 4])[0] == 3 and cache.longest_prefix([1, 5])[0] == 1
    cache.put([7], _fill(7.0))  # evicts the least recently used, [1, 2], and reuses its row
    assert cache.longest_prefix([1, 2, 9])[0] == 1 and cache.bytes == 300
    assert cache.lengths == {1: 2, 3: 1}  # the evicted key's length is gone
    assert cache.longest_prefix([8])[0] == 0
    n, (conv, ssm, logits) = cache.longest_prefix([7, 1])
    assert n == 1 and (conv == 7).all() and (logits == 7).all() and logits.shape == (5,)
    assert sorted(cache.entries.values()) == [0, 1, 2]  # three entries, three rows


def test_state_cache_entries_live_in_its_rows():
    """Every entry, logits included, lies in the rows made at the start (the budget), so a long prompt's entries
    at each chunk boundary take no memory beyond it; an evicted entry's row goes to the next one."""
    cache = StateCache(max_bytes=2 * 100, shapes=((10,), (10,), (5,)))  # two rows
    for k in (1, 2, 3):
        cache.put([k], _fill(float(k)))  # [3] evicts [1], the least recently used
    assert cache.longest_prefix([1])[0] == 0 and len(cache.entries) == 2
    for k in (2, 3):
        n, entry = cache.longest_prefix([k, 9])
        assert n == 1 and all((a == k).all() for a in entry)
        assert all(np.shares_memory(a, rows) for a, rows in zip(entry, cache.rows, strict=True))


def test_state_cache_rows_are_made_once():
    """Entries are rows of the storage made at the start (the pool's: device memory on CUDA); a failed fill gives
    its row back; a cache smaller than one entry caches nothing."""
    made = []

    def make_rows(capacity, shapes):
        made.append((capacity, shapes))
        return [np.zeros((capacity, *shape), np.float32) for shape in shapes]

    cache = StateCache(max_bytes=250, shapes=((4, 2), (3,), (7,)), make_rows=make_rows)  # 72 bytes an entry: 3 rows
    assert made == [(3, ((4, 2), (3,), (7,)))]

    def broken(entry):
        raise RuntimeError("the device copy failed")

    with pytest.raises(RuntimeError):
        cache.put([5], broken)
    assert not cache.entries and len(cache.free) == 3
    for i in range(5):
        cache.put([i], _fill(i))
    assert len(made) == 1 and len(cache.entries) == 3 and (cache.longest_prefix([4])[1][0] == 4).all()
    assert StateCache(max_bytes=10, shapes=((4, 2), (3,), (7,))).capacity == 0


def test_stopped_engine_refuses_and_aborts(bundle_factory):
    """Stopping ends every queued or running request with "abort", and a stopped engine refuses new ones."""
    from mambatrt.runtime.engine import EngineStopped

    bundle = load_bundle(bundle_factory("tiny-odd", "split", plans="none"))
    engine = Engine(OrtCpuRunner(bundle), EngineConfig(max_batch=2)).start()
    finals = []
    for i in range(4):
        sampling = Sampling(max_new_tokens=100_000, stop_on_eos=False)
        engine.submit(Request([1 + i, 2], sampling, lambda e: finals.append(e) if e.finish_reason else None))
    engine.stop()
    assert [e.finish_reason for e in finals] == ["abort"] * 4
    with pytest.raises(EngineStopped):
        engine.submit(Request([1], Sampling(max_new_tokens=1), lambda e: None))


def test_cancelled_while_prefill_runs_beside_decode(bundle_factory):
    """Prefill beside decode: cancelling prompts that are staged (their rows being prefilled in the worker thread)
    or queued ends each with "abort" once, frees every staging row and slot, and the others still give the tokens
    they give alone. A long-running sequence keeps decode launches going beside the prefill launches; its
    cancellation comes while a decode launch, fed or not, holds its slot."""
    bundle = load_bundle(bundle_factory("tiny-odd", "split", plans="none"))
    engine = Engine(OrtCpuRunner(bundle, "kernels"), EngineConfig(max_batch=4, pipelined=True))
    engine.start()
    assert engine.pipelined and engine.feeding
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 203, 200).tolist() for _ in range(8)]
    finals: dict[int, list] = {}
    tokens: dict[int, list[int]] = {i: [] for i in range(-1, len(prompts))}
    done = threading.Event()

    def emit(i, event):
        if event.token is not None:
            tokens[i].append(event.token)
        if event.finish_reason is not None:
            finals.setdefault(i, []).append(event.finish_reason)
            if len(finals) == len(prompts) + 1:
                done.set()

    try:
        keep = Request([7, 8], Sampling(max_new_tokens=100_000, stop_on_eos=False), lambda e: emit(-1, e))
        engine.submit(keep)
        requests = []
        for i, prompt in enumerate(prompts):
            requests.append(Request(prompt, Sampling(max_new_tokens=6, stop_on_eos=False), lambda e, i=i: emit(i, e)))
            engine.submit(requests[-1])
        for i in (1, 2, 5):  # staged or waiting, most likely still prefilling (200 tokens: four chunks each)
            engine.cancel(requests[i].id)
        for _ in range(2400):  # at most 120 s for the 8 prompts to end
            if len(finals) >= len(prompts):
                break
            time.sleep(0.05)
        engine.cancel(keep.id)
        assert done.wait(120), finals
    finally:
        engine.stop()
    print({i: f for i, f in finals.items()})
    assert all(len(f) == 1 for f in finals.values())  # one final event per request
    assert finals[-1] == ["abort"]
    for i, prompt in enumerate(prompts):
        if finals[i] == ["length"]:
            assert tokens[i] == _alone(bundle, prompt, 6), i
        else:
            assert i in (1, 2, 5) and finals[i] == ["abort"]
    assert sum(finals[i] == ["abort"] for i in (1, 2, 5)) >= 1
    scheduler = engine.scheduler
    assert scheduler.running == [] and scheduler.staging == [] and not scheduler.waiting
    assert engine.executor.inflight is None


@pytest.mark.parametrize("cache_mib", [0, 64])
def test_fed_launches_equal_each_alone(default_bundle, cache_mib):
    """Feeding: while the slots stay the same, each greedy decode launch is begun from the last one's picks
    before the host has them (here the pool runs the launches in turn, the picks of one the ids of the next).
    Sequences end in different launches and keep their slots, ended, for a launch or two; prompts join between
    (more prompts than slots) and after; each gives exactly the tokens it gives alone, and launches were fed."""
    config = EngineConfig(max_batch=16, cache_bytes=cache_mib << 20, pipelined=True)
    engine = Engine(OrtCpuRunner(default_bundle, "kernels"), config)
    check_fed_launches(engine, default_bundle, cache_mib)


def test_fed_launches_free_a_cancelled_slot_at_once(default_bundle):
    """Feeding lets an ended sequence keep its slot for a few launches; a cancelled one (a vanished client) does
    not: the next iteration frees its slot, while the others go on decoding."""
    engine = Engine(OrtCpuRunner(default_bundle, "kernels"), EngineConfig(max_batch=4, pipelined=True))
    events = {i: [] for i in range(3)}
    requests = [
        Request([5 + i, 9, 11], Sampling(max_new_tokens=100_000, stop_on_eos=False), events[i].append) for i in range(3)
    ]
    try:
        for r in requests:
            engine.submit(r)
        engine.start()
        for _ in range(1000):  # all three decoding, launches fed
            if len(engine.scheduler.running) == 3 and engine.totals["fed_launches"] > 5:
                break
            time.sleep(0.01)
        engine.cancel(requests[1].id)
        for _ in range(1000):
            if len(engine.scheduler.running) == 2:
                break
            time.sleep(0.01)
        slots, before = len(engine.scheduler.running), len(events[0])
        time.sleep(0.2)
        after = len(events[0])
    finally:
        engine.stop()
    print("fed", engine.totals["fed_launches"], "slots after the cancel", slots, "tokens", before, after)
    assert slots == 2 and events[1][-1].finish_reason == "abort"
    assert after > before  # the others still decode


def check_fed_launches(engine, bundle, cache_mib):
    """Run 18 prompts of mixed lengths (3 to 19 new tokens each: several end in most launches) through the feeding
    ``engine`` (16 slots); each must give its tokens alone on the CPU and, with a cache, leave the states of its
    exact prefix alone in it. Returns the trace's records when the engine has a trace."""
    rng = np.random.default_rng(23)
    vocab = bundle.config.vocab_size
    prompts = [rng.integers(0, vocab, n).tolist() for n in LENGTHS + [3, 9, 1, 64, 40, 2, 7, 66, 12]]
    news = [3 + (5 * i) % 17 for i in range(len(prompts))]  # 3..19 tokens: several end in most launches
    samplings = [Sampling(max_new_tokens=k, stop_on_eos=False) for k in news]
    try:
        results = _run_all(engine, prompts, 0, start=True, samplings=samplings)
        for _ in range(100):  # the last final event goes out just before its sequence is counted as ended
            stats = engine.stats()
            if stats["running"] == 0:
                break
            time.sleep(0.01)
    finally:
        engine.stop()
    totals = engine.totals
    print(totals["decode_launches"], "launches,", totals["fed_launches"], "fed;", stats)
    assert engine.feeding and totals["fed_launches"] > 0
    assert stats["running"] == 0  # ended sequences still holding slots are not counted as running
    for i, prompt in enumerate(prompts):
        want = _alone(bundle, prompt, news[i])
        assert results[i][0] == want, (i, len(prompt), results[i][0], want)
    assert engine.scheduler.running == [] and engine.scheduler.staging == []
    if not cache_mib:
        return
    # greedy tokens may not show a wrong state at once: the completions' cached states must equal those of their
    # exact prefixes alone (a slot fed the wrong ids, or moved under a fed launch, would not)
    worst, alone = 0.0, OrtCpuRunner(bundle)
    for i, prompt in enumerate(prompts):
        exact = prompt + results[i][0][:-1]
        found, entry = engine.cache.longest_prefix(exact)
        assert found == len(exact), i
        alone.reset()
        for start in range(0, len(exact), 64):
            alone.run("prefill", np.asarray(exact[start : start + 64], np.int64))
        for got, want in zip(entry[:2], alone.get_state(), strict=True):
            want = np.asarray(want, np.float32).reshape(-1)
            if hasattr(got, "address"):  # a state cached in device memory (CUDA): one sequence's [L, E, ..]
                host = np.empty_like(want)
                from mambatrt.runtime.runners import cudart

                cudart.copy(host.ctypes.data, got.address, host.nbytes)
                got = host
            got = np.asarray(got).reshape(-1)
            worst = max(worst, float(np.abs(got - want).max() / np.abs(want).max()))
    print(f"fed launches' completions: worst relative state difference {worst:.3e} (tolerance 1e-5)")
    assert worst < 1e-5


@pytest.mark.parametrize("pipelined", [False, True])
def test_warm_then_start(bundle_factory, pipelined):
    """`serve` warms the engine before it starts: the engine's thread starts to warm (a GPU's captured graphs live
    in the capturing thread's context) and waits; requests queued before start() then run, and an engine stopped
    after warm() without start() ends its thread and aborts what was queued."""
    bundle = load_bundle(bundle_factory("tiny-odd", "split", plans="none"))
    prompts = [np.random.default_rng(i).integers(0, 203, n).tolist() for i, n in enumerate((3, 70))]
    engine = Engine(OrtCpuRunner(bundle, "kernels"), EngineConfig(max_batch=2, pipelined=pipelined))
    assert engine.warm()[0] == 0  # nothing is captured on a CPU
    assert engine.thread.is_alive() and engine.scheduler.running == []
    with pytest.raises(RuntimeError, match="before start"):
        engine.warm()
    try:
        got = _run_all(engine, prompts, 5, start=True)
    finally:
        engine.stop()
    assert not engine.thread.is_alive()
    for i, prompt in enumerate(prompts):
        assert got[i][0] == _alone(bundle, prompt, 5)

    idle = Engine(OrtCpuRunner(bundle), EngineConfig(max_batch=2))
    idle.warm()
    finals = []
    idle.submit(Request([1, 2], Sampling(max_new_tokens=3), lambda e: finals.append(e.finish_reason)))
    idle.stop()
    assert not idle.thread.is_alive() and finals == ["abort"]


def test_text_decoded_by_the_engine_or_left_to_the_caller(tmp_path):
    """A request that leaves its text to the caller (serve's front ends decode it) gets the same tokens, in events
    without text; decoding those tokens as the front ends do gives the engine's text. A request with stop strings is
    decoded by the engine whatever it asks: the engine reads the text to stop."""
    from mambatrt.compile.bundle import build_bundle
    from mambatrt.runtime.tokenizer import Tokenizer, eos_id
    from tests.runtime.test_server import DEFAULT_MODEL

    bundle = load_bundle(build_bundle(DEFAULT_MODEL, tmp_path / "b", plans="none", quiet=True))
    tok = Tokenizer(bundle)
    engine = Engine(OrtCpuRunner(bundle), EngineConfig(max_batch=4), eos_id=eos_id(bundle), decode_text=tok.stream)
    engine.start()
    prompt = tok.encode("The module provides")

    def events(new_tokens: int = 24, **kwargs) -> list:
        out, done = [], threading.Event()

        def emit(event):
            out.append(event)
            if event.finish_reason is not None:
                done.set()

        engine.submit(Request(prompt, Sampling(max_new_tokens=new_tokens, stop_on_eos=False), emit, **kwargs))
        assert done.wait(60)
        return out

    try:
        decoded, bare, stopped = events(), events(detokenize=False), events(detokenize=False, stop=(" use",))
        # a stop string first met late in a long completion: the text sent long before has been dropped by then
        long_text = "".join(e.text for e in events(300))
        late = long_text[400:410]
        late_stopped = events(300, stop=(late,))
    finally:
        engine.stop()
    first = long_text.index(late)
    print(len(long_text), first, repr(late))
    assert first > 200 and late_stopped[-1].finish_reason == "stop"
    assert "".join(e.text for e in late_stopped) == long_text[:first]
    tokens = [e.token for e in decoded if e.token is not None]
    text = "".join(e.text for e in decoded)
    step = tok.stream()
    caller = "".join(step(e.token) for e in bare if e.token is not None and e.finish_reason != "stop")
    print(repr(text), repr(caller), [e.finish_reason for e in (decoded[-1], bare[-1], stopped[-1])])
    assert [e.token for e in bare if e.token is not None] == tokens and all(e.text == "" for e in bare)
    assert caller == text and " use" in text
    assert stopped[-1].finish_reason == "stop" and "".join(e.text for e in stopped) == text[: text.index(" use")]


def test_sampler_rows_draw_from_each_seed_or_the_shared_rng():
    """The device sampler's (temperature, draw) rows: a seeded request's draws are its own RNG's, one per sampled
    token in order (so its tokens on the device are those the host picks), whatever runs beside it; the others come
    from the shared RNG; greedy rows draw 0 and take nothing from their RNG."""
    from mambatrt.runtime.engine.request import Sequence
    from mambatrt.runtime.engine.sampling import sampler_rows

    def seq(temperature, seed=None):
        return Sequence(Request([1, 2], Sampling(temperature=temperature, seed=seed), lambda e: None), None)

    seeded, other, greedy, seeded_greedy = seq(0.7, 5), seq(1.0), seq(0.0), seq(0.0, 9)
    shared = np.random.default_rng(3)
    first = sampler_rows([seeded, other, greedy, seeded_greedy], shared)
    second = sampler_rows([greedy, seeded], shared)
    print(first, second)
    own = np.random.default_rng(5).random(2)
    assert first[:, 0].tolist() == [0.7, 1.0, 0.0, 0.0] and second[:, 0].tolist() == [0.0, 0.7]
    assert first[0, 1] == own[0] and second[1, 1] == own[1]  # the seed's first and second draws
    assert first[2, 1] == first[3, 1] == second[0, 1] == 0.0
    assert 0.0 <= first[1, 1] < 1.0 and first[1, 1] == np.random.default_rng(3).random(4)[1]  # the shared RNG's
    assert seeded_greedy._rng is None  # a greedy request never makes an RNG


def test_cuda_pool_batch_buckets():
    """The decode launch's padded batch sizes (the CUDA pool's captured graphs): powers of two, quarters of each
    octave from 32 on, and max_batch; every batch from 1 to max_batch has one, at most 1.25 x its size from 32 on."""
    from mambatrt.runtime.runners.ort.cuda_pool import batch_buckets as _batch_buckets

    assert _batch_buckets(128) == [1, 2, 4, 8, 16, 32, 40, 48, 56, 64, 80, 96, 112, 128]
    assert _batch_buckets(6) == [1, 2, 4, 6] and _batch_buckets(100)[-4:] == [64, 80, 96, 100]
    for max_batch in (1, 7, 48, 64, 100, 256):
        buckets = _batch_buckets(max_batch)
        for n in range(1, max_batch + 1):
            b = next(b for b in buckets if b >= n)
            assert b <= max_batch and (n < 32 or b <= 1.25 * n), (max_batch, n, b)


def test_staging_zeroes_new_rows_around_a_cached_one(bundle_factory):
    """Staging a round of prompts zeroes the rows of those that start from nothing in runs of consecutive rows, and
    never the row between them that starts from a cached prefix (nor rows past the round)."""
    from mambatrt.contract import STATES
    from mambatrt.runtime.engine.request import Sequence

    bundle = load_bundle(bundle_factory("tiny-odd", "split", plans="none"))
    engine = Engine(OrtCpuRunner(bundle, "kernels"), EngineConfig(max_batch=8, cache_bytes=2**26))
    pool, rows = engine.pool, engine.pool.layout.rows
    assert pool.staging_rows > 4
    cached = [5, 6, 7]

    def fill(entry):
        for a in entry[:2]:
            a[...] = 0.5
        entry[2][...] = 0.0

    engine.cache.put(cached, fill)
    for kind in STATES:
        pool.staging[kind][...] = 7.0  # what earlier prompts left in the rows
    sampling = Sampling(max_new_tokens=1, stop_on_eos=False)
    for prompt in ([1, 2], cached + [8], [3], [4]):
        engine.scheduler.waiting.append(Sequence(Request(prompt, sampling, lambda e: None), None))
    engine.scheduler.stage()
    assert [s.cached_tokens for s in engine.scheduler.staging] == [0, 3, 0, 0]
    for kind in STATES:
        got = [float(np.abs(rows(pool.staging[kind], r)).max()) for r in range(4)]
        print(kind, got)
        assert got == [0.0, 0.5, 0.0, 0.0]
        assert (rows(pool.staging[kind], 4, pool.staging_rows) == 7.0).all()  # rows no prompt took
