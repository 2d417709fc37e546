"""How much the π-referenced value probe can see: its noise floor and power by sample size.

On the exact toy of ``docs/research.md`` ("How much a probe can see"): a token tree (vocabulary 3,
horizon 3, ``TokenTree.random`` seed 1, staleness scale 0.75, token rewards 0.3) where the exact
V^π and V^µ are known (V^π − V^µ = −0.117 at the root). For each sample size n it draws ``--reps``
samples of n episodes from µ and evaluates :func:`copc.value_probes.probe_metrics` (the library's
estimator, pooled or not: the pooled probe of W steps of B episodes is this estimator on n = W·B)
for two critics on the same episodes, the exact V^π and the exact V^µ, and prints:

* ``noise floor`` = 2 × the median standard error of the V^π critic's signed gap (``value/se_gap``):
  a gap below it is not told from 0 at that n;
* ``q95 |gap| V^π``: the 95th percentile of the V^π critic's gap (what a perfect critic reads);
* the mean gap of each critic; the share of samples where ``|gap| > 2 SE`` for the V^π critic (false
  alarms, ~5 %) and for the V^µ critic (power);
* ``n_min`` = (2.8 σ / |V^π − V^µ|)²: the episodes for 80 % power at a two-sided 5 % test
  (σ the per-episode influence sd under µ, exact on the tree).

Run: ``.venv/bin/python scripts/value_probe_power.py`` (about 10 s on one core).
"""

from __future__ import annotations

import argparse

import torch

from copc.token_tree import TokenTree, enumerate_trajectories, state_values
from copc.value_probes import ProbeTerms, probe_metrics, probe_terms

SIZES = (16, 64, 256, 512, 1024, 4096)


def toy(seed: int = 1, staleness: float = 0.75) -> TokenTree:
    """The exact toy tree (module docstring)."""
    return TokenTree.random(3, 3, generator=torch.Generator().manual_seed(seed), staleness_scale=staleness,
                            token_reward_scale=0.3)


def trajectory_terms(tree: TokenTree) -> tuple[ProbeTerms, ProbeTerms, torch.Tensor]:
    """The probe terms of every trajectory once, with the V^π and with the V^µ critic, and µ(y) of
    each (the sampling distribution of episodes)."""
    tr = enumerate_trajectories(tree.vocab, tree.horizon)
    rewards = tree.rewards[tr.nodes, tr.tokens]
    logp_pi, logp_mu = tree.pi().log()[tr.nodes, tr.tokens], tree.mu().log()[tr.nodes, tr.tokens]
    mask = torch.ones_like(rewards, dtype=torch.bool)
    out = []
    for policy in (tree.pi(), tree.mu()):
        v, _ = state_values(tree, policy)
        out.append(probe_terms(v[tr.nodes], rewards, logp_pi, logp_mu, mask, tree.gamma))
    return out[0], out[1], tree.mu()[tr.nodes, tr.tokens].prod(1)


def rows(t: ProbeTerms, idx: torch.Tensor) -> ProbeTerms:
    """The terms of the trajectories ``idx`` (one episode each)."""
    return ProbeTerms(t.v[idx], t.r[idx], t.w[idx], t.capped[idx])


def influence_sd(t: ProbeTerms, p_mu: torch.Tensor) -> float:
    """σ of the gap's per-episode influence under µ, exact: √E_µ[(w (R − E_π[R]) / E_µ[w])²]
    (a critic constant at the root: the V̂ part is 0)."""
    w_bar = float((p_mu * t.w).sum())
    e_pi = float((p_mu * t.w * t.r).sum()) / w_bar
    return float((p_mu * (t.w * (t.r - e_pi) / w_bar) ** 2).sum()) ** 0.5


def power_table(reps: int, seed: int = 0) -> list[dict[str, float]]:
    """One row per n in :data:`SIZES` (module docstring); seeded."""
    tree = toy()
    t_pi, t_mu, p_mu = trajectory_terms(tree)
    g = torch.Generator().manual_seed(seed)
    table = []
    for n in SIZES:
        gaps = {"pi": [], "mu": []}
        se, hits = [], {"pi": 0, "mu": 0}
        for _ in range(reps):
            idx = torch.multinomial(p_mu, n, replacement=True, generator=g)
            for name, t in (("pi", t_pi), ("mu", t_mu)):
                m = probe_metrics(rows(t, idx))
                gaps[name].append(m["value/policy_value_gap"])
                hits[name] += m["value/policy_value_gap"] > 2 * m["value/se_gap"]
                if name == "pi":
                    se.append(m["value/se_gap"])
        g_pi = torch.tensor(gaps["pi"], dtype=torch.float64)
        table.append({"n": n, "noise_floor": 2 * float(torch.tensor(se).median()),
                      "q95_pi": float(g_pi.quantile(0.95)), "mean_pi": float(g_pi.mean()),
                      "mean_mu": sum(gaps["mu"]) / reps, "alarm_pi": hits["pi"] / reps,
                      "power_mu": hits["mu"] / reps})
    return table


def main() -> None:
    """Print the table (markdown) and the toy's exact figures."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=1000, help="samples per size (default 1000)")
    reps = ap.parse_args().reps
    tree = toy()
    v_pi, _ = state_values(tree, tree.pi())
    v_mu, _ = state_values(tree, tree.mu())
    delta = float(v_pi[0] - v_mu[0])
    t_pi, _, p_mu = trajectory_terms(tree)
    sigma = influence_sd(t_pi, p_mu)
    print(f"toy: V^pi - V^mu = {delta:.3f} at the root; influence sd sigma = {sigma:.3f}; "
          f"n_min (80% power, 2-sided 5%) = (2.8 sigma / |delta|)^2 = {(2.8 * sigma / abs(delta)) ** 2:.0f}; "
          f"noise floor 2 sigma / sqrt(n)")
    print("| n episodes | noise floor 2·SE | q95 \\|gap\\| V^π | mean gap V^π | mean gap V^µ | "
          "V^π \\|gap\\| > 2 SE | V^µ \\|gap\\| > 2 SE |")
    print("|---|---|---|---|---|---|---|")
    for r in power_table(reps):
        print(f"| {r['n']} | {r['noise_floor']:.3f} | {r['q95_pi']:.3f} | {r['mean_pi']:.3f} | "
              f"{r['mean_mu']:.3f} | {r['alarm_pi']:.2f} | {r['power_mu']:.2f} |")


if __name__ == "__main__":
    main()
