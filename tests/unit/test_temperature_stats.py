"""Tests for noisy_temp_server.temperature.stats: hand-checked rows, a float64 reference,
masked tokens, bad input, bf16, and property tests."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from kl_reference import kl_to_clean

from noisy_temp_server.temperature.stats import (
    KLTerms,
    NonFiniteLogitsError,
    PairTerms,
    RowScratch,
    check_logits,
    pair_statistics,
    served_row_features,
    stable_log_softmax,
)

INF = float("inf")
LN3 = math.log(3.0)


def rows(*values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


# ---------------------------------------------------------------- hand-checked rows


def test_pair_statistics_two_token_row_by_hand() -> None:
    # clean z = [0, ln3] -> p = [1/4, 3/4]; served z~ = [0, 0] -> q = [1/2, 1/2]
    stats = pair_statistics(rows([0.0, LN3]), rows([0.0, 0.0]))
    # tau2 = Var([0, ln3]) = (ln3 / 2)^2 = 0.30174
    assert stats.tau2.item() == pytest.approx((LN3 / 2) ** 2, rel=1e-6)
    # z~ - z = [0, -ln3] -> same spread -> sigma2 = tau2, alpha = 1
    assert stats.sigma2.item() == pytest.approx((LN3 / 2) ** 2, rel=1e-6)
    assert stats.alpha.item() == pytest.approx(1.0, rel=1e-6)
    # Var_p(z) = p0 p1 (z1 - z0)^2 = 3/16 ln3^2 = 0.22629
    assert stats.var_p_clean.item() == pytest.approx(3 / 16 * LN3**2, rel=1e-5)
    # H(p) = 1/4 ln4 + 3/4 ln(4/3) = 0.56233
    assert stats.entropy_clean.item() == pytest.approx(0.25 * math.log(4) + 0.75 * math.log(4 / 3))
    # KL = 1/4 ln(1/2) + 3/4 ln(3/2) = 0.13081
    assert stats.kl_at_one.item() == pytest.approx(0.25 * math.log(0.5) + 0.75 * math.log(1.5))
    # argmax z = 1, argmax z~ = 0 (a tie goes to the lowest index)
    assert not stats.same_top.item()


def test_pair_statistics_identical_flat_rows() -> None:
    stats = pair_statistics(rows([2.0, 2.0, 2.0]), rows([2.0, 2.0, 2.0]))
    assert stats.tau2.item() == 0.0
    assert stats.sigma2.item() == 0.0
    assert stats.alpha.item() == 0.0  # tau2 == 0 and sigma2 == 0: no noise, alpha 0
    assert stats.var_p_clean.item() == pytest.approx(0.0, abs=1e-7)
    assert stats.entropy_clean.item() == pytest.approx(math.log(3))
    assert stats.kl_at_one.item() == pytest.approx(0.0, abs=1e-7)
    assert stats.same_top.item()


def test_alpha_is_infinite_for_a_flat_clean_row_with_noise() -> None:
    # tau2 = 0, sigma2 = Var([0, 1]) = 1/4
    stats = pair_statistics(rows([1.0, 1.0]), rows([1.0, 2.0]))
    assert stats.sigma2.item() == pytest.approx(0.25)
    assert stats.alpha.item() == INF


def test_kl_terms_by_hand() -> None:
    clean = rows([0.0, LN3], [0.0, LN3])
    served = rows([0.0, 2 * LN3], [0.0, 2 * LN3])
    kl = kl_to_clean(clean, served, torch.tensor([1.0, 2.0]))
    # T = 1: q = [1/10, 9/10]; KL = 1/4 ln(2.5) + 3/4 ln(5/6) = 0.09233
    assert kl[0].item() == pytest.approx(0.25 * math.log(2.5) + 0.75 * math.log(5 / 6), rel=1e-5)
    # T = 2: z~/2 = [0, ln3] = z, so KL = 0
    assert kl[1].item() == pytest.approx(0.0, abs=1e-7)
    assert kl_to_clean(clean, served, 2.0).tolist() == pytest.approx([0.0, 0.0], abs=1e-7)


def test_served_row_features_by_hand() -> None:
    # q = [1/4, 3/4] (the masked token has q = 0 and is ignored)
    features = served_row_features(rows([0.0, LN3, -INF]))
    assert features.entropy.item() == pytest.approx(0.25 * math.log(4) + 0.75 * math.log(4 / 3))
    assert features.var_q.item() == pytest.approx(3 / 16 * LN3**2, rel=1e-5)
    assert features.top_prob.item() == pytest.approx(0.75)


def test_served_row_features_without_variance_skip_only_var_q() -> None:
    # The entropy-only path (one softmax) agrees with the moments' to float32 rounding.
    served = torch.randn(5, 40, generator=torch.Generator().manual_seed(3)) * 3
    full = served_row_features(served)
    light = served_row_features(served, need_variance=False)
    torch.testing.assert_close(light.entropy, full.entropy, rtol=0, atol=1e-5)
    torch.testing.assert_close(light.top_prob, full.top_prob)
    assert light.var_q.shape == (5,)
    assert light.var_q.isnan().all()


def test_entropy_only_path_by_hand_and_on_bad_rows() -> None:
    # q = [1/4, 3/4] beside a masked token; then NaN, +inf and all-masked rows: NaN features.
    served = torch.tensor(
        [[0.0, LN3, -INF], [0.0, math.nan, 1.0], [0.0, INF, 1.0], [-INF, -INF, -INF]]
    )
    light = served_row_features(served, validate=False, need_variance=False)
    assert light.entropy[0].item() == pytest.approx(0.25 * math.log(4) + 0.75 * math.log(4 / 3))
    assert light.top_prob[0].item() == pytest.approx(0.75)
    assert light.entropy[1:].isnan().all()


def test_entropy_only_path_matches_float64_at_a_real_vocabulary() -> None:
    served = torch.randn(4, 49_152, generator=torch.Generator().manual_seed(5)) * 4
    served[0, :1000] = -INF
    reference = served_row_features(served.double(), validate=False).entropy
    light = served_row_features(served, validate=False, need_variance=False)
    torch.testing.assert_close(light.entropy.double(), reference, rtol=0, atol=1e-4)


def test_row_scratch_reuses_its_buffers_and_grows_to_more_rows() -> None:
    scratch = RowScratch()
    first, second = scratch.take(2, torch.zeros(3, 8), torch.float32)
    assert first.shape == second.shape == (3, 8)
    assert first.data_ptr() != second.data_ptr()
    again, _ = scratch.take(2, torch.zeros(2, 8), torch.float32)
    assert again.data_ptr() == first.data_ptr()
    assert again.shape == (2, 8)
    (grown,) = scratch.take(1, torch.zeros(5, 8), torch.float32)
    assert grown.shape == (5, 8)
    assert grown.is_contiguous()
    (wider,) = scratch.take(1, torch.zeros(5, 9), torch.float64)
    assert wider.shape == (5, 9)
    assert wider.dtype == torch.float64


def test_served_row_features_with_scratch_equal_without() -> None:
    served = torch.randn(6, 300, generator=torch.Generator().manual_seed(7)) * 3
    served[1, :50] = -INF
    plain = served_row_features(served, validate=False)
    scratch = RowScratch()
    for rows in (6, 2, 6):  # reused, at fewer and again more rows
        reused = served_row_features(served[:rows], validate=False, scratch=scratch)
        for name in ("entropy", "var_q", "top_prob"):
            assert torch.equal(getattr(reused, name), getattr(plain, name)[:rows])


def test_one_hot_served_row_has_zero_entropy_and_variance() -> None:
    features = served_row_features(rows([0.0, -INF, -INF]))
    assert features.entropy.item() == 0.0
    assert features.var_q.item() == 0.0
    assert features.top_prob.item() == 1.0


# ---------------------------------------------------------------- masked tokens


def test_token_masked_in_clean_contributes_nothing() -> None:
    # p = [1/2, 1/2, 0]; q = [1, 1, e^5] / (2 + e^5); KL = ln(1/2 (2 + e^5)) = ln(1 + e^5 / 2)
    stats = pair_statistics(rows([0.0, 0.0, -INF]), rows([0.0, 0.0, 5.0]))
    assert stats.kl_at_one.item() == pytest.approx(math.log1p(math.exp(5) / 2), rel=1e-6)
    # statistics over the two tokens finite in both rows: both flat
    assert stats.tau2.item() == 0.0
    assert stats.sigma2.item() == 0.0
    assert stats.alpha.item() == 0.0


def test_token_masked_only_in_served_gives_infinite_kl() -> None:
    clean, served = rows([0.0, 0.0, 1.0]), rows([0.0, -INF, 1.0])
    assert pair_statistics(clean, served).kl_at_one.item() == INF
    assert kl_to_clean(clean, served, 0.5).item() == INF


def test_sigma2_is_nan_without_a_token_finite_in_both_rows() -> None:
    stats = pair_statistics(rows([0.0, -INF]), rows([-INF, 0.0]))
    assert math.isnan(stats.sigma2.item())
    assert math.isnan(stats.alpha.item())
    assert stats.kl_at_one.item() == INF


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("bad", [float("nan"), INF])
def test_nan_or_positive_inf_raises_and_names_the_row(bad: float) -> None:
    logits = torch.zeros(4, 5)
    logits[2, 3] = bad
    with pytest.raises(NonFiniteLogitsError, match=r"rows \[2\] contain NaN or \+inf"):
        check_logits(logits)
    with pytest.raises(NonFiniteLogitsError):
        pair_statistics(logits, torch.zeros(4, 5))
    with pytest.raises(NonFiniteLogitsError):
        served_row_features(logits)
    with pytest.raises(NonFiniteLogitsError):
        kl_to_clean(torch.zeros(4, 5), logits, 1.0)


def test_fully_masked_row_raises() -> None:
    logits = torch.zeros(3, 4)
    logits[1] = -INF
    with pytest.raises(NonFiniteLogitsError, match=r"rows \[1\] are entirely -inf"):
        check_logits(logits, name="served logits")


def test_unvalidated_nan_row_gives_nan_features() -> None:
    logits = rows([0.0, float("nan")], [0.0, 1.0])
    features = served_row_features(logits, validate=False)
    assert math.isnan(features.var_q[0].item())
    assert math.isfinite(features.var_q[1].item())


@pytest.mark.parametrize(
    ("logits", "message"),
    [
        (torch.zeros(5), r"shape \[batch, vocab\]"),
        (torch.zeros(2, 0), r"shape \[batch, vocab\]"),
        (torch.zeros(2, 3, dtype=torch.long), "floating-point"),
    ],
)
def test_wrong_shape_or_dtype_raises(logits: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_logits(logits)


def test_mismatched_pair_shapes_raise() -> None:
    with pytest.raises(ValueError, match="same shape"):
        pair_statistics(torch.zeros(2, 3), torch.zeros(2, 4))


def test_inputs_are_not_modified() -> None:
    clean, served = torch.randn(3, 7), torch.randn(3, 7)
    clean_copy, served_copy = clean.clone(), served.clone()
    pair_statistics(clean, served)
    served_row_features(served)
    KLTerms.from_logits(clean, served).kl_with_derivatives(torch.full((3,), 0.7))
    assert torch.equal(clean, clean_copy)
    assert torch.equal(served, served_copy)


# ---------------------------------------------------------------- float64 reference


def reference_statistics(clean: torch.Tensor, served: torch.Tensor) -> dict[str, torch.Tensor]:
    """Direct float64 definitions, row by row with explicit masks."""
    out: dict[str, list[float]] = {k: [] for k in ("tau2", "sigma2", "var_p", "entropy", "kl")}
    for z, zt in zip(clean.double(), served.double(), strict=True):
        finite = torch.isfinite(z)
        both = finite & torch.isfinite(zt)
        out["tau2"].append(z[finite].var(unbiased=False).item())
        out["sigma2"].append((zt - z)[both].var(unbiased=False).item())
        p = torch.softmax(z, -1)
        logq = torch.log_softmax(zt, -1)
        zf = z[finite]
        pf = p[finite]
        mean = (pf * zf).sum()
        out["var_p"].append((pf * (zf - mean) ** 2).sum().item())
        out["entropy"].append(-(pf * pf.log()).sum().item())
        out["kl"].append((pf * (pf.log() - logq[finite])).sum().item())
    return {k: torch.tensor(v, dtype=torch.float64) for k, v in out.items()}


def random_pair(seed: int, batch: int = 6, vocab: int = 300) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    clean = torch.randn(batch, vocab, generator=generator) * 4.0 + 10.0
    served = clean + torch.randn(batch, vocab, generator=generator) * 1.5
    masked = torch.rand(batch, vocab, generator=generator) < 0.2
    masked[:, 0] = False
    clean[masked] = -INF
    served[masked] = -INF
    return clean, served


def test_statistics_match_float64_reference() -> None:
    clean, served = random_pair(0)
    stats = pair_statistics(clean, served)
    ref = reference_statistics(clean, served)
    assert stats.tau2.dtype == torch.float32
    torch.testing.assert_close(stats.tau2.double(), ref["tau2"], rtol=1e-5, atol=0)
    torch.testing.assert_close(stats.sigma2.double(), ref["sigma2"], rtol=1e-5, atol=0)
    torch.testing.assert_close(stats.alpha.double(), ref["sigma2"] / ref["tau2"], rtol=1e-5, atol=0)
    torch.testing.assert_close(stats.var_p_clean.double(), ref["var_p"], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(stats.entropy_clean.double(), ref["entropy"], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(stats.kl_at_one.double(), ref["kl"], rtol=1e-4, atol=1e-6)
    features = served_row_features(served)
    ref_served = reference_statistics(served, served)
    torch.testing.assert_close(features.var_q.double(), ref_served["var_p"], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(
        features.entropy.double(), ref_served["entropy"], rtol=1e-4, atol=1e-6
    )


def test_float64_input_is_computed_in_float64() -> None:
    clean, served = random_pair(1)
    stats = pair_statistics(clean.double(), served.double())
    assert stats.kl_at_one.dtype == torch.float64
    ref = reference_statistics(clean, served)
    torch.testing.assert_close(stats.kl_at_one, ref["kl"], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(stats.var_p_clean, ref["var_p"], rtol=1e-10, atol=1e-12)


def test_derivatives_match_finite_differences() -> None:
    clean, served = random_pair(2)
    terms = KLTerms.from_logits(clean.double(), served.double())
    u = torch.linspace(0.3, 2.5, clean.shape[0], dtype=torch.float64)
    step = 1e-5
    kl, first, second = terms.kl_with_derivatives(u)
    torch.testing.assert_close(kl, terms.kl(u))
    numeric_first = (terms.kl(u + step) - terms.kl(u - step)) / (2 * step)
    numeric_second = (terms.kl(u + step) - 2 * kl + terms.kl(u - step)) / step**2
    torch.testing.assert_close(first, numeric_first, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(second, numeric_second, rtol=1e-3, atol=1e-5)


# ---------------------------------------------------------------- bf16 / fp16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_input_gives_the_float32_answer(dtype: torch.dtype) -> None:
    clean, served = random_pair(3)
    low_clean, low_served = clean.to(dtype), served.to(dtype)
    low = pair_statistics(low_clean, low_served)
    assert low.kl_at_one.dtype == torch.float32
    # Accumulation is in float32: the same answer as float32 on the rounded values.
    same_values = pair_statistics(low_clean.float(), low_served.float())
    for name in ("tau2", "sigma2", "alpha", "var_p_clean", "entropy_clean", "kl_at_one"):
        torch.testing.assert_close(getattr(low, name), getattr(same_values, name))
    # And close to the unrounded float32 answer (bf16 keeps ~3 significant digits).
    full = pair_statistics(clean, served)
    torch.testing.assert_close(low.alpha, full.alpha, rtol=0.05, atol=0.0)
    torch.testing.assert_close(low.var_p_clean, full.var_p_clean, rtol=0.1, atol=0.05)
    low_features = served_row_features(low_served)
    torch.testing.assert_close(
        low_features.entropy, served_row_features(low_served.float()).entropy
    )


def test_large_logits_do_not_overflow() -> None:
    clean = rows([1000.0, 1000.0 + LN3])
    stats = pair_statistics(clean, clean - 500.0)
    assert stats.kl_at_one.item() == pytest.approx(0.0, abs=1e-6)
    assert stats.var_p_clean.item() == pytest.approx(3 / 16 * LN3**2, rel=1e-3)
    assert torch.allclose(stable_log_softmax(clean).exp().sum(-1), torch.ones(1))


# ---------------------------------------------------------------- properties

logit_rows = arrays(
    np.float32,
    st.tuples(st.integers(1, 4), st.integers(2, 12)),
    elements=st.floats(-30, 30, width=32),
)


@settings(max_examples=75, deadline=None)
@given(logits=logit_rows, shift=st.floats(-50, 50))
def test_identical_or_shifted_served_rows_have_zero_kl(logits: np.ndarray, shift: float) -> None:
    clean = torch.from_numpy(logits)
    assert torch.all(pair_statistics(clean, clean + shift).kl_at_one <= 1e-5)
    identical = pair_statistics(clean, clean)
    assert torch.all(identical.kl_at_one <= 1e-6)
    assert torch.all(identical.same_top)
    assert torch.all(identical.sigma2 == 0)


@settings(max_examples=50, deadline=None)
@given(
    clean=logit_rows,
    noise_seed=st.integers(0, 2**16),
    temperature=st.floats(0.1, 10.0),
)
def test_kl_is_non_negative_and_matches_direct_definition(
    clean: np.ndarray, noise_seed: int, temperature: float
) -> None:
    z = torch.from_numpy(clean)
    generator = torch.Generator().manual_seed(noise_seed)
    served = z + torch.randn(z.shape, generator=generator) * 2
    kl = kl_to_clean(z, served, temperature)
    log_p = torch.log_softmax(z.double(), -1)
    log_q = torch.log_softmax(served.double() / temperature, -1)
    direct = (log_p.exp() * (log_p - log_q)).sum(-1)
    assert torch.all(kl >= 0)
    torch.testing.assert_close(kl.double(), direct.clamp(min=0), rtol=1e-4, atol=2e-5)


@settings(max_examples=75, deadline=None)
@given(logits=logit_rows)
def test_served_features_are_in_range(logits: np.ndarray) -> None:
    served = torch.from_numpy(logits)
    features = served_row_features(served)
    vocab = served.shape[1]
    assert torch.all(features.entropy >= 0)
    assert torch.all(features.entropy <= math.log(vocab) + 1e-5)
    assert torch.all(features.var_q >= 0)
    assert torch.all((features.top_prob >= 1 / vocab - 1e-6) & (features.top_prob <= 1))


def test_pair_terms_match_the_separate_float64_computations() -> None:
    """The shared intermediate gives, within float32 rounding (1e-5 relative, 1e-6 absolute),
    what each statistic computed on its own from the float64 logits: log p, Var_p, the served
    row's features and the KL at T = 1 (+inf where the served row masks the clean support;
    1e-5 absolute: float32 cancellation)."""
    generator = torch.Generator().manual_seed(11)
    clean = torch.randn(6, 3000, generator=generator, dtype=torch.float64) * 4
    served = 0.9 * clean + torch.randn(6, 3000, generator=generator, dtype=torch.float64)
    clean[:, :5] = served[:, :5] = -INF  # masked in both rows
    served[5, 7] = -INF  # the served row masks a token the clean row supports
    pair = PairTerms.from_logits(clean.float(), served.float())

    finite = torch.isfinite(clean)
    log_p = torch.log_softmax(clean, dim=-1)
    ours = pair.clean.double() - pair.clean_log_normaliser.double().unsqueeze(-1)
    torch.testing.assert_close(ours[finite], log_p[finite], rtol=1e-5, atol=1e-6)
    p = log_p.exp()
    filled = torch.where(finite, clean, 0.0)
    mean = (p * filled).sum(-1, keepdim=True)
    var_p = (p * (filled - mean).square()).sum(-1)
    torch.testing.assert_close(pair.var_p_clean.double(), var_p, rtol=1e-5, atol=1e-6)
    expected = served_row_features(served)
    for name in ("entropy", "var_q", "top_prob"):
        torch.testing.assert_close(
            getattr(pair.served_features, name).double(),
            getattr(expected, name),
            rtol=1e-5,
            atol=1e-6,
        )
    kl_at_one = pair.statistics().kl_at_one.double()
    reference = kl_to_clean(clean, served, 1.0)
    assert math.isinf(kl_at_one[5])
    assert math.isinf(reference[5])
    # KL = E_p[log p] - E_p[s] + log sum exp(s): float32 terms of ~10 nats cancel, 1e-5 absolute
    torch.testing.assert_close(kl_at_one[:5], reference[:5], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pair.statistics().tau2, pair_statistics(clean, served).tau2.float())
