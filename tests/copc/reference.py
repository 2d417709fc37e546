"""Slow, obviously-correct per-token reference loops for the advantage estimators.

Written straight from docs/algorithm.md, one row and one action token at a time,
in float64 Python scalars. Used only by the tests.
"""

from __future__ import annotations

import math

import torch


def _rows(rewards, values, mask, logp_old=None, logp_mu=None, bootstrap=None):
    B, T = mask.shape
    for b in range(B):
        acts = [t for t in range(T) if bool(mask[b, t])]
        r = {t: float(rewards[b, t]) for t in acts}
        for t in range(T):  # fold observation rewards onto the preceding action token
            if not bool(mask[b, t]) and float(rewards[b, t]) != 0.0:
                prev = [a for a in acts if a < t]
                assert prev, "unattributable reward"
                r[prev[-1]] += float(rewards[b, t])
        v = [float(values[b, t]) for t in acts]
        v_after = 0.0 if bootstrap is None else float(bootstrap[b])
        ratio = None
        if logp_old is not None:
            ratio = [math.exp(float(logp_old[b, t]) - float(logp_mu[b, t])) for t in acts]
        yield b, acts, [r[t] for t in acts], v, v_after, ratio


def coupled_reference(rewards, values, logp_old, logp_mu, mask, gamma, lam, low, high,
                      bootstrap=None, per_token=False):
    """G_t = clip(ρ_t) δ_t + γλ G_{t+1} over action tokens; returns (adv, ret) float64.

    ``per_token``: the step from action token t to the next one, d tokens later, is
    discounted by γ^d (and the trace by (γλ)^d) instead of γ (γλ).
    """
    adv = torch.zeros(mask.shape, dtype=torch.float64)
    ret = torch.zeros(mask.shape, dtype=torch.float64)
    for b, acts, r, v, v_after, ratio in _rows(rewards, values, mask, logp_old, logp_mu, bootstrap):
        G_next = 0.0
        for k in range(len(acts) - 1, -1, -1):
            v_next = v[k + 1] if k + 1 < len(acts) else v_after
            d = acts[k + 1] - acts[k] if (per_token and k + 1 < len(acts)) else 1
            delta = r[k] + gamma**d * v_next - v[k]
            rho_bar = 1.0 if ratio is None else min(max(ratio[k], low), high)
            adv[b, acts[k]] = delta + (gamma * lam) ** d * G_next
            G = rho_bar * delta + (gamma * lam) ** d * G_next
            ret[b, acts[k]] = v[k] + G
            G_next = G
    return adv, ret


def vtrace_reference(rewards, values, logp_old, logp_mu, mask, gamma, lam, rho_clip, c_clip,
                     bootstrap=None):
    """V-trace (Espeholt et al. 2018) over action tokens; returns (adv, ret) float64."""
    adv = torch.zeros(mask.shape, dtype=torch.float64)
    ret = torch.zeros(mask.shape, dtype=torch.float64)
    for b, acts, r, v, v_after, ratio in _rows(rewards, values, mask, logp_old, logp_mu, bootstrap):
        n = len(acts)
        vs = [0.0] * (n + 1)
        vs[n] = v_after
        V = [*v, v_after]
        for k in range(n - 1, -1, -1):
            rho = min(rho_clip, ratio[k])
            c = lam * min(c_clip, ratio[k])
            delta = r[k] + gamma * V[k + 1] - V[k]
            vs[k] = V[k] + rho * delta + gamma * c * (vs[k + 1] - V[k + 1])
        for k in range(n):
            rho = min(rho_clip, ratio[k])
            ret[b, acts[k]] = vs[k]
            adv[b, acts[k]] = rho * (r[k] + gamma * vs[k + 1] - V[k])
    return adv, ret


def random_multiturn_mask(B: int, T: int, g: torch.Generator, obs_frac: float = 0.3) -> torch.Tensor:
    """Rows of alternating action/observation blocks with padding; some rows special."""
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):
        length = int(torch.randint(1, T + 1, (1,), generator=g))
        t, action = 0, True
        while t < length:
            blk = int(torch.randint(1, max(2, T // 4), (1,), generator=g))
            if action:
                mask[b, t:min(t + blk, length)] = True
            t += blk
            action = bool(torch.rand(1, generator=g) > obs_frac) if not action else False
            action = action or not mask[b].any()
    return mask


def brace_reference(rewards, values, logp_old, logp_mu, mask, gamma, lam, rho_clip, c_clip, k,
                    bootstrap=None, tail="product_kept"):
    """BRACE, written from its description (docs/algorithm.md, "BRACE"), not from the recursion:
    ``v_t = V_t + Σ_{j≥t} γ^{j−t} (Π_{i=t}^{j−1} c̃_i) ρ̃_j δ_j`` with ``c̃_i, ρ̃_j`` the V-trace
    factors on the first ``k`` action tokens ``t … t+k−1`` and 1 beyond them (O(n²) per row);
    ``tail="literal"``: a residual beyond the prefix (``j ≥ t + k``) has weight ``γ^{j−t}``, the
    product of traces dropped; advantages ``ρ_t (r_t + γ v_{t+1} − V_t)``. Returns (adv, ret) float64."""
    adv = torch.zeros(mask.shape, dtype=torch.float64)
    ret = torch.zeros(mask.shape, dtype=torch.float64)
    for b, acts, r, v, v_after, ratio in _rows(rewards, values, mask, logp_old, logp_mu, bootstrap):
        n = len(acts)
        V = [*v, v_after]
        delta = [r[s] + gamma * V[s + 1] - V[s] for s in range(n)]
        vs = [0.0] * (n + 1)
        vs[n] = v_after
        for t in range(n):
            total, trace = 0.0, 1.0
            for j in range(t, n):
                in_cap = j - t < k
                rho_j = min(rho_clip, ratio[j]) if in_cap else 1.0
                weight = trace if in_cap or tail == "product_kept" else 1.0
                total += gamma ** (j - t) * weight * rho_j * delta[j]
                trace *= lam * min(c_clip, ratio[j]) if in_cap else 1.0
            vs[t] = V[t] + total
        for t in range(n):
            ret[b, acts[t]] = vs[t]
            adv[b, acts[t]] = min(rho_clip, ratio[t]) * (r[t] + gamma * vs[t + 1] - V[t])
    return adv, ret
