"""What distinguishes the stuck legs: the pure contrast, and the judge's, over real recorders' legs."""

from __future__ import annotations

import random

from pdwatch.sidecar.contrast import LegFacts, contrast
from tests.support.tracking import evaluate


def leg(instance="prefill-0", role="prefill", peer="agent-d1", owner="decode-1", ended=False, prompt=100,
        arrived=1000.0, error=False) -> LegFacts:
    return LegFacts(role=role, pd_instance=instance, peer=peer, peer_owner=owner, peer_ended=ended,
                    prompt_tokens=prompt, arrived_s=arrived, error=error)


def best(items):
    return (items[0].attribute, items[0].value) if items else None


def test_the_seed_incident_separates_on_the_ended_peer_process():
    stuck = [leg(peer="agent-d0-old", owner="decode-0", ended=True, arrived=1000.0 + i) for i in range(22)]
    flowing = [leg(peer="agent-d1", owner="decode-1", arrived=1000.0 + i) for i in range(150)] + \
              [leg(peer="agent-d0-new", owner="decode-0", arrived=1100.0 + i) for i in range(14)]
    items = contrast(stuck, flowing, {"decode-0": 1050.0})
    top = {(x.attribute, x.value): x for x in items}
    process = top[("peer_process", "ended")]
    assert (process.stuck, process.flowing) == (1.0, 0.0)
    assert process.sentence.startswith("22 of 22 stuck legs talk to a process of decode-0 that has since ended")
    assert process.sentence.endswith("0 of 164 flowing legs do")
    assert items[0].separation == 1.0


def test_a_fault_of_long_prompts_separates_on_the_prompt_length():
    rng = random.Random(3)
    stuck = [leg(prompt=rng.randint(3000, 6000)) for _ in range(12)]
    flowing = [leg(prompt=rng.randint(8, 2900)) for _ in range(200)]
    items = contrast(stuck, flowing)
    assert best(items)[0] == "prompt_tokens" and best(items)[1].startswith(">= ")
    cut = int(best(items)[1][3:])
    assert 2900 < cut <= min(x.prompt_tokens for x in stuck) and items[0].separation == 1.0
    assert [x.attribute for x in items].count("prompt_tokens") == 1  # the best cut, not twenty


def test_a_fault_of_one_decode_instance_names_it():
    # Both legs of each stuck request: decode-0's own, and the prefill's written to decode-0's agent.
    stuck = [leg(instance="decode-0", role="decode", peer="127.0.0.1:8998", owner="prefill-0") for _ in range(9)]
    stuck += [leg(instance="prefill-0", peer="agent-d0", owner="decode-0") for _ in range(9)]
    # Since the fault only decode-1's requests finish; two of decode-0's did just before it.
    flowing = [leg(instance="decode-1", role="decode", peer="127.0.0.1:8998", owner="prefill-0") for _ in range(40)]
    flowing += [leg(instance="prefill-0", peer="agent-d1", owner="decode-1") for _ in range(40)]
    flowing += [leg(instance="decode-0", role="decode", peer="127.0.0.1:8998", owner="prefill-0"),
                leg(instance="prefill-0", peer="agent-d0", owner="decode-0")]
    items = contrast(stuck, flowing)
    assert best(items) == ("involves", "decode-0"), [(x.attribute, x.value, x.separation) for x in items]
    assert items[0].sentence == "18 of 18 stuck legs are on decode-0 or talk to it; 2 of 82 flowing legs do"


def test_legs_no_peer_ever_joined_separate_on_having_none():
    # SGLang 0.5.23 after a lone decode restart: the router sent the decode half of some requests to the
    # dead decode; their prefill legs wait in bootstrap with no peer, and no engine knows where they went.
    stuck = [leg(peer=None, owner=None, arrived=1000.0 + i) for i in range(8)]
    flowing = [leg(peer=f"agent-d{i % 2}", owner=f"decode-{i % 2}", arrived=990.0 + i) for i in range(60)]
    flowing += [leg(instance=f"decode-{i % 2}", role="decode", peer="127.0.0.1:8998", owner="prefill-0")
                for i in range(60)]
    items = contrast(stuck, flowing, {"decode-0": 1004.0})
    assert best(items) == ("peer", "none"), [(x.attribute, x.value, x.separation) for x in items]
    assert (items[0].stuck, items[0].flowing) == (1.0, 0.0)
    assert items[0].sentence == "8 of 8 stuck legs have no KV peer: no other side ever joined them; 0 of 120 flowing legs do"


def test_scattered_stuck_legs_with_no_common_cause_name_nothing():
    rng = random.Random(7)

    def anyone():
        i = rng.randrange(2)
        return leg(instance=rng.choice(["prefill-0", f"decode-{i}"]), peer=f"agent-d{i}", owner=f"decode-{i}",
                   prompt=rng.randint(8, 4000), arrived=1000.0 + rng.random() * 60)

    assert contrast([anyone() for _ in range(15)], [anyone() for _ in range(300)], {"decode-1": 1030.0}) == []


def test_no_flow_no_contrast():
    assert contrast([leg()], []) == []


def test_the_judge_contrasts_stuck_legs_with_those_that_flowed(tracker, engines, clock):
    p = engines("prefill", "prefill-0")
    d0 = engines("decode", "decode-0", peer_ids=("agent-d0-old",))
    d1 = engines("decode", "decode-1", peer_ids=("agent-d1",))
    for i in range(12):  # flowing before the restart, to both decodes
        rid = f"p-ok-{i}"
        p.walk(rid, 100 + i, ("bootstrap", "queued", "prefill", "transfer"), peer=f"agent-d{i % 2}" if i % 2
               else "agent-d0-old", prompt_tokens=64)
        p.rec.finish(rid)
    for i in range(4):  # wedged: written to decode-0's old agent
        p.walk(f"p-{i}", i, ("bootstrap", "queued", "prefill", "transfer"), peer="agent-d0-old", prompt_tokens=64)
    for e in (p, d0, d1):
        e.send(tracker)
    clock.advance(1)
    engines("decode", "decode-0", peer_ids=("agent-d0-new",)).send(tracker)  # restarted alone
    for i in range(12):  # flowing after it, through decode-1 and the new decode-0
        rid = f"p-new-{i}"
        p.walk(rid, 200 + i, ("bootstrap", "queued", "prefill", "transfer"),
               peer="agent-d1" if i % 2 else "agent-d0-new", prompt_tokens=64)
        p.rec.finish(rid)
    clock.advance(1.2)
    p.send(tracker)
    d1.send(tracker)
    (verdict,) = evaluate(tracker).diagnosis
    top = verdict["contrast"][0]
    assert (top["attribute"], top["value"], top["stuck"]) == ("peer_process", "ended", 1.0), verdict["contrast"]
    assert top["flowing"] == 0.0 and top["stuck_legs"] == [4, 4]
