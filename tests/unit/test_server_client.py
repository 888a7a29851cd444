"""The client of vLLM servers (`generation.backend: vllm_server`) against a stand-in server
(tests/fake_vllm.py) that answers from a transformers model: requests carry token ids, seeds,
sampling settings and stop ids; answers arrive as token ids with their log-probs, row by row
as the local generator gives them; every sync uses a new name and a pinned call keeps its own;
wrong models, unknown versions, timeouts, dead servers and cut or malformed answers fail loudly,
after bounded retries, within one deadline a batch; syncs that fail half-way leave nothing
behind."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from fake_vllm import CUT, NOT_JSON, WRONG_SHAPE, FakeVLLM

from rlhf_cli.errors import GenerationServerLost, ModelLoadError
from rlhf_cli.generation import HFGenerator, generator_for, require_engine
from rlhf_cli.generation.vllm import merged_weights
from rlhf_cli.generation.weight_transfer import weight_transfer
from rlhf_cli.modeling import load_tokenizer, resolve_model_path
from rlhf_cli.recipe import GenerationSection, ServerSection

GEN = GenerationSection(max_new_tokens=6, temperature=0.9, top_p=0.95, top_k=20)


@pytest.fixture(scope="module")
def tiny() -> tuple[str, object]:
    folder = resolve_model_path("builtin:tiny-lm")
    return folder, load_tokenizer(folder)


def _model(folder: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture
def fake(tiny):
    server = FakeVLLM(tiny[0], tiny[1])
    yield server
    server.stop()


def _gen(urls: list[str], **server: object) -> GenerationSection:
    return GEN.model_copy(
        update={"backend": "vllm_server", "server": ServerSection(urls=urls, **server)}
    )


def _client(model, tokenizer, gen, tmp_path: Path):
    return generator_for(model, tokenizer, gen, max_len=64, scratch=tmp_path)


def _queries(tokenizer) -> list[list[int]]:
    texts = ["Hello there, friend", "What is a good name for a cat?", "Tell me a story", "Hi"]
    return [tokenizer(t)["input_ids"] for t in texts]


def test_requests_carry_ids_seeds_and_stops_and_answers_come_back_as_sampled(tiny, fake, tmp_path):
    folder, tokenizer = tiny
    model = _model(folder)
    client = _client(model, tokenizer, _gen([fake.url]), tmp_path)
    queries, seeds = _queries(tokenizer), [11, 12, 13, 14]
    fake.requests.clear()
    answers = client.generate(queries, GEN, seeds)
    local = HFGenerator(model, tokenizer, client.stop_ids).generate(queries, GEN, seeds)
    assert torch.equal(answers.response_ids, local.response_ids)
    assert torch.equal(answers.response_mask, local.response_mask)
    assert torch.allclose(answers.sampler_logprobs, local.sampler_logprobs)
    assert answers.texts == local.texts
    asked = sorted((b for p, b in fake.requests if p == "/v1/completions"), key=lambda b: b["seed"])
    assert [b["prompt"] for b in asked] == queries  # token ids, never text
    assert [b["seed"] for b in asked] == seeds
    first = asked[0]
    assert (first["max_tokens"], first["temperature"], first["top_p"], first["top_k"]) == (
        6, 0.9, 0.95, 20,
    )  # fmt: skip
    assert first["stop_token_ids"] == client.stop_ids and first["ignore_eos"]
    assert first["logprobs"] == 1 and first["return_token_ids"]
    assert first["model"] == folder  # a model without adapter: the servers' base


def test_rows_are_split_across_servers_in_order(tiny, tmp_path):
    folder, tokenizer = tiny
    servers = [FakeVLLM(folder, tokenizer), FakeVLLM(folder, tokenizer)]
    try:
        model = _model(folder)
        client = _client(model, tokenizer, _gen([s.url for s in servers]), tmp_path)
        for s in servers:
            s.requests.clear()
        queries = _queries(tokenizer)
        answers = client.generate(queries, GEN, [1, 2, 3, 4])
        got = [sorted(b["seed"] for p, b in s.requests if p == "/v1/completions") for s in servers]
        assert got == [[1, 2], [3, 4]]
        local = HFGenerator(model, tokenizer, client.stop_ids).generate(queries, GEN, [1, 2, 3, 4])
        assert torch.equal(answers.response_ids, local.response_ids)
    finally:
        for s in servers:
            s.stop()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_server_that_does_not_answer_is_one_line_naming_it(tiny):
    url = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(ModelLoadError, match=rf"ppo.generation.server.urls: {url} does not answer"):
        require_engine(_gen([url]))


def test_a_server_with_another_base_is_refused_unless_the_sync_replaces_its_weights(tiny, tmp_path):
    """LoRA sync trains on the servers' base: another one is refused by the probe. Weights
    sync replaces the servers' weights before the probe: then it answers as the policy."""
    folder, tokenizer = tiny
    other = _model(folder)
    with torch.no_grad():
        other.lm_head.weight.mul_(-8.0)  # same shapes and tokenizer, other distributions
    other.save_pretrained(tmp_path / "other")
    server = FakeVLLM(str(tmp_path / "other"), tokenizer)
    try:
        with pytest.raises(ModelLoadError, match="serves another model than this recipe's policy"):
            _client(_lora_policy(folder), tokenizer, _gen([server.url]), tmp_path / "a")
        policy = _model(folder)
        client = _client(policy, tokenizer, _gen([server.url], sync="weights"), tmp_path / "b")
        queries = _queries(tokenizer)
        local = HFGenerator(policy, tokenizer, client.stop_ids).generate(queries, GEN, [1, 2, 3, 4])
        answers = client.generate(queries, GEN, [1, 2, 3, 4])
        assert torch.equal(answers.response_ids, local.response_ids)
    finally:
        server.stop()


