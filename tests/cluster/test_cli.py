"""`kvserve cluster`'s flags: every `kvserve serve` flag plus the cluster's, turned into the
application's settings (no Ray started)."""

from __future__ import annotations

import pytest

from kvserve.cli import build_parser
from kvserve.cluster.cli import cluster_settings


def _parse(*argv: str):
    return build_parser(["cluster", *argv]).parse_args(["cluster", *argv])


def test_serve_flags_pass_through_to_every_replica():
    args = _parse("--replicas", "3", "--max-num-seqs", "4", "--block-size", "16", "--port", "9")
    settings = cluster_settings(args)
    assert settings["replicas"] == 3
    assert settings["port"] == 9
    assert settings["serve_args"]["max_num_seqs"] == 4
    assert settings["serve_args"]["block_size"] == 16
    # Threads follow the CPUs Ray reserves for a replica unless given.
    assert settings["serve_args"]["threads"] == 1
    assert cluster_settings(_parse("--cpus-per-replica", "4"))["serve_args"]["threads"] == 4
    assert cluster_settings(_parse("--threads", "2"))["serve_args"]["threads"] == 2


def test_the_settings_build_the_application_and_unknown_ones_are_refused():
    from kvserve.cluster.deployments import build_app
    from kvserve.cluster.serving import serve_namespace

    settings = cluster_settings(_parse("--gpus-per-replica", "1", "--device", "cuda"))
    assert build_app(settings) is not None
    assert serve_namespace(settings["serve_args"]).device == "cuda"
    with pytest.raises(ValueError, match="replicass"):
        build_app({"replicass": 2})
    with pytest.raises(ValueError, match="max_num_seq"):
        serve_namespace({"max_num_seq": 2})


def test_the_address_comes_from_ray_address(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    assert _parse().address == "ray://head:10001"
    assert _parse("--address", "auto").address == "auto"
