"""Continuous batching (SpeculativeGenerator.generate_continuously): requests join a running batch between steps and
leave it when their own row stops; each is exactly what generate gives for it alone."""

import pytest
import torch

import medusa.runtime.eager
from medusa import MedusaModel
from medusa.batch import GenerationRequest as Request
from tests.conftest import FAMILIES, SLIDING_CONFIGS, make_heads, make_tiny_model, tiny_tokenizer
from tests.test_batch import RecordingStreamer, alone, tiny_drafted

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [12], [20, 21, 22, 23], [30, 31, 30, 31, 30, 31, 30]]


def heads_model(family="llama", sliding=False):
    base = make_tiny_model(family, sliding=sliding)
    return base, MedusaModel(base, make_heads(random=False), tokenizer=tiny_tokenizer(), projection_dtype=torch.float32)


class Arrivals:
    """take(room) handing over requests at given calls (before steps 0, 1, ...), recording each call's room and
    the call at which each request's result came."""

    def __init__(self, schedule: dict[int, list[Request]]):
        self.schedule, self.calls, self.rooms, self.finished = schedule, 0, [], {}

    def __call__(self, room):
        self.rooms.append(room)
        given = self.schedule.get(self.calls, [])
        for request in given:
            request.result.add_done_callback(lambda f, r=request: self.finished.setdefault(id(r), self.calls))
        self.calls += 1
        return given


@pytest.mark.parametrize(
    "family, sliding", [(f, False) for f in FAMILIES] + [(f, True) for f in sorted(SLIDING_CONFIGS)]
)  # sliding: windows of 8 tokens, which the rows outgrow (joining rows prefill apart, then take their place)
@pytest.mark.parametrize("engine", ["eager", "compiled"])
def test_requests_joining_a_running_batch_each_decode_as_alone(family, sliding, engine):
    base, model = heads_model(family, sliding)
    short = Request(torch.tensor([PROMPTS[1]]), max_new_tokens=4)
    early = [Request(torch.tensor([PROMPTS[0]]), max_new_tokens=24), short]
    later = [Request(PROMPTS[2], max_new_tokens=30), Request(torch.tensor([PROMPTS[3]]), max_new_tokens=12)]
    # the last joins with a longer prompt and more new tokens than the batch's cache was made for: it grows
    longest = Request(torch.tensor([PROMPTS[0] * 3]), max_new_tokens=40)
    arrivals = Arrivals({0: early, 2: later, 4: [longest]})
    stats = model.generate_continuously(arrivals, engine=engine, proposer="dynamic")
    requests = early + later + [longest]
    for request in requests:
        prompt = torch.as_tensor(request.input_ids).reshape(1, -1)
        expected = alone(base, prompt[0].tolist(), request.max_new_tokens)
        out = request.result.result(timeout=0)
        assert torch.equal(out.sequences, expected), request.max_new_tokens
        assert out.stats.new_tokens == request.max_new_tokens
    assert max(request.rows for request in requests) >= 3  # rows that joined decoded with the ones before
    assert arrivals.finished[id(short)] < arrivals.finished[id(early[0])]  # the short one did not wait for the batch
    assert stats.new_tokens == sum(r.max_new_tokens for r in requests) and stats.steps < stats.new_tokens


def test_take_is_asked_for_no_more_than_the_room_left_and_may_not_give_more():
    """Five requests of one length handed over as room frees, two rows at most: rows that all stop at one step
    leave an empty batch, and the next ones start a new one."""
    base, model = heads_model()
    requests = [Request(torch.tensor([p]), max_new_tokens=6) for p in PROMPTS + [[40, 41]]]
    queue, rooms = list(requests), []

    def take(room):
        rooms.append(room)
        given, queue[:] = queue[:room], queue[room:]
        return given

    model.generate_continuously(take, max_batch=2)
    assert rooms[0] == 2 and all(1 <= room <= 2 for room in rooms)  # a full batch is not asked
    assert max(request.rows for request in requests) == 2
    for request in requests:
        prompt = request.input_ids[0].tolist()
        assert torch.equal(request.result.result(timeout=0).sequences, alone(base, prompt, 6))
    with pytest.raises(ValueError, match="gave 3 requests where room was 2"):
        model.generate_continuously(lambda room: [Request([5, 6], max_new_tokens=3) for _ in range(3)], max_batch=2)
    with pytest.raises(ValueError, match="max_batch must be an integer >= 1"):
        model.generate_continuously(lambda room: [], max_batch=0)