def test_a_server_shorter_than_the_recipe_needs_is_refused(tiny, tmp_path):
    folder, tokenizer = tiny
    server = FakeVLLM(folder, tokenizer, max_model_len=32)
    try:
        with pytest.raises(ModelLoadError, match="holds 32 tokens .* need 64"):
            _client(_model(folder), tokenizer, _gen([server.url]), tmp_path)
    finally:
        server.stop()


def _lora_policy(folder: str):
    from peft import LoraConfig, get_peft_model

    policy = get_peft_model(_model(folder), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)  # an adapter that changes the answers
    return policy.eval()


def test_lora_sync_sends_a_new_adapter_each_time_and_a_pinned_call_keeps_its_own(
    tiny, fake, tmp_path
):
    folder, tokenizer = tiny
    policy = _lora_policy(folder)
    client = _client(policy, tokenizer, _gen([fake.url]), tmp_path)
    assert client.mode == "lora" and client.latest.adapter in fake.adapters  # the probe's sync
    queries, seeds = _queries(tokenizer), [5, 6, 7, 8]
    local = HFGenerator(policy, tokenizer, client.stop_ids).generate(queries, GEN, seeds)
    first = client.sync(policy)
    assert torch.equal(client.generate(queries, GEN, seeds, first).response_ids, local.response_ids)

    pinned = client.pinned(first)  # a rollout asked for ahead names this version
    client.sync(policy)
    latest = client.sync(policy)
    assert len({first, latest}) == 2 and first.adapter in fake.adapters  # still loaded
    assert len(fake.adapters) == 2  # the one in between is gone
    fake.requests.clear()
    pinned(queries[:1], GEN, seeds[:1])
    assert [b["model"] for p, b in fake.requests if p == "/v1/completions"] == [first.adapter]
    client.sync(policy)  # now nothing names it: unloaded, its folder removed
    assert first.adapter not in fake.adapters
    assert not (tmp_path / ".server-sync" / first.name).exists()
    with pytest.raises(RuntimeError, match=f"names policy {first.name}, which the servers no"):
        client.generate(queries, GEN, seeds, first)  # never answered by another version
    with policy.disable_adapter():  # the reference is the servers' base model
        reference = client.sync(policy)
        assert reference.adapter is None
        fake.requests.clear()
        client.generate(queries[:1], GEN, seeds[:1], reference)
    assert [b["model"] for p, b in fake.requests if p == "/v1/completions"] == [folder]


