"""The engine's non-greedy sampler (:func:`nucleus`, :func:`sample`) against a brute-force
reference: a float64 softmax over a full sort of the vocabulary (logit descending, id ascending),
the top-k its head, the nucleus the shortest head whose probability reaches top_p, a draw the
inverse CDF at one uniform number. The sampler's weights are float32, the reference's float64:
where the reference's own sums lie within ``EPS`` of a boundary (top_p, or a uniform number)
either side is accepted, nowhere else."""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import numpy as np
import pytest

from tasks.serving.triton_models.llm_generate.engine import Nucleus, SamplingParams, nucleus, sample

EPS = 1e-6  # float32 weights: their normalized sums stray by under 5e-8 (2.4e-8 seen here)


def reference(logits: np.ndarray[Any, Any], params: SamplingParams) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """The top-k candidates in the draw's order (logit descending, id ascending) and their
    probabilities (float64), by a full sort."""
    x = logits.astype(np.float32).astype(np.float64)
    order = np.lexsort((np.arange(len(x)), -x))
    if 0 < params.top_k < len(x):
        order = order[:params.top_k]
    weights = np.exp((x[order] - x.max()) / params.temperature)
    return order, weights / weights.sum()


def allowed_sizes(probs: np.ndarray[Any, Any], top_p: float) -> set[int]:
    """Nucleus sizes m whose head reaches top_p while the head one shorter does not, within EPS."""
    cumulative = np.cumsum(probs)
    shorter = np.concatenate([[0.0], cumulative[:-1]])
    return {int(m) + 1 for m in np.flatnonzero((cumulative >= top_p - EPS) & (shorter < top_p + EPS))}


def check_against_reference(logits: np.ndarray[Any, Any], params: SamplingParams, uniforms: np.ndarray[Any, Any]) -> None:
    got = nucleus(logits, params)
    order, probs = reference(logits, params)
    if params.top_p < 1.0:
        sizes = allowed_sizes(probs, params.top_p)
        assert len(got.tokens) in sizes, (params, len(got.tokens), sorted(sizes)[:5])
        expected = order[:len(got.tokens)]  # the same head: same order, ties to the lower id
        np.testing.assert_array_equal(got.tokens, expected)
    else:  # the whole top-k, in id order
        by_id = np.argsort(order)
        order, probs = order[by_id], probs[by_id]
        np.testing.assert_array_equal(got.tokens, order)
    head = probs[:len(got.tokens)]
    np.testing.assert_allclose(got.cumulative / got.cumulative[-1], np.cumsum(head) / head.sum(), rtol=EPS, atol=1e-12)
    if params.top_p < 1.0 and len(allowed_sizes(probs, params.top_p)) > 1:
        return  # the reference's own nucleus is ambiguous: its draws are normalized differently
    edges = np.cumsum(head / head.sum())
    for u in uniforms:  # the token whose interval holds u; within EPS of an edge, the one beyond too
        low, high = np.searchsorted(edges, [u - EPS, u + EPS], side="right")
        drawn = got.draw(float(u))
        assert drawn in order[low:min(high, len(head) - 1) + 1], (params, u, drawn)


def logits_of(rng: np.random.Generator, vocab: int, kind: str) -> np.ndarray[Any, Any]:
    if kind == "peaked":
        x = rng.normal(0.0, 1.0, vocab)
        x[rng.choice(vocab, min(vocab, 8), replace=False)] = rng.uniform(6.0, 12.0, min(vocab, 8))
    elif kind == "ties":  # few distinct values: ties inside the nucleus and at its edge
        x = rng.integers(-3, 3, vocab).astype(np.float64)
    elif kind == "masked":  # -inf logits (weight 0) among finite ones
        x = rng.normal(0.0, 2.0, vocab)
        x[rng.random(vocab) < 0.3] = -np.inf
        x[rng.integers(vocab)] = 1.0
    else:
        x = rng.normal(0.0, {"broad": 3.0, "flat": 0.3}[kind], vocab)
    return x.astype(np.float32)


@pytest.mark.parametrize("vocab", [1, 2, 7, 300, 5000, 40000])
def test_the_nucleus_and_its_draws_equal_a_full_sorts(vocab: int) -> None:
    """Random logits of every shape at every setting, top-k and top-p alone and together: the
    same tokens in the same order, the same cumulative probabilities, the same token at the same
    uniform number (inverse CDF)."""
    rng = np.random.default_rng(vocab)
    settings = [(temperature, top_k, top_p) for temperature, top_k, top_p in itertools.product(
        (0.05, 1.0, 2.0), (0, 3, 50, vocab - 1, vocab), (0.05, 0.5, 0.9, 0.999, 1.0)) if top_k != 1]  # 1: greedy
    for kind in ("peaked", "broad", "flat", "ties", "masked"):
        logits = logits_of(rng, vocab, kind)
        uniforms = np.concatenate([[0.0, np.nextafter(1.0, 0.0)], rng.random(10)])
        share = settings if vocab < 2000 else [settings[i] for i in rng.choice(len(settings), 12, replace=False)]
        for temperature, top_k, top_p in share:
            check_against_reference(logits, SamplingParams(1, temperature, max(top_k, 0), top_p), uniforms)