def test_a_request_generate_refuses_gets_its_error_and_the_others_go_on():
    base, model = heads_model()
    window = base.config.max_position_embeddings
    good = Request([5, 6, 7], max_new_tokens=8)
    empty, too_long = Request([]), Request([5, 6, 7], max_new_tokens=window)
    model.generate_continuously(Arrivals({0: [empty, good], 1: [too_long]}))
    assert torch.equal(good.result.result(timeout=0).sequences, alone(base, [5, 6, 7], 8))
    with pytest.raises(ValueError, match="the prompt is empty"):
        empty.result.result(timeout=0)
    with pytest.raises(ValueError, match="exceeds the model's context window"):
        too_long.result.result(timeout=0)
    assert good.started and not empty.started and not too_long.started  # refused: never started


def test_a_failing_forward_hands_its_error_to_every_request_decoding_or_joining(monkeypatch):
    base, model = heads_model()
    done = Request([12], max_new_tokens=1)  # its first token ends it: delivered before the failure
    running = [Request([5, 6, 7], max_new_tokens=20), Request([8, 9], max_new_tokens=20)]
    engine = medusa.runtime.eager.EagerEngine
    for name in ("batch_forward", "prefill"):  # rows together, or a row alone (as one sequence's prompt)
        forward = getattr(engine, name)

        def fails_on_a_four_token_prompt(self, cache, ids, *args, forward=forward, **kwargs):
            if ids.shape == (1, 4):
                raise RuntimeError("out of memory")
            return forward(self, cache, ids, *args, **kwargs)

        monkeypatch.setattr(engine, name, fails_on_a_four_token_prompt)
    joining = Request([5, 6, 7, 8], max_new_tokens=20)  # its prefill (alone) fails, after the others' first step
    with pytest.raises(RuntimeError, match="out of memory"):
        model.generate_continuously(Arrivals({0: [done] + running, 1: [joining]}), engine="eager")
    assert torch.equal(done.result.result(timeout=0).sequences, alone(base, [12], 1))
    for request in running + [joining]:
        assert request.started
        with pytest.raises(RuntimeError, match="out of memory"):
            request.result.result(timeout=0)


def test_each_request_streams_and_stops_by_its_own_rules():
    base, model = heads_model()
    free = alone(base, PROMPTS[0], 20)[0, len(PROMPTS[0]) :].tolist()
    text = tiny_tokenizer().decode(free[5:7])  # a stop string that ends the first request at its 7th new token
    streamers = [RecordingStreamer(), RecordingStreamer()]
    stopped = Request([PROMPTS[0]], max_new_tokens=20, stop_strings=[text], streamer=streamers[0])
    other = Request([PROMPTS[2]], max_new_tokens=20, streamer=streamers[1])
    model.generate_continuously(Arrivals({0: [stopped], 1: [other]}))
    for request, streamer, prompt in zip([stopped, other], streamers, [PROMPTS[0], PROMPTS[2]]):
        new = request.result.result(timeout=0).sequences[0, len(prompt) :].tolist()
        assert streamer.puts[0] == prompt and streamer.ended == 1
        assert [t for put in streamer.puts[1:] for t in put] == new
    assert stopped.result.result().sequences[0, len(PROMPTS[0]) :].tolist() == free[:7]
    assert other.result.result().sequences[0].tolist() == alone(base, PROMPTS[2], 20)[0].tolist()


def test_rows_that_join_with_another_proposer_decode_beside_the_others_and_trees_follow_the_batch_size(monkeypatch):
    """Each join takes the layout for the batch's new size (here: one row a dynamic tree of 3 nodes, two rows the
    static tree, three plain decoding, four a dynamic tree of 5 nodes), side by side in one batch; before each step
    the dynamic rows take the node budget of the batch's size (four rows: 5 nodes each, proposing together)."""
    import medusa.dynamic_tree
    from medusa.decode import BatchLayout

    base, model = heads_model("qwen2")
    layouts = {
        1: BatchLayout("eager", False, "dynamic", [[0], [1]]),
        2: BatchLayout("eager", False, "medusa", None),
        3: BatchLayout("eager", False, "plain", None),
        4: BatchLayout("eager", False, "dynamic", [[0], [0, 0], [1], [0, 1]]),
    }
    monkeypatch.setattr(MedusaModel, "batch_layout", lambda self, lengths, *args: layouts[len(lengths)])
    proposed, propose_batch = [], medusa.dynamic_tree.DynamicTreeProposer.propose_batch

    def recorded(proposers, states):
        proposed.append((len(proposers), proposers[0].num_nodes))
        return propose_batch(proposers, states)

    monkeypatch.setattr(medusa.dynamic_tree.DynamicTreeProposer, "propose_batch", staticmethod(recorded))
    requests = [Request([p], max_new_tokens=20) for p in PROMPTS]
    model.generate_continuously(Arrivals({0: requests[:1], 1: requests[1:2], 2: requests[2:3], 3: requests[3:]}))
    for request, prompt in zip(requests, PROMPTS):
        assert torch.equal(request.result.result(timeout=0).sequences, alone(base, prompt, 20))
    assert max(request.rows for request in requests) == 4
    assert proposed[0] == (1, 3) and (2, 5) in proposed  # alone: 3 nodes; among four rows the two dynamic ones: 5