def test_an_answer_of_another_model_is_never_taken(tiny, fake, tmp_path):
    folder, tokenizer = tiny
    client = _client(_model(folder), tokenizer, _gen([fake.url]), tmp_path)
    fake.answer_as = "rlhf-someone-else-v3"
    with pytest.raises(GenerationServerLost, match="unknown policy version"):
        client.generate(_queries(tokenizer), GEN, [1, 2, 3, 4])


def test_failures_are_retried_then_the_server_is_lost(tiny, fake, tmp_path, monkeypatch):
    folder, tokenizer = tiny
    monkeypatch.setattr("rlhf_cli.generation.server.time.sleep", lambda s: None)
    client = _client(_lora_policy(folder), tokenizer, _gen([fake.url], retries=2), tmp_path)
    query = _queries(tokenizer)[:1]
    fake.fail = [500, 0]  # an error, then a dropped connection: the third try answers
    assert client.generate(query, GEN, [1]).response_ids.shape[0] == 1
    fake.fail = [503] * 3
    with pytest.raises(GenerationServerLost, match=r"failed /v1/completions 3 time\(s\)"):
        client.generate(query, GEN, [1])
    fake.fail = [404]  # a refusal is not retried
    with pytest.raises(GenerationServerLost, match="refused /v1/completions: HTTP 404"):
        client.generate(query, GEN, [1])


def test_a_server_that_stays_silent_times_out(tiny, fake, tmp_path):
    folder, tokenizer = tiny
    client = _client(
        _model(folder), tokenizer, _gen([fake.url], retries=0, timeout_s=0.3), tmp_path
    )
    fake.delay_s = 1.0
    with pytest.raises(GenerationServerLost, match="no answer within the timeout"):
        client.generate(_queries(tokenizer)[:1], GEN, [1])


def _answers_as_the_policy_then_resyncs(client, policy, tokenizer, fake: FakeVLLM) -> str:
    """The server answers as `policy` does locally (same seeds, same tokens); a second sync
    moves it to a new weight version. Returns the first version."""
    queries, seeds = _queries(tokenizer), [3, 4, 5, 6]
    local = HFGenerator(policy, tokenizer, client.stop_ids).generate(queries, GEN, seeds)
    before = client.latest
    assert torch.equal(
        client.generate(queries, GEN, seeds, before).response_ids, local.response_ids
    )
    after = client.sync(policy)
    assert after != before and fake.version == after.name
    with pytest.raises(RuntimeError, match="which the servers no longer hold"):
        client.pinned(before)  # its weights were replaced
    return before.name


def test_weights_sync_reloads_the_merged_weights_under_a_version(tiny, fake, tmp_path):
    folder, tokenizer = tiny
    policy = _lora_policy(folder)
    client = _client(policy, tokenizer, _gen([fake.url], sync="weights"), tmp_path)
    assert client.mode == "weights" and fake.version == client.latest.name
    before = _answers_as_the_policy_then_resyncs(client, policy, tokenizer, fake)
    assert not (tmp_path / ".server-sync" / before).exists()  # one weights folder at a time
    fake.version = "rlhf-another-run-v9"  # another trainer synced to the same server
    with pytest.raises(GenerationServerLost, match="another trainer is syncing to it"):
        client.generate(_queries(tokenizer), GEN, [3, 4, 5, 6])


class _Meta(NamedTuple):  # vLLM's ParamMeta
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