def test_ties_go_to_the_lower_id() -> None:
    def tokens(logits: list[float], **kwargs: Any) -> list[int]:
        return nucleus(np.asarray(logits, np.float32), SamplingParams(1, **{"temperature": 1.0, **kwargs})).tokens.tolist()

    assert tokens([1, 1, 1, 1], top_p=0.5) == [0, 1]  # exactly half: two of four reach it
    assert tokens([1, 1, 1, 1], top_p=0.51) == [0, 1, 2]
    assert tokens([0, 2, 2, 1, 2], top_k=2) == [1, 2]
    assert tokens([0, 2, 2, 1, 2, 1], top_k=4) == [1, 2, 3, 4]  # id order when top_p is 1
    assert tokens([5, 0, 2, 2, 1, 2], top_k=3, top_p=0.5) == [0]
    assert tokens([0, 2, 2, 1, 2], top_p=0.9, temperature=1e-3) == [1, 2, 4]  # the argmax's ties share it


def test_the_top_k_is_exact_when_the_strided_guess_misses() -> None:
    """The top-k's guess comes from every stride-th logit: logits highest exactly there make it
    overshoot (fewer than k reach it), and the search falls back to every logit."""
    vocab = 8192  # a stride of 4
    x = np.zeros(vocab, np.float32)
    x[::4] = np.linspace(10.0, 9.0, vocab // 4, dtype=np.float32)
    x[1::4] = 20.0 + np.arange(vocab // 4, dtype=np.float32)  # the true top, none of it sampled
    for k in (5, 100, 3000):
        check_against_reference(x, SamplingParams(1, 1.0, k, 1.0), np.linspace(0, 0.999, 7))
        check_against_reference(x, SamplingParams(1, 1.0, k, 0.6), np.linspace(0, 0.999, 7))


@pytest.mark.parametrize("temperature", [1e-3, 1e-30, 5e-324])
def test_a_tiny_temperature_is_the_argmax_and_its_ties_with_no_warnings(temperature: float) -> None:
    """Weights are exp((logit - highest) / temperature) in float32: gaps that overflow it (a
    subnormal temperature, a logit of -3e38) are weight 0, silently."""
    x = np.asarray([-3e38, 0.5, 2.0, -np.inf, 2.0, 1.5], np.float32)
    for top_k, top_p in ((0, 1.0), (0, 0.9), (0, 0.4), (4, 0.99), (4, 1.0)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = nucleus(x, SamplingParams(1, temperature, top_k, top_p))
            drawn = {got.draw(u) for u in np.linspace(0.0, np.nextafter(1.0, 0.0), 50)}
        assert drawn == ({2} if top_p < 0.5 else {2, 4}), (top_k, top_p)


def test_a_token_of_weight_zero_is_never_drawn() -> None:
    x = np.asarray([-np.inf, 0.0, -np.inf, -np.inf, 0.0, -np.inf], np.float32)
    got = nucleus(x, SamplingParams(1, 1.0))  # the whole vocabulary, in id order
    assert got.ids is None and got.cumulative.tolist() == [0.0, 1.0, 1.0, 1.0, 2.0, 2.0]
    uniforms = [0.0, np.nextafter(0.5, 0.0), 0.5, np.nextafter(1.0, 0.0)]
    assert [got.draw(float(u)) for u in uniforms] == [1, 1, 4, 4]
    assert Nucleus(np.asarray([7, 8, 9]), np.asarray([1.0, 2.0, 2.0])).draw(np.nextafter(1.0, 0.0)) == 8


@pytest.mark.parametrize("logits", [[0.0, np.nan, 1.0], [0.0, np.inf], [-np.inf, -np.inf]])
def test_non_finite_logits_fail_the_request(logits: list[float]) -> None:
    """+inf, NaN or nothing finite: the engine fails this request (sample_and_take), not the batch."""
    with pytest.raises(ValueError, match="expected a finite number"):
        sample(np.asarray(logits, np.float32), SamplingParams(1, 1.0, top_p=0.9), np.random.default_rng(0))


def test_a_seed_draws_the_same_tokens_one_uniform_number_each() -> None:
    rng = np.random.default_rng(3)
    rows = [logits_of(rng, 3000, kind) for kind in ("peaked", "broad", "ties")] * 10
    params = SamplingParams(1, 0.8, 40, 0.9)

    def run(seed: int) -> list[int]:
        generator = np.random.default_rng(seed)
        return [sample(row, params, generator) for row in rows]

    uniforms = np.random.default_rng(11).random(len(rows))
    assert run(11) == run(11) == [nucleus(row, params).draw(float(u)) for row, u in zip(rows, uniforms, strict=True)]
    assert run(11) != run(12)
