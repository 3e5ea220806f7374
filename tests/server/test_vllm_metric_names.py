"""``--vllm-metric-names``: the metrics vLLM also has, a second time under vLLM's names and
``model_name`` label, equal to ours, so an operator's vLLM dashboards read this server; a
server without the flag has no ``vllm:`` series."""

from __future__ import annotations

from helpers.http_calls import metric_samples, post
from helpers.server_process import SERVED_MODEL_NAME


def test_vllm_names_repeat_our_series(start_server):
    server = start_server(
        "--http-port", "0", "--served-model-name", SERVED_MODEL_NAME, "--vllm-metric-names",
        "--kv-cache-bytes", str(4 << 20),
    )  # fmt: skip
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True}
    for _ in range(2):
        assert post(server, "/v1/completions", body)[0] == 200
    got = metric_samples(server)
    model = (("model_name", SERVED_MODEL_NAME),)

    def ours_and_vllms(ours: str, vllms: str, labels: tuple = ()) -> tuple[float, float]:
        return got[(ours, labels)], got[(vllms, tuple(sorted(labels + model)))]

    for ours, vllms in [
        ("pagedserve_prompt_tokens_total", "vllm:prompt_tokens_total"),
        ("pagedserve_generation_tokens_total", "vllm:generation_tokens_total"),
        ("pagedserve_request_duration_seconds_count", "vllm:e2e_request_latency_seconds_count"),
        ("pagedserve_time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_sum"),
        ("pagedserve_request_queue_time_seconds_count", "vllm:request_queue_time_seconds_count"),
        ("pagedserve_engine_num_running", "vllm:num_requests_running"),
        ("pagedserve_engine_num_waiting", "vllm:num_requests_waiting"),
        ("pagedserve_engine_prefix_cache_queries_total", "vllm:prefix_cache_queries_total"),
        ("pagedserve_engine_kv_cache_usage", "vllm:kv_cache_usage_perc"),
        ("pagedserve_engine_kv_cache_usage", "vllm:gpu_cache_usage_perc"),
    ]:
        assert ours_and_vllms(ours, vllms)[0] == ours_and_vllms(ours, vllms)[1], vllms
    assert got[("vllm:generation_tokens_total", model)] == 8
    assert got[("vllm:prompt_tokens_total", model)] == 6
    # vLLM's label for the finish reason.
    success = ("vllm:request_success_total", tuple(sorted((("finished_reason", "length"),
                                                           *model))))  # fmt: skip
    assert got[success] == 2
    assert got[("vllm:e2e_request_latency_seconds_count", model)] == 2
    server.assert_blocks_all_free()


def test_without_the_flag_there_are_no_vllm_series(start_server):
    server = start_server("--http-port", "0", "--kv-cache-bytes", str(4 << 20))
    assert not [name for name, _ in metric_samples(server) if name.startswith("vllm:")]