def _fake_nccl_vllm(monkeypatch, server: FakeVLLM) -> list[Any]:
    """vLLM's trainer-side NCCL engine in miniature, installed as the `vllm` modules the client
    imports: it drives the control plane as vLLM 0.32's `NCCLTrainerWeightTransferEngine` does
    (init beside the rendezvous; each round start, update beside the broadcast, finish) and
    delivers the tensors itself (the broadcast, on a machine without CUDA). Returns the init
    infos it was given."""
    inits: list[Any] = []

    @dataclass
    class InitInfo:
        master_address: str
        master_port: int
        world_size: int
        rank: int

    class Engine:
        def __init__(self, client: Any, source: Any) -> None:
            self.client, self.source = client, source

        @classmethod
        def trainer_init(cls, info: InitInfo, *, client: Any, source: Any) -> Engine:
            inits.append(info)
            client.init_weight_transfer_engine(
                {"master_address": info.master_address, "master_port": info.master_port,
                 "rank_offset": 1, "world_size": info.world_size}
            )  # fmt: skip
            return cls(client, source)

        def send_weights(self) -> None:
            meta = self.source.metadata()
            self.client.start_weight_update()
            self.client.update_weights(
                {"names": [m.name for m in meta], "shapes": [list(m.shape) for m in meta],
                 "dtype_names": [str(m.dtype).split(".")[-1] for m in meta]}
            )  # fmt: skip
            sent = dict(iter(self.source))
            assert list(sent) == [m.name for m in meta]  # both channels agree, in order
            server.base.load_state_dict(sent, strict=False)  # the broadcast
            self.client.finish_weight_update()

    modules = {name: types.ModuleType(name) for name in (
        "vllm", "vllm.distributed", "vllm.distributed.weight_transfer",
        "vllm.distributed.weight_transfer.base", "vllm.distributed.weight_transfer.nccl_engine",
    )}  # fmt: skip
    modules["vllm.distributed.weight_transfer.base"].ParamMeta = _Meta
    engine = modules["vllm.distributed.weight_transfer.nccl_engine"]
    engine.NCCLTrainerInitInfo, engine.NCCLTrainerWeightTransferEngine = InitInfo, Engine
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return inits


def test_nccl_weight_transfer_drives_vllms_handshake_then_versions_the_weights(
    tiny, fake, tmp_path, monkeypatch
):
    """`weight_transfer: nccl`: a group opened once (the server's workers + this process as
    rank 0, on the address the server reaches), any group a stopped trainer left shut first;
    every sync start → update (the merged weights' names, shapes, dtypes) → finish, then the
    new version checked; nothing written to the shared folder; answers as the policy's."""
    folder, tokenizer = tiny
    inits = _fake_nccl_vllm(monkeypatch, fake)
    policy = _lora_policy(folder)  # its adapter changes the answers: the base must not do
    gen = _gen([fake.url], sync="weights", weight_transfer="nccl")
    client = _client(policy, tokenizer, gen, tmp_path)
    assert (client.mode, client.transfer) == ("weights", "nccl")
    (info,) = inits
    assert (info.world_size, info.rank, info.master_address) == (2, 0, "127.0.0.1")
    steps = [path for path, _ in fake.transfer]
    assert steps == ["/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
                     "/finish_weight_update"]  # fmt: skip
    update = fake.transfer[2][1]["update_info"]
    merged = dict(merged_weights(policy))
    assert update["names"] == list(merged) and not any("lora" in n for n in update["names"])
    assert update["shapes"][0] == list(next(iter(merged.values())).shape)
    _answers_as_the_policy_then_resyncs(client, policy, tokenizer, fake)
    assert [p for p, _ in fake.transfer][4:] == steps[1:]  # no second init
    assert not any((tmp_path / ".server-sync").glob("rlhf-*"))  # no weights on disk


