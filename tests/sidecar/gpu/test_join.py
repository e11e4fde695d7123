"""Joining devices read through the real nvidia-ml-py to the instances that own them."""

from __future__ import annotations

import pytest

from pdwatch.sidecar.gpu.join import InstanceClaim, Owner, join, parse_gpu_map

from .conftest import UUIDS

DECODE0 = Owner("default", "decode", "decode-0")
DECODE1 = Owner("default", "decode", "decode-1")
PREFILL0 = Owner("default", "prefill", "prefill-0")


@pytest.fixture
def devices(gpus, make_sampler):
    gpus.set(1, pids=[5001])  # an engine process running on GPU 1
    gpus.set(2, pids=[6001])
    sampler = make_sampler()
    sampler.sample_once()
    snap = sampler.snapshot()
    assert snap.up and len(snap.devices) == 3
    return snap.devices


def owners(joined):
    return [(dev.index, owner, how) for dev, owner, how in joined]


def test_uuid_join_from_heartbeat_uuids(devices):
    claims = [InstanceClaim(DECODE0, (UUIDS[0],), ()), InstanceClaim(PREFILL0, (UUIDS[2],), ())]
    assert owners(join(devices, claims, {})) == [
        (0, DECODE0, "uuid"),
        (1, None, "none"),
        (2, PREFILL0, "uuid"),
    ]


def test_uuid_join_accepts_torch_style_uuids(devices):
    # torch reports a device UUID without NVML's "GPU-" prefix.
    bare = UUIDS[0][len("GPU-"):].upper()
    assert owners(join(devices, [InstanceClaim(DECODE0, (bare,), ())], {}))[0] == (0, DECODE0, "uuid")


def test_pid_join_from_nvml_processes(devices):
    claims = [InstanceClaim(DECODE1, (), (5001,)), InstanceClaim(PREFILL0, (), (999,))]
    assert owners(join(devices, claims, {})) == [
        (0, None, "none"),
        (1, DECODE1, "pid"),
        (2, None, "none"),
    ]


def test_config_join_by_index_and_uuid(devices):
    configured = parse_gpu_map(f"0=decode/decode-0, {UUIDS[2]}=default/prefill/prefill-0")
    assert owners(join(devices, [], configured)) == [
        (0, DECODE0, "config"),
        (1, None, "none"),
        (2, PREFILL0, "config"),
    ]


def test_uuid_beats_pid_beats_config(devices):
    claims = [InstanceClaim(DECODE0, (UUIDS[1],), ()), InstanceClaim(DECODE1, (), (5001, 6001))]
    configured = parse_gpu_map("0=prefill/prefill-0,1=prefill/prefill-0,2=prefill/prefill-0")
    assert owners(join(devices, claims, configured)) == [
        (0, PREFILL0, "config"),
        (1, DECODE0, "uuid"),
        (2, DECODE1, "pid"),
    ]


def test_first_claim_wins_a_contested_device(devices):
    claims = [InstanceClaim(DECODE1, (UUIDS[0],), ()), InstanceClaim(DECODE0, (UUIDS[0],), ())]
    assert owners(join(devices, claims, {}))[0] == (0, DECODE1, "uuid")


def test_parse_gpu_map_forms():
    assert parse_gpu_map("") == {}
    assert parse_gpu_map(" 00 = prod/decode/decode-7 ,") == {"0": Owner("prod", "decode", "decode-7")}
    assert parse_gpu_map("GPU-abc=unified/u-0") == {"GPU-abc": Owner("default", "unified", "u-0")}


@pytest.mark.parametrize(
    "text, message",
    [
        ("0", "expected DEVICE="),
        ("0=", "expected DEVICE="),
        ("gpu0=decode/d", "must be an index"),
        ("0=decode", "owner must be"),
        ("0=a/b/c/d", "owner must be"),
        ("0=c//d", "owner must be"),
        ("0=router/r-0", "role must be one of"),
        ("0=decode/d,00=decode/e", "twice"),
        ("GPU-ABC=decode/d,gpu-abc=decode/e", "twice"),
    ],
)
def test_parse_gpu_map_refuses_bad_input(text, message):
    with pytest.raises(ValueError, match=message):
        parse_gpu_map(text)
