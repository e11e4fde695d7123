"""The testbed's parts on their own: scenarios, ground truth, router, wire, KV, CLI."""

from __future__ import annotations

import math
import random
import socket
import threading
import time

import pytest

from pdwatch import contract as c
from pdwatch.testbed import cli, kv, scenarios
from pdwatch.testbed.processes import free_port
from pdwatch.testbed.router import LoadGenerator, RequestRecord, Router, Truth
from pdwatch.testbed.stack import Stack
from pdwatch.testbed.wire import Conn, LineServer, WireError, decode, encode


def test_unknown_scenario_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="decode-restart"):
        scenarios.get("no-such-thing")
    with pytest.raises(ValueError, match="already registered"):
        scenarios.register(scenarios.Scenario("healthy", "again"))


def test_long_decode_sizes_some_generations_at_four_decode_floors():
    params = scenarios.Params(decode_floor_s=30.0, token_interval_s=0.05)
    sc = scenarios.get("long-decode")
    rng = random.Random(1)
    outs = [sc.shape(params, rng, i)[1] for i in range(10)]
    assert outs[2] == outs[7] == math.ceil(4 * 30.0 / 0.05)
    assert all(8 <= n <= 32 for i, n in enumerate(outs) if i % 5 != 2)


def test_decode_restart_restarts_decode_0_alone_at_restart_at():
    params = scenarios.Params(restart_at=8.5)
    assert scenarios.get("decode-restart").actions(params) == [(8.5, "restart", "decode-0")]
    assert scenarios.get("healthy").actions(params) == []


def rec(i, decode, sent_at, done_at=None, outcome=None):
    return RequestRecord(index=i, room=i, trace_id=f"{i:032x}", decode=decode, prompt_tokens=1, max_tokens=1,
                         sent_at=sent_at, done_at=done_at, outcome=outcome)


def test_outstanding_after_restart_is_open_requests_to_the_restarted_decode_sent_after_it():
    truth = Truth(
        requests=[
            rec(0, "decode-0", 5.0),  # open, but sent before the restart
            rec(1, "decode-0", 10.0),  # open, after: hung
            rec(2, "decode-0", 11.0, 12.0, "ok"),  # done
            rec(3, "decode-1", 11.0),  # open on the other decode
            rec(4, "decode-0", 12.5),  # hung
        ],
        restarts=[{"instance": "decode-0", "t": 9.0}],
    )
    assert [r.index for r in truth.outstanding_after_restart()] == [1, 4]
    assert [r.index for r in truth.open] == [0, 1, 3, 4]
    assert [r.index for r in truth.completed] == [2]
    assert Truth(requests=truth.requests).outstanding_after_restart() == []


def test_router_derives_trace_ids_as_pdwatch_does_and_round_robins():
    dead = free_port()  # nothing listens: every request fails at once, which the record says
    for with_tp in (False, True):
        router = Router(dead, {"decode-0": dead, "decode-1": dead}, seed=4, traceparent=with_tp)
        records = [router.send(100, 8) for _ in range(4)]
        assert [r.decode for r in records] == ["decode-0", "decode-1", "decode-0", "decode-1"]
        for r in records:
            if with_tp:
                assert r.trace_id == r.traceparent.split("-")[1]
            else:
                assert r.traceparent is None and r.trace_id == f"{c.room_trace_id(r.room):032x}"
            assert 0 <= r.room < 2**63
        deadline = time.monotonic() + 5
        while router.truth().open and time.monotonic() < deadline:
            time.sleep(0.01)
        assert {(r.outcome, "unreachable" in (r.reason or "")) for r in router.truth().requests} == {("failed", True)}
        router.close()