def test_nccl_weight_transfer_is_refused_before_loading_where_it_cannot_run(fake, monkeypatch):
    """An explicit `nccl` without CUDA (this machine) is one line naming the field; `auto`
    picks the shared folder here."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(
        ModelLoadError, match=r"ppo.generation.server.weight_transfer: nccl needs CUDA"
    ):
        require_engine(_gen([fake.url], weight_transfer="nccl"))
    assert weight_transfer(ServerSection(urls=[fake.url])) == "disk"


def _tighter(client, **server: object):
    """`client` with other server settings from now on (it was built and probed with the
    defaults, unhurried)."""
    client.server = client.server.model_copy(update=server)
    return client


def _completions(fake: FakeVLLM) -> list[dict]:
    return [b for p, b in fake.requests if p == "/v1/completions"]


def test_a_hung_server_ends_the_batch_at_one_deadline_and_the_queued_rows_are_never_asked(
    tiny, fake, tmp_path, monkeypatch
):
    """Two rows in flight, six queued; every try of the two times out. The batch ends at
    (retries + 1) x timeout_s plus the pause (2 s), not after four waves of it (8 s, as on
    f41b8ed), and leaves no thread that would hold the interpreter's exit."""
    folder, tokenizer = tiny
    monkeypatch.setattr("rlhf_cli.generation.server.MAX_IN_FLIGHT", 2)
    client = _tighter(_client(_model(folder), tokenizer, _gen([fake.url]), tmp_path),
                      retries=1, timeout_s=0.5)  # fmt: skip
    fake.requests.clear()
    fake.hang = True
    start = time.monotonic()
    with pytest.raises(GenerationServerLost, match=f"the rollout server at {fake.url}") as lost:
        client.generate(_queries(tokenizer) * 2, GEN, list(range(8)))
    assert time.monotonic() - start < 4.0
    assert lost.value.exit_code == 2 and "\n" not in str(lost.value)
    assert {b["seed"] for b in _completions(fake)} <= {0, 1}  # rows 2..7 never asked
    assert len(_completions(fake)) <= 4  # two rows, two tries each
    held = [t for t in threading.enumerate() if t.name.startswith("vllm-server")]
    assert all(t.daemon for t in held)


def test_a_released_call_waiting_on_a_hung_server_ends_at_once(tiny, fake, tmp_path):
    """A rollout asked for ahead (`pinned`) and dropped (`release`) while its server hangs:
    the call ends now, not after server.timeout_s (300 s), and its version is unpinned."""
    folder, tokenizer = tiny
    client = _client(_model(folder), tokenizer, _gen([fake.url]), tmp_path)
    policy = client.latest
    pinned = client.pinned(policy)
    fake.hang = True
    outcome: list[BaseException] = []

    def draft() -> None:
        try:
            pinned(_queries(tokenizer), GEN, [1, 2, 3, 4])
        except BaseException as exc:  # noqa: BLE001
            outcome.append(exc)

    thread = threading.Thread(target=draft, daemon=True)
    thread.start()
    time.sleep(0.5)
    start = time.monotonic()
    pinned.release()
    thread.join(5.0)
    assert not thread.is_alive() and time.monotonic() - start < 2.0
    assert isinstance(outcome[0], GenerationServerLost)
    assert client._pins[policy] == 0


def test_cut_or_malformed_answers_are_retried_then_the_server_is_lost(
    tiny, fake, tmp_path, monkeypatch
):
    """An answer cut short (the server died mid-answer: `IncompleteRead`, exit 70 on f41b8ed),
    a proxy's HTML page, JSON without token ids: each a failed try, retried, then one line
    naming the server (exit 2)."""
    folder, tokenizer = tiny
    monkeypatch.setattr("rlhf_cli.generation.server.time.sleep", lambda s: None)
    client = _client(_lora_policy(folder), tokenizer, _gen([fake.url], retries=2), tmp_path)
    query = _queries(tokenizer)[:1]
    fake.fail = [CUT, NOT_JSON]  # the third try answers
    assert client.generate(query, GEN, [1]).response_ids.shape[0] == 1
    fake.fail = [WRONG_SHAPE, NOT_JSON, CUT]
    with pytest.raises(GenerationServerLost) as lost:
        client.generate(query, GEN, [1])
    assert str(lost.value).startswith(
        f"the rollout server at {fake.url} failed /v1/completions 3 time(s) (the answer was "
        "cut short (IncompleteRead("
    )
    assert lost.value.exit_code == 2
    fake.fail = [WRONG_SHAPE] * 3
    with pytest.raises(GenerationServerLost, match="answer without token ids and log-probs"):
        client.generate(query, GEN, [1])


def test_a_model_list_that_is_no_json_is_one_line_naming_the_server(fake):
    fake.fail = [NOT_JSON]  # a proxy in front of a server that is down; TypeError on f41b8ed
    with pytest.raises(ModelLoadError) as refused:
        require_engine(_gen([fake.url]))
    assert str(refused.value).startswith(
        f"ppo.generation.server.urls: {fake.url} does not answer (an answer that is no model "
        "list: '<html>"
    )