def test_a_draft_model_decodes_requests_joining_a_running_batch_exactly():
    target, drafted = tiny_drafted()
    requests = [Request([p], max_new_tokens=12 + 4 * r) for r, p in enumerate(PROMPTS)]
    drafted.generate_continuously(Arrivals({0: requests[:2], 2: requests[2:]}))
    for request, prompt in zip(requests, PROMPTS):
        expected = alone(target, prompt, request.max_new_tokens)
        assert torch.equal(request.result.result(timeout=0).sequences, expected)
    assert max(request.rows for request in requests) == 4


def test_greedy_and_sampled_requests_share_a_batch_each_with_its_own_settings():
    """Each request's sampling is its own (the call's where it sets none): greedy rows beside sampled ones are still
    transformers' greedy output; a sampled row draws at its own temperature (its distribution: test_distribution)."""
    base, model = heads_model()
    greedy = [Request([p], max_new_tokens=16) for p in PROMPTS[:2]]
    sampled = [Request([p], max_new_tokens=16, do_sample=True, temperature=t) for p, t in zip(PROMPTS[2:], [0.7, 1.5])]
    torch.manual_seed(0)
    model.generate_continuously(Arrivals({0: [sampled[0], greedy[0]], 1: [greedy[1], sampled[1]]}), do_sample=False)
    for request, prompt in zip(greedy, PROMPTS):
        assert torch.equal(request.result.result(timeout=0).sequences, alone(base, prompt, 16))
    assert max(request.rows for request in greedy + sampled) == 4
    # the call's sampling holds where a request sets none
    called = [Request([p], max_new_tokens=16) for p in PROMPTS[:2]]
    torch.manual_seed(0)
    model.generate_continuously(Arrivals({0: called}), do_sample=True, temperature=1.5)
    assert any(
        not torch.equal(r.result.result(timeout=0).sequences, g.result.result(timeout=0).sequences)
        for r, g in zip(called, greedy)
    )


@pytest.mark.slow
def test_one_batch_package_serves_the_cache_as_it_grows(tmp_path, monkeypatch):
    """On the inductor engine a batch's steps run through one package whatever its cache's size: a request joining
    with a longer prompt and more tokens than the cache holds grows it (small sizes here), and every step before and
    after runs through the same package, each request as decoded alone."""
    import medusa.runtime.aot
    import medusa.runtime.static

    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path))
    monkeypatch.setattr(medusa.runtime.static, "INDUCTOR_CPU_OPTIONS", {"freezing": True})  # no GEMM benchmarking
    monkeypatch.setattr(medusa.runtime.static, "COMPILED_MIN_ROWS", 32)
    ran, run_rows = [], medusa.runtime.aot.run_rows
    monkeypatch.setattr(
        medusa.runtime.aot,
        "run_rows",
        lambda runner, cache, *a, **k: ran.append((runner, cache.max_rows)) or run_rows(runner, cache, *a, **k),
    )
    base, model = heads_model()
    early = [
        Request(torch.tensor([PROMPTS[0]]), max_new_tokens=12),
        Request(torch.tensor([PROMPTS[2]]), max_new_tokens=10),
    ]
    longest = Request(torch.tensor([PROMPTS[0] * 3]), max_new_tokens=30)  # 39 + 30 rows: past the first cache's 64
    model.generate_continuously(Arrivals({0: early, 2: [longest]}), engine="inductor", proposer="dynamic")
    for request in early + [longest]:
        prompt = torch.as_tensor(request.input_ids).reshape(1, -1)
        expected = alone(base, prompt[0].tolist(), request.max_new_tokens)
        assert torch.equal(request.result.result(timeout=0).sequences, expected)
    runners, sizes = {id(runner) for runner, _ in ran}, [rows for _, rows in ran]
    assert len(runners) == 1 and sizes[0] < sizes[-1]  # one package, before and after the cache grew
    assert len(list((tmp_path / "aoti").glob("batch-*.pt2"))) == 1