def test_load_generator_is_bounded_in_count():
    sent = []

    class Recording:
        def send(self, prompt_tokens, max_tokens):
            sent.append((prompt_tokens, max_tokens))
            return sent[-1]

    gen = LoadGenerator(Recording(), lambda rng, i: (i, 1), rate=2000.0, seed=1, duration_s=None, max_requests=7)
    gen.start()
    deadline = time.monotonic() + 5
    while not gen.finished and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gen.finished and [p for p, _ in sent] == list(range(7))
    with pytest.raises(ValueError):
        LoadGenerator(Recording(), lambda rng, i: (1, 1), rate=0, seed=1, duration_s=None, max_requests=1)


def test_wire_round_trip_and_bounds():
    assert decode(encode({"a": 1, "b": [1, 2]})) == {"a": 1, "b": [1, 2]}
    with pytest.raises(WireError):
        decode(b"[1, 2]\n")
    with pytest.raises(WireError):
        decode(b"{not json\n")
    with pytest.raises(WireError):
        decode(b"x" * (2 << 20))

    got = []
    server = LineServer(0, lambda msg, conn: got.append(msg) or {"echo": msg["n"]})
    server.serve_in_thread("test-server")
    try:
        conn = Conn.connect(server.port)
        assert [conn.request({"n": i})["echo"] for i in range(3)] == [0, 1, 2]
        reader = threading.Thread(target=conn.recv)  # blocked in a read when close() comes
        reader.start()
        time.sleep(0.05)
        conn.close()
        reader.join(2)
        assert not reader.is_alive()
    finally:
        server.shutdown()
        server.server_close()
    assert [m["n"] for m in got] == [0, 1, 2]


def test_kv_pattern_is_deterministic_per_room():
    a = kv.kv_pattern(123, 4096)
    assert a.dtype.name == "uint8" and len(a) == 4096
    assert (a == kv.kv_pattern(123, 4096)).all()
    assert not (a == kv.kv_pattern(124, 4096)).all()


def test_stale_bootstrap_peer_keeps_naming_the_old_agent_of_a_restarted_decode():
    from pdwatch.testbed.prefill import BootstrapPeers

    prefill = kv.make_agent("t-prefill")
    old, new = kv.make_agent("t-decode-0-old"), kv.make_agent("t-decode-0-new")
    pools = [kv.SlotPool(agent, 2, 4096) for agent in (prefill, old, new)]
    peers = BootstrapPeers(prefill)

    def reg(agent, pool):
        return {"endpoint": "127.0.0.1:1234", "agent_name": agent.name, "agent_metadata": kv.metadata_b64(agent),
                "addr": pool.addr(0), "nbytes": pool.slot_bytes}

    assert peers.resolve(reg(old, pools[1])) == "t-decode-0-old"
    # The decode came back with a new agent on the same endpoint: the entry is not refreshed.
    assert peers.resolve(reg(new, pools[2])) == "t-decode-0-old"
    assert pools[0].alloc() == 0 and pools[0].free_count == 1


def test_a_decode_that_deregistered_is_learned_again_by_its_new_agent():
    from pdwatch.testbed.prefill import BootstrapPeers

    prefill = kv.make_agent("t2-prefill")
    old, new = kv.make_agent("t2-decode-0-old"), kv.make_agent("t2-decode-0-new")
    pools = [kv.SlotPool(agent, 2, 4096) for agent in (prefill, old, new)]
    peers = BootstrapPeers(prefill)

    def reg(agent, pool):
        return {"endpoint": "127.0.0.1:1235", "agent_name": agent.name, "agent_metadata": kv.metadata_b64(agent),
                "addr": pool.addr(0), "nbytes": pool.slot_bytes}

    assert peers.resolve(reg(old, pools[1])) == "t2-decode-0-old"
    peers.forget("127.0.0.1:9")  # another endpoint's leave changes nothing here
    assert peers.resolve(reg(new, pools[2])) == "t2-decode-0-old"
    peers.forget("127.0.0.1:1235")  # its clean exit
    assert peers.resolve(reg(new, pools[2])) == "t2-decode-0-new"