def test_an_adapter_loaded_by_a_try_that_timed_out_is_taken_on_the_retry(tiny, fake, tmp_path):
    """The load takes longer than timeout_s but succeeds; the retry hears 400 "already
    loaded" (exit 2 on f41b8ed): the server lists that name from that folder, so the sync
    stands."""
    folder, tokenizer = tiny
    policy = _lora_policy(folder)
    client = _tighter(_client(policy, tokenizer, _gen([fake.url]), tmp_path), timeout_s=0.3)
    fake.late = [1.0]  # the load answers a second after it loaded
    version = client.sync(policy)
    loads = [b for p, b in fake.requests if p == "/v1/load_lora_adapter"][-2:]
    assert [b["lora_name"] for b in loads] == [version.adapter] * 2  # asked twice
    assert version.adapter in fake.adapters
    client.generate(_queries(tokenizer)[:1], GEN, [1], version)


def test_a_sync_that_fails_on_the_second_server_leaves_none_holding_the_adapter(tiny, tmp_path):
    folder, tokenizer = tiny
    servers = [FakeVLLM(folder, tokenizer), FakeVLLM(folder, tokenizer)]
    try:
        policy = _lora_policy(folder)
        client = _client(policy, tokenizer, _gen([s.url for s in servers]), tmp_path)
        before = client.latest
        servers[1].fail = [404]  # refused on the second server
        with pytest.raises(GenerationServerLost, match=f"{servers[1].url} refused"):
            client.sync(policy)
        assert [list(s.adapters) for s in servers] == [[before.adapter]] * 2
        uploads = sorted(p.name for p in (tmp_path / ".server-sync").glob("rlhf-*"))
        assert uploads == [before.name]  # the failed version's folder is gone
        assert client.latest == before
        client.generate(_queries(tokenizer), GEN, [1, 2, 3, 4], before)  # still answers
    finally:
        for s in servers:
            s.stop()


def test_start_up_cleanup_keeps_young_uploads_another_process_may_be_loading(tiny, fake, tmp_path):
    """Two trainers share a folder: the one starting removes the uploads no server holds that
    a stopped run left (older than STALE_AFTER_S), not the other's fresh adapter (f41b8ed
    removed every `rlhf-*` no server listed)."""
    folder, tokenizer = tiny
    shared = tmp_path / "shared"
    fresh, stale = shared / "rlhf-other-v1", shared / "rlhf-stopped-v7"
    for upload in (fresh, stale):
        upload.mkdir(parents=True)
        (upload / "adapter_config.json").write_text("{}")
    hours_ago = time.time() - 2 * 3600
    os.utime(stale, (hours_ago, hours_ago))
    _client(_model(folder), tokenizer, _gen([fake.url], shared_dir=str(shared)), tmp_path)
    assert fresh.is_dir() and not stale.exists()


def test_a_broadcast_that_never_returns_ends_at_the_timeout(tiny, fake, tmp_path, monkeypatch):
    """`weight_transfer: nccl` to a server whose workers died mid-broadcast: the NCCL group
    never returns (here a fake engine that blocks forever); the sync ends at server.timeout_s
    with the server lost (exit 2), where f41b8ed waited forever."""
    folder, tokenizer = tiny
    _fake_nccl_vllm(monkeypatch, fake)
    policy = _model(folder)
    gen = _gen([fake.url], sync="weights", weight_transfer="nccl")
    client = _tighter(_client(policy, tokenizer, gen, tmp_path), timeout_s=0.5)
    client._nccl[fake.url].send_weights = threading.Event().wait  # a group that never returns
    outcome: list[BaseException] = []

    def sync() -> None:
        try:
            client.sync(policy)
        except BaseException as exc:  # noqa: BLE001
            outcome.append(exc)

    thread = threading.Thread(target=sync, daemon=True)
    thread.start()
    thread.join(5.0)
    assert not thread.is_alive()
    assert isinstance(outcome[0], GenerationServerLost) and outcome[0].exit_code == 2
    assert str(outcome[0]) == (
        f"the NCCL weight transfer to {fake.url} did not finish within 0.5 s (server.timeout_s)"
    )
