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


def test_several_models_get_a_deployment_each_with_its_own_count():
    from kvserve.cluster.deployments import REPLICA, build_app

    args = _parse("first.gguf", "second.gguf", "--replicas", "3,1", "--max-num-seqs", "4")
    settings = cluster_settings(args)
    assert settings["replicas"] == [3, 1]
    assert settings["serve_args"]["models"] == ["first.gguf", "second.gguf"]
    ingress = build_app(settings)._bound_deployment
    groups = [app._bound_deployment for app in ingress.init_args[0]]
    assert [(g.name, g.num_replicas) for g in groups] == [(REPLICA, 3), (f"{REPLICA}_1", 1)]
    # Each replica serves its one model, with every other setting as given.
    assert [(g.init_args[0]["model"], g.init_args[0]["models"]) for g in groups] == [
        ("first.gguf", ["first.gguf"]),
        ("second.gguf", ["second.gguf"]),
    ]
    assert {g.init_args[0]["max_num_seqs"] for g in groups} == {4}
    assert ingress.init_args[1]["models"] == ["first.gguf", "second.gguf"]
    # One count is every model's.
    two = build_app(cluster_settings(_parse("a.gguf", "b.gguf", "--replicas", "2")))
    assert [app._bound_deployment.num_replicas for app in two._bound_deployment.init_args[0]] == [
        2,
        2,
    ]


def test_replica_counts_and_served_names_are_checked(tmp_path):
    from kvserve.cluster.cli import replica_counts, served_names
    from kvserve.model.paths import DEFAULT_MODEL_NAME, default_model_path

    assert replica_counts(2, 3) == [2, 2, 2]
    assert replica_counts([2, 1], 2) == [2, 1]
    assert replica_counts("2,1", 2) == [2, 1]
    with pytest.raises(ValueError, match="3 counts for 2 models"):
        replica_counts([1, 1, 1], 2)
    with pytest.raises(ValueError, match="at least 1"):
        replica_counts([1, 0], 2)
    with pytest.raises(SystemExit):
        _parse("--replicas", "two")
    other = tmp_path / "other.gguf"
    other.write_bytes(b"")  # named by its stem; not read
    assert served_names([None, str(other)]) == [DEFAULT_MODEL_NAME, "other"]
    assert served_names([None], "mine") == ["mine"]
    with pytest.raises(ValueError, match="served as 'SmolLM2-135M-Instruct'"):
        served_names([None, str(default_model_path())])
    with pytest.raises(ValueError, match="names one model"):
        served_names([None, str(other)], "mine")


def test_the_command_refuses_what_it_cannot_deploy_before_starting_ray(tmp_path, capsys):
    from kvserve.cluster.cli import run

    other = tmp_path / "other.gguf"
    other.write_bytes(b"")
    assert run(_parse(str(other), "--replicas", "1,1")) == 2
    assert "2 counts for 1 model:" in capsys.readouterr().err
    assert run(_parse("default", str(other), "--served-model-name", "x")) == 2
    assert "names one model" in capsys.readouterr().err
