"""01b sized to the server, the parts without a server: the capacity documents of SGLang
and vLLM, the in-flight limit (AIMD), and the streamed pieces joined back into a non-streamed answer.
The loopback proof against a queueing server is in test_01b_faults.py."""
import asyncio
import json

import pytest

from common.generation.capacity import (InFlightLimit, capacity_line, runs_at_once, sglang_capacity,
                                        vllm_capacity)
from common.generation.server_pool import RequestFailed, Streamed


def test_sglang_and_vllm_capacity_documents():
    # SGLang 0.5.x /server_info: server args + scheduler info (rank 0's pool) + one state per DP rank.
    two_ranks = {"max_running_requests": None, "dp_size": 2, "max_total_num_tokens": 200_000,
                 "internal_states": [{"effective_max_running_requests_per_dp": 64}] * 2}
    assert sglang_capacity(two_ranks) == {"engine": "sglang", "max_running_requests": 128,
                                          "max_total_num_tokens": 400_000}
    older = {"max_running_requests": 48, "max_total_num_tokens": 180_000, "internal_states": [{}]}
    assert sglang_capacity(older)["max_running_requests"] == 48
    assert sglang_capacity({"vllm_config": "..."}) is None  # vLLM's dev-mode /server_info is not SGLang's
    metrics = "\n".join([
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
        'vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="1000"} 1.0',
        'vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="1",num_gpu_blocks="500"} 1.0',
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0'])
    assert vllm_capacity(metrics) == {"engine": "vllm", "max_running_requests": None, "max_total_num_tokens": 24_000}
    assert vllm_capacity('vllm:num_requests_running{engine="0"} 3.0') is None


def test_how_much_runs_at_once():
    cap = {"engine": "sglang", "source": "/server_info", "max_running_requests": 48, "max_total_num_tokens": 200_000}
    assert runs_at_once(cap, 160, 10_000) == 20        # the KV pool binds: 200K / 10K-token requests
    assert runs_at_once(cap, 160, 1_000) == 48         # the running limit binds
    assert runs_at_once(cap, 16, 1_000) == 16          # fewer in flight than either
    assert runs_at_once({**cap, "max_running_requests": None}, 160, 10_000) == 20
    assert runs_at_once(None, 160, 10_000) is None
    line = capacity_line("http://h/v1", cap, 160, 10_000)
    assert "runs at most 48 requests at once" in line and "200,000 tokens holds ~20" in line
    assert "about 20 of the 160 requests in flight on it run at once" in line
    assert "capacity unknown" in capacity_line("http://h/v1", None, 160, 10_000)


def test_the_in_flight_limit_halves_once_per_overload_down_to_its_floor_and_grows_back():
    limit = InFlightLimit(16, floor=3)
    assert limit.overload(0) == "in-flight limit 16 -> 8"
    assert limit.overload(0) is None                    # sent under the old limit: the same overload
    assert limit.overload(1) == "in-flight limit 8 -> 4"
    assert limit.overload(2) == "in-flight limit 4 -> 3"  # the floor: what the servers run at once
    assert limit.overload(3) is None and limit.limit == 3
    grown = [limit.answered() for _ in range(3 + 4 + 5)]  # +1 per `limit` answers
    assert limit.limit == 6 and [g for g in grown if g] == ["in-flight limit 3 -> 4", "in-flight limit 4 -> 5",
                                                            "in-flight limit 5 -> 6"]
    limit.limit, limit.credit = 15, 0
    assert [limit.answered() for _ in range(15)][-1] == "in-flight limit 6 -> 16"  # the ceiling is reported
    assert limit.answered() is None and limit.summary() == {"ceiling": 16, "floor": 3, "final": 16, "lowest": 3,
                                                            "changes": 7}


def test_the_in_flight_limit_holds_requests_first_come_first_served():
    async def scenario():
        limit, order, peak = InFlightLimit(2), [], [0]

        async def request(i, hold):
            async with limit.slot():
                order.append(i)
                peak[0] = max(peak[0], limit.in_flight)
                await asyncio.sleep(hold)

        first = [asyncio.create_task(request(i, 0.05)) for i in range(2)]
        await asyncio.sleep(0)
        waiting = [asyncio.create_task(request(i, 0.0)) for i in range(2, 6)]
        await asyncio.sleep(0)
        waiting[0].cancel()                 # a waiter that goes away takes no place
        assert limit.overload(0) == "in-flight limit 2 -> 1"
        await asyncio.gather(*first, *waiting[1:])
        return order, peak[0], limit.in_flight

    order, peak, left = asyncio.run(scenario())
    assert order == [0, 1, 3, 4, 5] and peak == 2 and left == 0


def sse(*events) -> list[bytes]:
    return [f"data: {json.dumps(e)}\n".encode() if isinstance(e, dict) else e for e in events]


def test_streamed_pieces_join_into_the_non_streamed_answer():
    got = Streamed()
    lines = sse({"choices": [{"index": 0, "text": "<think>", "token_ids": [5], "finish_reason": None}]}, b"\n",
                b": keep-alive\n",
                {"choices": [{"index": 0, "text": "ok<|im_end|>", "token_ids": [9, 2], "finish_reason": "stop",
                              "matched_stop": "<|im_end|>"}]},
                {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}, b"data: [DONE]\n")
    assert [got.add(line) for line in lines] == [False] * 5 + [True]
    assert got.document() == {"choices": [{"text": "<think>ok<|im_end|>", "finish_reason": "stop",
                                           "matched_stop": "<|im_end|>", "token_ids": [5, 9, 2]}],
                              "usage": {"prompt_tokens": 7, "completion_tokens": 3}}
    raw, pieces = b"".join(lines), Streamed()  # bytes arrive cut anywhere, lines are whole again
    assert [pieces.feed(raw[i:i + 7]) for i in range(0, len(raw), 7)][-1] is True
    assert pieces.document() == got.document() and pieces.tokens == got.tokens == 3
    text_only = Streamed()  # SGLang 0.5.14: no ids
    for line in sse({"choices": [{"index": 0, "text": "a", "finish_reason": None}]},
                    {"choices": [{"index": 0, "text": "b", "finish_reason": "length"}]}):
        text_only.add(line)
    assert text_only.document()["choices"][0] == {"text": "ab", "finish_reason": "length", "matched_stop": None}
    assert text_only.tokens == 2 and not text_only.done


@pytest.mark.parametrize("line, kind, retryable", [
    (b'data: {"error": {"message": "The input (9000 tokens) is longer than the model\'s context length", '
     b'"code": 400}}\n', "context_overflow", False),
    (b'data: {"object": "error", "message": "out of memory", "code": 503}\n', "http_503", True),
    (b'data: {"error": {"message": "boom", "type": "InternalServerError"}}\n', "http_500", True),
    (b'data: {"choices": [{"text": "a", "fin\n', "bad_response", True),
])
def test_a_failure_inside_a_stream_is_classified_like_an_http_answer(line, kind, retryable):
    with pytest.raises(RequestFailed) as e:
        Streamed().add(line)
    assert (e.value.kind, e.value.retryable) == (kind, retryable)
