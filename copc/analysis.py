"""Exact tabular tools for the paper's Proposition 1 (spec, "What the paper proves").

On a finite MDP the expectation over behavior trajectories of COPC's corrected
return has a closed form, so its fixed point can be checked to machine
precision. All tensors are float64 ``torch`` tensors; no sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class TabularMDP:
    """A finite discounted MDP.

    Attributes:
        transitions: ``(S, A, S)`` float64, ``P(s' | s, a)``; rows sum to 1.
        rewards: ``(S, A)`` float64 expected reward ``r(s, a)``.
        gamma: discount γ ∈ [0, 1).

    Raises:
        ValueError: on inconsistent shapes, rows that do not sum to 1, or γ outside [0, 1).
    """

    transitions: Tensor
    rewards: Tensor
    gamma: float

    def __post_init__(self) -> None:
        """Validate shapes, stochasticity and γ."""
        P, r = self.transitions, self.rewards
        if P.dim() != 3 or P.shape[0] != P.shape[2] or r.shape != P.shape[:2]:
            raise ValueError(f"transitions must be (S, A, S) and rewards (S, A); got "
                             f"{tuple(P.shape)} and {tuple(r.shape)}")
        if not torch.allclose(P.sum(-1), torch.ones_like(P[..., 0]), atol=1e-12):
            raise ValueError("transitions: every P(. | s, a) must sum to 1")
        if not 0.0 <= self.gamma < 1.0:
            raise ValueError(f"gamma must be in [0, 1), got {self.gamma!r}")

    @staticmethod
    def random(n_states: int, n_actions: int, gamma: float, generator: torch.Generator
               ) -> TabularMDP:
        """A random dense MDP (Dirichlet(1) transitions, N(0, 1) rewards) for tests."""
        P = _dirichlet(n_states, n_actions, generator)
        r = torch.randn(n_states, n_actions, dtype=torch.float64, generator=generator)
        return TabularMDP(P, r, gamma)


def _dirichlet(S: int, A: int, g: torch.Generator) -> Tensor:
    """Dirichlet(1) rows from a seeded generator (normalised exponentials)."""
    e = -torch.log(torch.rand(S, A, S, dtype=torch.float64, generator=g))
    return e / e.sum(-1, keepdim=True)


def target_policy(mu: Tensor, pi: Tensor, low: float, high: float) -> Tensor:
    """π̃(a|s) ∝ µ(a|s) · clip(π(a|s)/µ(a|s), low, high) (COPC paper, Proposition 1).

    Args:
        mu, pi: ``(S, A)`` float64 policies (rows sum to 1, ``mu > 0``).
        low, high: the advantage-channel interval (``0, inf`` = unclipped → π; ``1, 1`` → µ).

    Returns:
        ``(S, A)`` float64 policy.
    """
    w = mu * (pi / mu).clamp(low, high)
    return w / w.sum(1, keepdim=True)


def solve_value(mdp: TabularMDP, policy: Tensor) -> Tensor:
    """V^policy by a linear solve: ``V = (I − γ P_π)^{-1} r_π`` (Bellman equation; Sutton & Barto eq. 4.4).

    Args:
        mdp: the MDP.
        policy: ``(S, A)`` float64.

    Returns:
        ``(S,)`` float64.
    """
    P_pi = torch.einsum("sa,sat->st", policy, mdp.transitions)
    r_pi = (policy * mdp.rewards).sum(1)
    eye = torch.eye(P_pi.shape[0], dtype=torch.float64)
    return torch.linalg.solve(eye - mdp.gamma * P_pi, r_pi)


def corrected_return_operator(mdp: TabularMDP, V: Tensor, mu: Tensor, pi: Tensor, low: float,
                              high: float, lam: float) -> Tensor:
    """One application of the expected corrected-return operator (spec, Proposition 1).

    ``(𝒯V)(s) = V(s) + E_µ[Σ_t (γλ)^t ρ̄_t δ_t | s_0 = s]`` with
    ``ρ̄ = clip(π/µ, low, high)`` and ``δ_t = r_t + γ V(s_{t+1}) − V(s_t)``.
    In closed form ``𝒯V = V + (I − γλ P_µ)^{-1} e`` where
    ``e(s) = Σ_a µ(a|s) ρ̄(s,a) (r(s,a) + γ Σ_{s'} P(s'|s,a) V(s') − V(s))``.

    Args:
        mdp: the MDP.
        V: ``(S,)`` float64 current value estimate.
        mu, pi: ``(S, A)`` behavior and target policies.
        low, high: the clip interval of ρ̄.
        lam: trace λ ∈ [0, 1].

    Returns:
        ``(S,)`` float64 ``𝒯V``.
    """
    rho_bar = (pi / mu).clamp(low, high)
    q = mdp.rewards + mdp.gamma * torch.einsum("sat,t->sa", mdp.transitions, V)
    e = (mu * rho_bar * (q - V[:, None])).sum(1)
    P_mu = torch.einsum("sa,sat->st", mu, mdp.transitions)
    eye = torch.eye(P_mu.shape[0], dtype=torch.float64)
    return V + torch.linalg.solve(eye - mdp.gamma * lam * P_mu, e)
