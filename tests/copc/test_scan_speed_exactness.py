"""The action-token scans (copc/scan.py) against per-token loops, and their cost structure.

``reverse_action_scan`` for ``0 < γλ < 1`` is a blocked matmul plus a float64 carry scan;
these tests pin it (and the estimator built on it) to slow per-token Python loops for
γλ ∈ {0, 0.3, 0.95, 0.999, 1}, masks with all-observation rows, single-action rows,
trailing padding and lengths that are not a multiple of any block, in float32 and
float64; check long rows for overflow/NaN; and check that the number of torch ops does
not grow with the row length (no Python loop over blocks or tokens).
"""

from __future__ import annotations

import pytest
import torch
from reference import coupled_reference, random_multiturn_mask

import copc
from copc.scan import linear_reverse_scan, reverse_action_scan

F32, F64 = torch.float32, torch.float64
C_VALUES = [0.3, 0.95, 0.999, 1.0]
# lengths around the in-block (16) and carry-group (32 blocks, doubling up to 64) sizes
LENGTHS = [1, 2, 15, 17, 100, 1023, 1500, 2100]


def g_next_loop(x: torch.Tensor, mask: torch.Tensor, c: float) -> torch.Tensor:
    """Per-token loop: ``G_next[p]`` = G at the first action token after ``p``; float64."""
    out = []
    for row_x, row_m in zip(x.double().tolist(), mask.tolist(), strict=True):
        G, row = 0.0, [0.0] * len(row_x)
        for p in range(len(row_x) - 1, -1, -1):
            row[p] = G
            if row_m[p]:
                G = row_x[p] + c * G
        out.append(row)
    return torch.tensor(out, dtype=F64).reshape(x.shape)


def special_mask(B: int, T: int, g: torch.Generator) -> torch.Tensor:
    """Random multi-turn rows with padding; row 0 all observation, row 1 a single action
    token, row 2 all action tokens (B ≥ 4)."""
    mask = random_multiturn_mask(B, T, g)
    mask[0] = False
    mask[1] = False
    mask[1, int(torch.randint(0, T, (1,), generator=g))] = True
    mask[2] = True
    return mask