def test_router_adds_and_removes_decodes_and_removes_an_idle_one_only_when_nothing_went_to_it_since():
    dead = free_port()
    router = Router(dead, {"decode-0": dead, "decode-1": dead}, seed=4)
    try:
        assert router.routed == ["decode-0", "decode-1"]
        assert router.remove("decode-0") and not router.remove("decode-0")
        assert [router.send(10, 1).decode for _ in range(2)] == ["decode-1", "decode-1"]
        router.add("decode-2", dead)
        assert router.routed == ["decode-1", "decode-2"]
        assert {router.send(10, 1).decode for _ in range(2)} == {"decode-1", "decode-2"}
        deadline = time.monotonic() + 5
        while router.truth().open and time.monotonic() < deadline:  # each fails at once: nothing listens
            time.sleep(0.01)
        assert router.open_on("decode-2") == 0
        killed = []
        since = time.time()
        router.send(10, 1)  # the round robin's next is decode-1, sent after `since`
        assert not router.remove("decode-1", if_idle_since=since, then=lambda: killed.append("decode-1"))
        assert router.remove("decode-2", if_idle_since=since, then=lambda: killed.append("decode-2"))
        assert killed == ["decode-2"] and router.routed == ["decode-1"]
        assert router.remove("decode-1")
        assert router.send(10, 1) is None and router.rejected == 1  # no decode left to route to
    finally:
        router.close()


def test_load_generator_changes_rate_and_pauses():
    sent = []

    class Recording:
        def send(self, prompt_tokens, max_tokens):
            sent.append(time.monotonic())
            return sent[-1]

    gen = LoadGenerator(Recording(), lambda rng, i: (1, 1), rate=1000.0, seed=1, duration_s=None, max_requests=10_000)
    gen.pause(0.5)
    t0 = time.monotonic()
    gen.start()
    try:
        deadline = time.monotonic() + 5
        while not sent and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sent and sent[0] - t0 >= 0.45  # nothing during the pause
        gen.set_rate(0.001)  # from the next arrival on: about none
        time.sleep(0.2)
        n = len(sent)
        time.sleep(0.3)
        assert len(sent) <= n + 1
        with pytest.raises(ValueError):
            gen.set_rate(0)
    finally:
        gen.stop()


def test_ordinary_scenarios_are_tagged_and_size_the_request_bound_for_their_peak():
    assert scenarios.ordinary() == ["scale-down", "scale-up", "rolling-restart", "kill-idle", "overload", "idle"]
    assert all(scenarios.get(n).family is None for n in scenarios.ordinary())
    base = Stack("healthy", rate=2.0, duration_s=100.0)
    peak = Stack("overload", rate=2.0, duration_s=100.0, tuning={"overload_factor": 4.0, "overload_s": 30.0})
    assert peak.params.overload_factor == 4.0 and peak.params.overload_s == 30.0
    assert peak.max_requests - 10 == 4 * (base.max_requests - 10)
    with pytest.raises(TypeError):
        Stack("idle", tuning={"no_such_knob": 1.0})


@pytest.mark.parametrize("kwargs, message", [
    ({"rate": 0}, "rate"),
    ({"heartbeat_s": -1}, "heartbeat_s"),
    ({"otlp_endpoint": "http://10.0.0.1:4318"}, "loopback"),
    ({"restart_at": -1}, "restart_at"),
    ({"duration_s": 0}, "duration_s"),
])
def test_stack_refuses_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Stack("healthy", **kwargs)


