"""ServerMetrics without a model: registries apart, HTTP counting, label bounds."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from kvserve.server.metrics import REJECTION_REASONS, ServerMetrics

MODEL = SimpleNamespace(name="m", engine=None)
"""A served model that is not loaded: its gauges read 0."""

M = (("model_name", "m"),)


def _served(metrics: ServerMetrics, model=MODEL):
    observer = metrics.for_model(model)
    observer.export()
    return observer


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
    metrics = ServerMetrics()
    _served(metrics)
    samples = _samples(metrics)
    for reason in REJECTION_REASONS:
        labels = (*M, ("reason", reason))
        assert samples[("kvserve:request_rejections_total", labels)] == 0


def test_each_model_has_its_own_series():
    metrics = ServerMetrics()
    first = _served(metrics)
    second = _served(metrics, SimpleNamespace(name="other", engine=None))
    first.on_rejected("queue_full")
    first.on_rejected("queue_full")
    second.on_rejected("queue_full")
    metrics.observe_http("/v1/chat/completions", 499, model_name="other")
    samples = _samples(metrics)
    key = "kvserve:request_rejections_total"
    assert samples[(key, (*M, ("reason", "queue_full")))] == 2
    assert samples[(key, (("model_name", "other"), ("reason", "queue_full")))] == 1
    assert samples[(key, (("model_name", "other"), ("reason", "client_gone")))] == 1
    assert samples[(key, (*M, ("reason", "client_gone")))] == 0
    assert samples[("kvserve:num_requests_running", (("model_name", "other"),))] == 0


def test_499_is_counted_as_client_gone_never_as_server_error():
    metrics = ServerMetrics()
    _served(metrics)
    metrics.observe_http("/v1/chat/completions", 499, model_name="m")
    # a slow consumer
    metrics.observe_http("/v1/chat/completions", 499, client_gone=False, model_name="m")
    metrics.observe_http("/v1/chat/completions", 500, model_name="m")
    samples = _samples(metrics)
    assert samples[("kvserve:request_rejections_total", (*M, ("reason", "client_gone")))] == 1
    assert (
        samples[("kvserve:http_server_errors_total", (("endpoint", "/v1/chat/completions"),))] == 1
    )


def test_gauges_read_zero_without_an_engine():
    metrics = ServerMetrics()
    _served(metrics)
    samples = _samples(metrics)
    assert samples[("kvserve:num_requests_running", M)] == 0
    assert samples[("kvserve:kv_cache_usage_perc", M)] == 0


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
    observer = _served(metrics)
    assert _samples(metrics)[("kvserve:num_preemptions_total", M)] == 0
    observer.on_preempted(None, 2)  # an n = 2 request, preempted together
    observer.on_preempted(None, 1)
    assert _samples(metrics)[("kvserve:num_preemptions_total", M)] == 3


def test_blocks_given_back_behind_windows_are_counted_after_each_step():
    metrics = ServerMetrics()
    model = SimpleNamespace(name="m", engine=None)
    observer = _served(metrics, model)
    key = ("kvserve:kv_window_blocks_freed_total", M)
    assert _samples(metrics)[key] == 0
    model.engine = SimpleNamespace(scheduler=None, kv=SimpleNamespace(num_window_freed=0))
    observer.bind(model.engine)
    for freed in (5, 5, 7):
        model.engine.kv.num_window_freed = freed
        observer.on_step(None, 0.01)
    assert _samples(metrics)[key] == 7
    # The model loaded again: a new engine counts from 0.
    model.engine = SimpleNamespace(scheduler=None, kv=SimpleNamespace(num_window_freed=2))
    observer.bind(model.engine)
    observer.on_step(None, 0.01)
    assert _samples(metrics)[key] == 9


def test_speculation_is_counted_under_vllms_names():
    metrics = ServerMetrics()
    observer = _served(metrics)
    assert _samples(metrics)[("kvserve:spec_decode_num_drafts_total", M)] == 0
    observer.on_speculated(None, 4, 2, "req-0")
    observer.on_speculated(None, 3, 0, "req-0")
    observer.on_speculated(None, 2, 2, "req-0")
    samples = _samples(metrics)
    assert samples[("kvserve:spec_decode_num_drafts_total", M)] == 3
    assert samples[("kvserve:spec_decode_num_draft_tokens_total", M)] == 9
    assert samples[("kvserve:spec_decode_num_accepted_tokens_total", M)] == 4
    per_pos = {
        dict(labels)["position"]: value
        for (name, labels), value in samples.items()
        if name == "kvserve:spec_decode_num_accepted_tokens_per_pos_total"
    }
    assert per_pos == {"0": 2, "1": 2}
