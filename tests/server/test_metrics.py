"""ServerMetrics without a model: registries apart, HTTP counting, label bounds."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from kvserve.server.metrics import REJECTION_REASONS, ServerMetrics


def _samples(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    text, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text.decode())
        for sample in family.samples
    }


def test_two_servers_in_one_process_do_not_collide():
    first, second = ServerMetrics(), ServerMetrics()
    first.observe_http("/v1/completions", 200)
    key = ("kvserve:http_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))
    assert _samples(first)[key] == 1
    assert key not in _samples(second)


def test_every_rejection_reason_is_exported_from_the_start():
    samples = _samples(ServerMetrics())
    for reason in REJECTION_REASONS:
        assert samples[("kvserve:request_rejections_total", (("reason", reason),))] == 0


def test_499_is_counted_as_client_gone_never_as_server_error():
    metrics = ServerMetrics()
    metrics.observe_http("/v1/chat/completions", 499)
    metrics.observe_http("/v1/chat/completions", 499, client_gone=False)  # a slow consumer
    metrics.observe_http("/v1/chat/completions", 500)
    samples = _samples(metrics)
    assert samples[("kvserve:request_rejections_total", (("reason", "client_gone"),))] == 1
    assert (
        samples[("kvserve:http_server_errors_total", (("endpoint", "/v1/chat/completions"),))] == 1
    )


def test_gauges_read_zero_without_an_engine():
    samples = _samples(ServerMetrics())
    assert samples[("kvserve:num_requests_running", ())] == 0
    assert samples[("kvserve:kv_cache_usage_perc", ())] == 0


def test_ignored_field_labels_are_bounded():
    metrics = ServerMetrics()
    metrics.observe_ignored_fields(f"field{i}" for i in range(500))
    metrics.observe_ignored_fields(["field1"])
    fields = {
        dict(labels)["field"]: value
        for (name, labels), value in _samples(metrics).items()
        if name == "kvserve:ignored_fields_total"
    }
    assert len(fields) <= 65
    assert fields["field1"] == 2
    assert fields["_other"] == 500 - 64


def test_preemptions_are_counted_per_sequence_from_zero():
    metrics = ServerMetrics()
    assert _samples(metrics)[("kvserve:num_preemptions_total", ())] == 0
    metrics.on_preempted(None, 2)  # an n = 2 request, preempted together
    metrics.on_preempted(None, 1)
    assert _samples(metrics)[("kvserve:num_preemptions_total", ())] == 3


def test_blocks_given_back_behind_windows_are_counted_after_each_step():
    metrics = ServerMetrics()
    key = ("kvserve:kv_window_blocks_freed_total", ())
    assert _samples(metrics)[key] == 0
    engine = SimpleNamespace(scheduler=None, kv=SimpleNamespace(num_window_freed=0))
    metrics.bind(engine)
    for freed in (5, 5, 7):
        engine.kv.num_window_freed = freed
        metrics.on_step(None, 0.01)
    assert _samples(metrics)[key] == 7
    metrics.bind(SimpleNamespace(scheduler=None, kv=SimpleNamespace(num_window_freed=2)))
    metrics.on_step(None, 0.01)
    assert _samples(metrics)[key] == 9


def test_speculation_is_counted_under_vllms_names():
    metrics = ServerMetrics()
    assert _samples(metrics)[("kvserve:spec_decode_num_drafts_total", ())] == 0
    metrics.on_speculated(None, 4, 2)
    metrics.on_speculated(None, 3, 0)
    metrics.on_speculated(None, 2, 2)
    samples = _samples(metrics)
    assert samples[("kvserve:spec_decode_num_drafts_total", ())] == 3
    assert samples[("kvserve:spec_decode_num_draft_tokens_total", ())] == 9
    assert samples[("kvserve:spec_decode_num_accepted_tokens_total", ())] == 4
    per_pos = {
        dict(labels)["position"]: value
        for (name, labels), value in samples.items()
        if name == "kvserve:spec_decode_num_accepted_tokens_per_pos_total"
    }
    assert per_pos == {"0": 2, "1": 2}