def test_cli_help_lists_the_scenarios(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--otlp-endpoint" in out and "decode-restart" in out and "long-decode" in out
    assert cli.main(["--list"]) == 0
    header, *rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert header == ["SCENARIO", "EMULATED", "SGLANG", "VLLM"]
    table = {words[0]: dict(zip(("emulated", "sglang", "vllm"), words[1:])) for words in rows}
    assert {name for name, per in table.items() if per["emulated"] == "ordinary"} == set(scenarios.ordinary())
    # One name, one fault; what it gives differs by engine where the engines differ, and says so.
    assert table["decode-restart"] == {"emulated": "transfer_wedge", "sglang": "none-stuck", "vllm": "none-stuck"}
    assert table["transfer-wedge"]["vllm"] == "transfer_wedge" and table["tp-desync"]["vllm"] == "-"
    assert table["lease-expiry"] == {"emulated": "-", "sglang": "-", "vllm": "none-stuck"}
    with pytest.raises(SystemExit) as e:
        cli.main(["--scenario", "nope"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:  # a scenario of another engine only
        cli.main(["--engine", "vllm", "--scenario", "tp-desync"])
    assert e.value.code == 2 and "does not exist for --engine vllm" in capsys.readouterr().err
    assert cli.main(["--rate", "0"]) == 2


def test_every_engine_in_the_registry_launches_a_stack_with_its_own_catalogue():
    from pdwatch.testbed import engines
    from pdwatch.testbed.scenarios import Params
    from pdwatch.testbed.stack_base import StackBase

    assert list(engines.ENGINES) == ["emulated", "sglang", "vllm"]
    for engine in engines.ENGINES.values():
        kind = engine.launcher()
        assert issubclass(kind, StackBase) and kind.catalogue is engine.catalogue, engine.name
        assert engine.scenario(engine.incident) is not None and engine.scenario(engine.incident).expects_stuck
        for name, sc in engine.catalogue.by_name.items():
            for _at, action, _instance in sc.actions(Params()):  # every action a scenario takes, the stack has
                assert hasattr(kind, f"_action_{action.replace('-', '_')}"), (engine.name, name, action)
    with pytest.raises(ValueError, match="unknown engine"):
        engines.get("trtllm")


@pytest.mark.parametrize("room", [None, "12", -1, 1 << 63, True, 1.5])
def test_a_bad_room_is_refused(room):
    from pdwatch.testbed.wire import room_of

    with pytest.raises(WireError, match="room"):
        room_of({"room": room})
    assert room_of({"room": (1 << 63) - 1}) == (1 << 63) - 1


def test_free_ports_lie_below_the_ephemeral_range_and_are_handed_out_once():
    from pdwatch.testbed.processes import _ephemeral_low

    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(1024 < p < _ephemeral_low() for p in ports), ports
    for p in ports[:5]:  # each was bindable when picked
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", p))


def test_the_demo_runs_each_engines_incident_and_refuses_a_scenario_the_engine_lacks(capsys):
    from pdwatch import demo

    helptext = demo.build_parser().format_help()
    assert "vllm" in helptext and "transfer-wedge vllm" in helptext
    with pytest.raises(SystemExit) as e:
        demo.main(["--engine", "vllm", "--scenario", "tp-desync"])
    assert e.value.code == 2 and "does not exist for --engine vllm" in capsys.readouterr().err


def test_an_open_pause_holds_arrivals_until_resume_and_the_load_is_not_done_meanwhile():
    """The live stacks' idle spells: paused with no end, resumed by the scenario's next step."""
    sent = []

    class Recording:
        def send(self, prompt_tokens, max_tokens):
            sent.append(time.monotonic())
            return sent[-1]

    gen = LoadGenerator(Recording(), lambda rng, i: (1, 1), rate=1000.0, seed=1, duration_s=30.0, max_requests=50)
    gen.start()
    try:
        deadline = time.monotonic() + 5
        while not sent and time.monotonic() < deadline:
            time.sleep(0.01)
        gen.pause()
        time.sleep(0.2)  # an arrival already on its way may still land
        held = len(sent)
        time.sleep(0.5)
        assert len(sent) == held and not gen.finished  # paused, not ended: the CLI must not stop here
        resumed = time.monotonic()
        gen.resume()
        while not gen.finished and time.monotonic() < deadline + 5:
            time.sleep(0.01)
        assert gen.finished and len(sent) == 50 and sent[held] >= resumed
    finally:
        gen.stop()
