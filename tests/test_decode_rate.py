"""The decode rate the planner weighs a coded unit's decode with (``coded.decode_rate``): the kernel
timed alone and beside a GEMM load, and the slower of the two kept. The timings come from the GPU;
how they become rates (medians of repeats, what the decodes add to the load, the fall-back to the
rate alone) and how the decodes are spread over the load are checked here on numbers given. The
timing itself is marked ``gpu``."""

from __future__ import annotations

import pytest
import torch

from ddo_blocks.streaming import coded

MB = 1_000_000


def test_decodes_slowed_beside_the_load_give_the_rate_under_load():
    # one decode writes 1 MB: 1 ms alone; 4 decodes add 12 ms to the load, 3 ms each
    rates = coded._decode_rates(MB, [1e-3] * 3, [0.020] * 3, [0.032] * 3, 4)
    assert rates["alone"] == pytest.approx(1e9)
    assert rates["under_load"] == pytest.approx(MB / 3e-3)
    assert rates["planning"] == rates["under_load"]


def test_decodes_the_load_hides_leave_the_rate_alone():
    # 4 decodes add 2 ms in all: 0.5 ms each, less than the 1 ms each takes alone
    rates = coded._decode_rates(MB, [1e-3] * 3, [0.020] * 3, [0.022] * 3, 4)
    assert rates["under_load"] == pytest.approx(2e9)
    assert rates["planning"] == rates["alone"] == pytest.approx(1e9)


@pytest.mark.parametrize("both", [0.020, 0.019])
def test_no_added_time_is_no_rate_under_load(both):
    # noise larger than the decodes' cost: nothing to divide by, the rate alone is kept
    rates = coded._decode_rates(MB, [1e-3] * 3, [0.020] * 3, [both] * 3, 4)
    assert rates["under_load"] is None
    assert rates["planning"] == rates["alone"] == pytest.approx(1e9)


def test_without_the_load_the_rate_is_the_one_alone():
    # no room for the load: no pairs, no decodes beside it
    rates = coded._decode_rates(MB, [1e-3], [], [], 0)
    assert rates == {"alone": pytest.approx(1e9), "under_load": None, "planning": pytest.approx(1e9)}


def test_no_time_at_all_is_no_rate():
    assert coded._decode_rates(MB, [0.0], [], [], 0) == {"alone": None, "under_load": None, "planning": None}


def test_the_added_time_is_the_median_of_each_pairs_difference():
    # pairs add 3, 1 and 20 ms (the last disturbed): the median is 3 ms; the difference of the
    # medians (31 - 20 = 11 ms) would mix repeats run at different clocks
    rates = coded._decode_rates(MB, [1e-4] * 3, [0.010, 0.030, 0.020], [0.013, 0.031, 0.040], 1)
    assert rates["under_load"] == pytest.approx(MB / 3e-3)
    assert rates["planning"] == rates["under_load"]


def test_the_rate_alone_is_the_median_of_its_repeats():
    # one slow outlier (a clock ramping up) moves the median of 4 less than it moves the mean
    rates = coded._decode_rates(MB, [1e-3, 9e-3, 1e-3, 2e-3], [], [], 0)
    assert rates["alone"] == pytest.approx(MB / 1.5e-3)


def test_the_slower_of_the_two_is_planned_with_either_way():
    for alone, added in [(1e-3, 5e-3), (5e-3, 1e-3), (2e-3, 2e-3)]:
        rates = coded._decode_rates(MB, [alone], [0.0], [added], 1)
        assert rates["planning"] == pytest.approx(MB / max(alone, added))


@pytest.mark.parametrize("decodes, matmuls", [(10, 2), (125, 100), (10, 40), (7, 3), (0, 5), (3, 1)])
def test_the_decodes_are_spread_over_the_load_and_none_after_it(decodes, matmuls):
    batches = coded._batches(decodes, matmuls)
    assert len(batches) == matmuls and sum(batches) == decodes
    if matmuls > 1:
        assert batches[-1] == 0
        assert max(batches[:-1]) - min(batches[:-1]) <= 1


def test_decode_rate_keeps_both_rates_and_plans_with_the_slower(monkeypatch):
    # the timing is the GPU's: given here, decode_rate keeps all three once per device and codec
    monkeypatch.setattr(coded, "_DECODE_RATE", {})
    monkeypatch.setattr(coded, "DECODE_RATES", {})
    monkeypatch.setattr(coded, "_synthetic_chunk", lambda codec: (None, (0, 0, 0, 0, None)))
    calls = []

    def check(device, codec, buf, piece, *, timed):
        calls.append((str(device), codec, timed))
        return coded._decode_rates(MB, [1e-3], [0.020], [0.030], 4)

    monkeypatch.setattr(coded, "_check_chunk", check)
    cuda = torch.device("cuda:0")
    assert coded.decode_rate(cuda, "tiered") == pytest.approx(MB / 2.5e-3)
    assert coded.decode_rate(cuda, "tiered") == pytest.approx(MB / 2.5e-3)
    assert calls == [("cuda:0", "tiered", True)]
    assert coded.DECODE_RATES[("cuda:0", "tiered")] == {
        "alone": pytest.approx(1e9), "under_load": pytest.approx(MB / 2.5e-3), "planning": pytest.approx(MB / 2.5e-3)
    }
    assert coded.decode_rate(cuda, "off") is None and calls == [("cuda:0", "tiered", True)]


@pytest.mark.gpu
@pytest.mark.parametrize("codec", ["fixed", "tiered", "huffman"])
def test_decode_rate_on_the_gpu_is_the_slower_of_alone_and_beside_the_load(monkeypatch, codec):
    import time

    monkeypatch.setattr(coded, "_DECODE_RATE", {})
    monkeypatch.setattr(coded, "DECODE_RATES", {})
    cuda = torch.device("cuda")
    torch.zeros(1, device=cuda)  # the context, outside the time
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated(cuda)
    t0 = time.perf_counter()
    rate = coded.decode_rate(cuda, codec)
    took = time.perf_counter() - t0
    # nothing of the probe stays allocated (its GEMM load's cuBLAS workspace included: a 32 MiB one
    # once stayed, outside every budget); freeing the workspaces frees those of earlier matmuls too
    assert torch.cuda.memory_allocated(cuda) <= held
    rates = coded.DECODE_RATES[(str(cuda), codec)]
    print(f"{codec}: alone {rates['alone'] / 1e9:.0f} GB/s, under load "
          f"{(rates['under_load'] or 0) / 1e9:.0f} GB/s, planning {rate / 1e9:.0f} GB/s, {took:.2f} s")
    assert rates["alone"] and rates["alone"] > 1e9
    assert rate == rates["planning"] <= rates["alone"]
    if rates["under_load"] is not None:
        assert rate == min(rates["alone"], rates["under_load"])
    assert took < 5.0  # with the kernel's compile and cuBLAS's set-up; the timing itself about 0.2 s
