"""The weight readahead (fastar/quant/csrc/readahead.c and pool.c's idle-time prefetch): each product of resident
weights remembers the one that followed it, and at its end the pool's idle worker prefetches the start of that one.
It changes no result (prefetches only), predicts the stable sequence of a decode step, skips over the routed experts
(whose weights change with the routing) and over small products, and turns off with a cap of 0."""

from __future__ import annotations

import time

import numpy as np
import pytest

from fastar.quant import kernels as K
from fastar.quant import reference as R
from tests.polling import wait_until

pytestmark = pytest.mark.skipif(not K.available(), reason="C extension not built")


@pytest.fixture
def two_threads():
    """Two pool threads (the prefetcher is the first worker) and the default cap, restored after the test."""
    threads = K.get_num_threads()
    K.set_num_threads(2)
    was = K.readahead(8)
    yield
    K.readahead(was)
    K.set_num_threads(threads)


def fp8_weight(rng, n: int, k: int):
    """An FP8 e4m3 weight [n, k] (no NaN codes) with its 128x128 scales: n * k bytes of weights."""
    w = rng.integers(0, 0x7E, (n, k), dtype=np.uint8) | (rng.integers(0, 2, (n, k), dtype=np.uint8) << 7)
    return w, np.full((-(-n // 128), -(-k // 128)), 120, np.uint8)


def x_rows(rng, t: int, k: int) -> np.ndarray:
    return np.ascontiguousarray(R.fp8_act_quant(rng.standard_normal((t, k)).astype(np.float32), 128))


def predicted() -> int:
    return K.readahead_stats()[0]


def test_the_next_product_is_predicted_and_prefetched(two_threads):
    rng = np.random.default_rng(0)
    a, b = fp8_weight(rng, 1024, 2048), fp8_weight(rng, 2048, 1024)  # 2 MB each
    xa, xb = x_rows(rng, 1, 2048), x_rows(rng, 1, 1024)
    for _ in range(2):  # the sequence a, b, a, b, ... learnt
        K.fp8_matmul(xa, *a)
        K.fp8_matmul(xb, *b)
    n0, bytes0 = K.readahead_stats()
    K.fp8_matmul(xa, *a)  # its end predicts b: the worker prefetches b's 2 MB while nothing runs
    assert predicted() == n0 + 1
    assert wait_until(lambda: K.readahead_stats()[1] >= bytes0 + (2 << 20), timeout=10)
    K.fp8_matmul(xb, *b)  # and b's end predicts a
    assert predicted() == n0 + 2


def test_a_request_wakes_a_sleeping_worker(two_threads):
    """After a pause longer than its spin the worker sleeps; a product that runs on the calling thread alone (one
    pool chunk: no job wakes the worker) still gets the next product prefetched at its end."""
    rng = np.random.default_rng(5)
    a = fp8_weight(rng, 1024, 2048)  # 2 MB over many pool chunks
    b, c = fp8_weight(rng, 32, 32768), fp8_weight(rng, 32, 32768)  # 1 MB each in one chunk: run inline
    xa, xbc = x_rows(rng, 1, 2048), x_rows(rng, 1, 32768)
    for _ in range(2):  # learnt: a, b, c, a, ...
        K.fp8_matmul(xa, *a)
        K.fp8_matmul(xbc, *b)
        K.fp8_matmul(xbc, *c)
    time.sleep(0.1)  # the worker spins 3 ms after a job, then sleeps
    n0, bytes0 = K.readahead_stats()
    K.fp8_matmul(xbc, *b)  # no pool job; its end asks for c's 1 MB
    assert predicted() == n0 + 1
    assert wait_until(lambda: K.readahead_stats()[1] >= bytes0 + (1 << 20), timeout=10)


def test_results_are_the_same_bits_with_and_without_it(two_threads):
    rng = np.random.default_rng(1)
    ws = [fp8_weight(rng, 1024, 2048) for _ in range(3)]
    x = x_rows(rng, 4, 2048)

    def sequence():
        return [K.fp8_matmul(x, *w) for _ in range(3) for w in ws]

    on = sequence()
    K.readahead(0)
    off = sequence()
    for a, b in zip(on, off, strict=True):
        np.testing.assert_array_equal(a, b)


def test_cap_zero_turns_it_off(two_threads):
    rng = np.random.default_rng(2)
    a, b = fp8_weight(rng, 1024, 2048), fp8_weight(rng, 1024, 2048)
    x = x_rows(rng, 1, 2048)
    K.readahead(0)
    n0 = predicted()
    for _ in range(3):
        K.fp8_matmul(x, *a)
        K.fp8_matmul(x, *b)
    assert predicted() == n0


def test_small_products_are_no_streams(two_threads):
    rng = np.random.default_rng(3)
    a, b = fp8_weight(rng, 256, 1024), fp8_weight(rng, 256, 1024)  # 256 KB each: under the 1 MB threshold
    x = x_rows(rng, 1, 1024)
    n0 = predicted()
    for _ in range(3):
        K.fp8_matmul(x, *a)
        K.fp8_matmul(x, *b)
    assert predicted() == n0


def fp4_expert(rng, d: int, i: int):
    """(w1, s1, w3, s3, w2, s2) of one FP4 expert with d model columns and i intermediate ones."""

    def fp4(n, k):
        return rng.integers(0, 256, (n, k // 2), dtype=np.uint8), np.full((n, k // 32), 125, np.uint8)

    return (*fp4(i, d), *fp4(i, d), *fp4(d, i))


def test_routed_experts_are_skipped_over(two_threads):
    """a, the experts, b: a's end prefetches nothing (the experts come next, their weights unknown until the
    routing), and the experts' end prefetches b, the product that followed a."""
    rng = np.random.default_rng(4)
    a, b = fp8_weight(rng, 1024, 2048), fp8_weight(rng, 2048, 1024)
    d, i = 1024, 512
    experts = [fp4_expert(rng, d, i) for _ in range(2)]  # 1.5 MB of FP4 weights
    xa, xb, xe = x_rows(rng, 1, 2048), x_rows(rng, 1, 1024), x_rows(rng, 2, d)
    rows, offsets, route_w = np.array([0, 1], np.int64), np.array([0, 1, 2], np.int64), np.ones(2, np.float32)

    def layer(after=None):
        K.fp8_matmul(xa, *a)
        after_a = predicted()
        K.experts_ffn(xe, experts, rows, offsets, route_w, 10.0, np.zeros((2, d), np.float32))
        after_experts = predicted()
        K.fp8_matmul(xb, *b)
        return after_a, after_experts

    layer()
    layer()  # learnt: a -> (experts) -> b, b -> a
    n0 = predicted()
    after_a, after_experts = layer()
    assert after_a == n0 + 0  # b's end predicted a (counted before this layer); a's end predicts nothing
    assert after_experts == after_a + 1  # the experts' end predicts b


def test_a_bad_cap_is_refused():
    with pytest.raises(ValueError, match="readahead cap"):
        K.readahead(-1)