def assert_close_to(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """float64: 1e-12 relative to the row scale; float32: 1e-5 (the estimator tests' rtol)."""
    tol = 1e-12 if dtype == F64 else 1e-5
    scale = max(1.0, float(ref.abs().max())) if ref.numel() else 1.0
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("c", C_VALUES)
def test_reverse_action_scan_matches_per_token_loop(c, dtype):
    g = torch.Generator().manual_seed(int(c * 1000) + (dtype == F64))
    for T in LENGTHS:
        B = 5
        mask = special_mask(B, T, g)
        x = torch.where(mask, torch.randn(B, T, generator=g, dtype=F64), 0.0).to(dtype)
        out = reverse_action_scan(x, mask, c)
        assert out.shape == (B, T) and out.dtype == dtype
        ref = g_next_loop(x, mask, c)
        assert_close_to(out, ref, dtype)
        # nothing flows into an all-observation row or past a row's last action token
        assert torch.equal(out[0], torch.zeros(T, dtype=dtype))
        last = int(mask[1].nonzero()[-1])
        assert torch.equal(out[1, last:], torch.zeros(T - last, dtype=dtype))


@pytest.mark.parametrize("dtype", [F32, F64])
def test_reverse_action_scan_at_zero_discount_is_the_next_token(dtype):
    """c = 0: documented shortcut G_next[p] = x_{p+1} (only ever multiplied by c = 0)."""
    g = torch.Generator().manual_seed(3)
    mask = special_mask(4, 50, g)
    x = torch.where(mask, torch.randn(4, 50, generator=g), 0.0).to(dtype)
    out = reverse_action_scan(x, mask, 0.0)
    assert torch.equal(out[:, :-1], x[:, 1:]) and torch.equal(out[:, -1], torch.zeros(4, dtype=dtype))


@pytest.mark.parametrize("c", [1e-3, 1e-8, 1e-30])
@pytest.mark.parametrize("dtype", [F32, F64])
def test_reverse_action_scan_tiny_discounts(c, dtype):
    """Small c shrinks the block (c^-L must stay in range) down to the token-level doubling."""
    g = torch.Generator().manual_seed(4)
    mask = special_mask(4, 700, g)
    x = torch.where(mask, torch.randn(4, 700, generator=g, dtype=F64), 0.0).to(dtype)
    assert_close_to(reverse_action_scan(x, mask, c), g_next_loop(x, mask, c), dtype)


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.0), (0.6, 0.5), (1.0, 0.95), (0.999, 1.0), (1.0, 1.0)])
def test_estimator_matches_reference_loop(gamma, lam, dtype):
    """coupled_advantage_return vs the per-token reference, γλ ∈ {0, 0.3, 0.95, 0.999, 1}."""
    g = torch.Generator().manual_seed(int(gamma * 100 + lam * 10))
    low, high = copc.margins(0.5)
    for T in (1, 17, 100, 1500):
        B = 5
        mask = special_mask(B, T, g)
        has = mask.any(1)
        first = torch.where(has, mask.double().argmax(1), torch.full((B,), T))
        rewards = torch.randn(B, T, generator=g, dtype=F64) * (torch.rand(B, T, generator=g) < 0.2)
        rewards = rewards.masked_fill(torch.arange(T)[None] < first[:, None], 0.0)
        logp_old = -3 * torch.rand(B, T, generator=g, dtype=F64)
        x = {"rewards": rewards, "values": torch.randn(B, T, generator=g, dtype=F64),
             "logp_old": logp_old, "logp_mu": logp_old + 0.4 * torch.randn(B, T, generator=g, dtype=F64)}
        x = {k: v.to(dtype) for k, v in x.items()}
        boot = torch.randn(B, generator=g, dtype=F64).to(dtype)
        adv, ret = copc.coupled_advantage_return(**x, loss_mask=mask, gamma=gamma, lam=lam, eta_a=0.5,
                                                 bootstrap_values=boot)
        ra, rr = coupled_reference(x["rewards"], x["values"], x["logp_old"], x["logp_mu"], mask,
                                   gamma, lam, low, high, boot)
        assert_close_to(adv, ra, dtype)
        assert_close_to(ret, rr, dtype)
        assert torch.equal(adv[~mask], torch.zeros_like(adv[~mask]))  # padding stays exactly 0


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("c", [0.95, 0.999, 0.3])
def test_long_rows_stay_finite_and_exact(c, dtype):
    """T = 20000: c^T underflows, c^-L must not overflow; float32 c^n must not compound."""
    g = torch.Generator().manual_seed(5)
    B, T = 3, 20000
    mask = torch.ones(B, T, dtype=torch.bool)  # row 0: all actions (the longest decay chain)
    mask[1] = torch.rand(T, generator=g) < 0.7
    mask[2, : T // 2] = False  # a long observation prefix
    x = torch.where(mask, 1.0 + torch.rand(B, T, generator=g, dtype=F64), 0.0).to(dtype)
    x[:, -1] = 1e4  # a large terminal value carried back through the whole row
    out = reverse_action_scan(x, mask, c)
    assert torch.isfinite(out).all()
    assert_close_to(out, g_next_loop(x, mask, c), dtype)


@pytest.mark.parametrize("a_min", [0.0, 0.9, 1e-3, 1e-40])
@pytest.mark.parametrize("N", [1, 5, 64, 65, 1000, 3000])
def test_linear_reverse_scan_matches_loop(N, a_min):
    """Both paths (doubling for short rows / no bound, rescaled groups with a bound), incl. a = 0."""
    g = torch.Generator().manual_seed(N)
    x = torch.randn(3, N, generator=g, dtype=F64)
    a = a_min + (1 - a_min) * torch.rand(3, N, generator=g, dtype=F64)
    if a_min == 0.0:
        a[:, ::7] = 0.0  # a zero decay cuts the recursion
    ref, G = torch.empty(3, N, dtype=F64), torch.zeros(3, dtype=F64)
    for p in range(N - 1, -1, -1):
        G = x[:, p] + a[:, p] * G
        ref[:, p] = G
    a_in = a.clone()
    out = linear_reverse_scan(x, a, a_min=a_min)
    assert torch.equal(a, a_in)  # decays not modified
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_non_bool_mask_equals_bool_mask():
    g = torch.Generator().manual_seed(6)
    mask = special_mask(4, 300, g)
    x = torch.where(mask, torch.randn(4, 300, generator=g), 0.0)
    assert torch.equal(reverse_action_scan(x, mask.float(), 0.95), reverse_action_scan(x, mask, 0.95))


def test_bad_input_names_the_value():
    x, m = torch.zeros(2, 8), torch.ones(2, 8, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"1\.5"):
        reverse_action_scan(x, m, 1.5)
    with pytest.raises(ValueError, match="block"):
        reverse_action_scan(x, m, 0.5, block=0)
    with pytest.raises(ValueError, match=r"\(2, 7\)"):
        reverse_action_scan(x, m[:, :7], 0.5)


def count_ops(fn) -> int:
    """Number of aten ops ``fn`` runs (torch.profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))


@pytest.mark.parametrize("c", [0.95, 0.3])
def test_op_count_does_not_grow_with_length(c):
    """No Python loop over blocks: 64× more tokens adds only a carry level or two of ops.

    (The previous blocked version ran a few ops per 64-token block: thousands at T = 2^17.)
    """
    g = torch.Generator().manual_seed(7)
    counts = []
    for T in (2048, 2 ** 17):
        mask = torch.rand(1, T, generator=g) < 0.7
        x = torch.where(mask, torch.randn(1, T, generator=g), 0.0)
        counts.append(count_ops(lambda x=x, mask=mask: reverse_action_scan(x, mask, c)))
    assert counts[1] < 2 * counts[0], counts
    assert counts[1] < 500, counts


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("c", [1e-6, 0.01, 0.3, 0.95, 0.999999])
def test_half_precision_inputs_are_scanned_in_float32(c, dtype):
    """Regression: float16 input used to give NaN for c ≤ 0.3 (c^{-16} > 65504) and raised for
    c = 1e-6; bfloat16 compounded rounding over the row (3 % error at c = 0.3). Now the result
    is the float32 scan rounded once: within one ulp of the output dtype of the exact loop."""
    g = torch.Generator().manual_seed(11)
    B, T = 4, 3000
    mask = special_mask(B, T, g)
    x = torch.where(mask, torch.randn(B, T, generator=g), 0.0).to(dtype)
    out = reverse_action_scan(x, mask, c)
    assert out.dtype == dtype
    assert torch.equal(out, reverse_action_scan(x.float(), mask, c).to(dtype))
    ref = g_next_loop(x, mask, c)
    ulp = torch.finfo(dtype).eps * ref.abs().clamp(min=1.0)
    assert bool(((out.double() - ref).abs() <= ulp).all()), float((out.double() - ref).abs().max())
    a = torch.full((B, T), c, dtype=dtype)
    G = linear_reverse_scan(x, a, a_min=c)
    assert G.dtype == dtype and bool(torch.isfinite(G).all())
    assert torch.equal(G, linear_reverse_scan(x.float(), a.float(), a_min=c).to(dtype))
