"""A tractable token-level model for the paper's Propositions 2–3: a finite-horizon tree MDP.

Each trajectory is ``H`` tokens from a vocabulary of ``V``; the state before token ``t`` is
the prefix ``(y_0, …, y_{t−1})``, so the states form a ``V``-ary tree with
``N = Σ_{h<H} V^h`` internal nodes. Policies are per-node softmaxes of logits:

* the current policy π_θ with ``θ = pi_logits`` (the learner's policy, ``(N, V)``);
* the behavior policy µ with ``mu_logits`` (the stale rollout policy).

Because each node is visited at most once per trajectory, everything the analysis needs is
an exact finite sum over the ``V^H`` trajectories; nothing is sampled. All tensors are
float64 ``torch`` tensors. Nodes are numbered depth by depth: the prefix
``(y_0, …, y_{h−1})`` has index ``offset(h) + Σ_i y_i V^{h−1−i}`` with
``offset(h) = (V^h − 1)/(V − 1)``; its children ``(…, a)`` are consecutive at depth ``h+1``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._checks import check_number, check_unit_interval
from .margins import EPS_HIGH, EPS_LOW, margins

Tensor = torch.Tensor

#: Largest number of trajectories ``V^H`` a tree may have (exact enumeration stays cheap).
MAX_TRAJECTORIES = 1 << 16


def num_nodes(vocab: int, horizon: int) -> int:
    """Number of internal nodes (prefixes of length ``0 … H−1``) ``Σ_{h<H} V^h``."""
    return sum(vocab ** h for h in range(horizon))


def _offsets(vocab: int, horizon: int) -> list[int]:
    """``offset(h)`` for ``h = 0 … H``: index of the first node at depth ``h``."""
    return [num_nodes(vocab, h) for h in range(horizon + 1)]


def _check_tensor(name: str, x: object, shape: tuple[int, ...]) -> None:
    """Raise unless ``x`` is a finite float64 tensor of ``shape``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.float64:
        raise TypeError(f"{name} must be float64, got {x.dtype}")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} must be finite (found NaN or inf)")


@dataclass(frozen=True)
class TokenTree:
    """A finite-horizon token tree MDP with behavior policy µ, current policy π and a critic V̂.

    Attributes:
        vocab: vocabulary size ``V ≥ 2``.
        horizon: tokens per trajectory ``H ≥ 1`` (|y| = H for every trajectory).
        pi_logits: ``(N, V)`` float64 logits θ of the current policy π_θ(·|s) = softmax(θ_s).
        mu_logits: ``(N, V)`` float64 logits of the behavior policy µ(·|s).
        rewards: ``(N, V)`` float64 reward r(s, a) received when token ``a`` is emitted at
            prefix ``s``; an outcome reward lives on the depth ``H−1`` nodes (the leaf).
        critic: ``(N,)`` float64 critic value V̂(s) of each prefix (value after the last token is 0).
        gamma: discount γ ∈ [0, 1] per token.
        lam: trace / GAE λ ∈ [0, 1].
        eps_low, eps_high: base margins ε_ℓ ∈ [0, 1], ε_h ≥ 0 (spec "Margins").

    Raises:
        ValueError: if ``V < 2``, ``H < 1``, ``V^H > MAX_TRAJECTORIES``, a tensor has the wrong
            shape or a non-finite entry, or γ, λ, ε_ℓ, ε_h are out of range (the message names
            the field and value).
        TypeError: if a tensor field is not a float64 tensor.
    """

    vocab: int
    horizon: int
    pi_logits: Tensor
    mu_logits: Tensor
    rewards: Tensor
    critic: Tensor
    gamma: float = 1.0
    lam: float = 1.0
    eps_low: float = EPS_LOW
    eps_high: float = EPS_HIGH

    def __post_init__(self) -> None:
        """Validate sizes, tensor shapes/dtypes/finiteness and the hyper-parameters."""
        for name in ("vocab", "horizon"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {v!r}")
        if self.vocab < 2:
            raise ValueError(f"vocab must be >= 2, got {self.vocab}")
        if self.horizon < 1:
            raise ValueError(f"horizon must be >= 1, got {self.horizon}")
        if self.vocab ** self.horizon > MAX_TRAJECTORIES:
            raise ValueError(f"vocab**horizon = {self.vocab}**{self.horizon} = {self.vocab ** self.horizon} "
                             f"trajectories exceeds MAX_TRAJECTORIES = {MAX_TRAJECTORIES}")
        n = num_nodes(self.vocab, self.horizon)
        for name in ("pi_logits", "mu_logits", "rewards"):
            _check_tensor(name, getattr(self, name), (n, self.vocab))
        _check_tensor("critic", self.critic, (n,))
        check_unit_interval("gamma", self.gamma)
        check_unit_interval("lam", self.lam)
        margins(1.0, self.eps_low, self.eps_high)  # validates ε_ℓ ∈ [0, 1], ε_h ≥ 0

    @property
    def n_nodes(self) -> int:
        """Number of internal nodes ``N`` (= rows of the logits)."""
        return num_nodes(self.vocab, self.horizon)

    @property
    def n_trajectories(self) -> int:
        """Number of trajectories ``K = V^H``."""
        return self.vocab ** self.horizon

    def pi(self) -> Tensor:
        """``(N, V)`` float64 current policy π_θ(a|s)."""
        return torch.softmax(self.pi_logits, -1)

    def mu(self) -> Tensor:
        """``(N, V)`` float64 behavior policy µ(a|s)."""
        return torch.softmax(self.mu_logits, -1)

    def replace(self, **changes: object) -> TokenTree:
        """A copy with some fields replaced (validated again)."""
        fields = {k: getattr(self, k) for k in self.__dataclass_fields__}
        fields.update(changes)
        return TokenTree(**fields)

    @staticmethod
    def random(vocab: int, horizon: int, *, generator: torch.Generator, staleness_scale: float = 0.5,
               critic_noise: float = 0.1, critic_lag: float = 0.0, logit_scale: float = 1.0,
               token_reward_scale: float = 0.0, gamma: float = 1.0, lam: float = 1.0,
               eps_low: float = EPS_LOW, eps_high: float = EPS_HIGH) -> TokenTree:
        """A random tree: π logits ~ N(0, logit_scale²), µ = π perturbed, binary outcome reward.

        * ``mu_logits = pi_logits + staleness_scale · N(0, 1)``: the policy drift between the
          rollout policy and the learner (a proxy for staleness; 0 gives µ = π).
        * Outcome reward ∈ {0, 1} (Bernoulli(½)) on each leaf (last token), plus
          ``token_reward_scale · N(0, 1)`` on every (prefix, token) when that is > 0.
        * Critic ``V̂ = (1 − critic_lag)·V^π + critic_lag·V^µ + critic_noise · N(0, 1)`` per
          prefix: ``critic_lag`` models a critic still fitting the stale policy's returns.

        Args:
            vocab, horizon: ``V ≥ 2``, ``H ≥ 1``.
            generator: seeded ``torch.Generator`` (all draws come from it, in a fixed order).
            staleness_scale, critic_noise, logit_scale, token_reward_scale: scales ≥ 0.
            critic_lag: ∈ [0, 1].
            gamma, lam, eps_low, eps_high: as the attributes.

        Returns:
            A validated :class:`TokenTree`.

        Raises:
            ValueError: on a negative scale, ``critic_lag`` outside [0, 1], or any error of
                :class:`TokenTree`.
        """
        for name, v in (("staleness_scale", staleness_scale), ("critic_noise", critic_noise),
                        ("logit_scale", logit_scale), ("token_reward_scale", token_reward_scale)):
            x = check_number(name, v)
            if not (x >= 0.0 and math.isfinite(x)):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        check_unit_interval("critic_lag", critic_lag)
        if not (isinstance(vocab, int) and isinstance(horizon, int) and vocab >= 2 and horizon >= 1):
            raise ValueError(f"vocab must be an int >= 2 and horizon an int >= 1, got {vocab!r}, {horizon!r}")
        if vocab ** horizon > MAX_TRAJECTORIES:
            raise ValueError(f"vocab**horizon = {vocab ** horizon} exceeds "
                             f"MAX_TRAJECTORIES = {MAX_TRAJECTORIES}")
        n = num_nodes(vocab, horizon)
        f64 = torch.float64

        def normal(*shape: int) -> Tensor:
            return torch.randn(*shape, dtype=f64, generator=generator)

        pi_logits = logit_scale * normal(n, vocab)
        mu_logits = pi_logits + staleness_scale * normal(n, vocab)
        rewards = torch.zeros(n, vocab, dtype=f64)
        leaf = slice(num_nodes(vocab, horizon - 1), n)
        rewards[leaf] = (torch.rand(n - leaf.start, vocab, dtype=f64, generator=generator) < 0.5).to(f64)
        if token_reward_scale > 0.0:
            rewards = rewards + token_reward_scale * normal(n, vocab)
        noise = normal(n)
        base = TokenTree(vocab, horizon, pi_logits, mu_logits, rewards, torch.zeros(n, dtype=f64),
                         gamma, lam, eps_low, eps_high)
        v_pi = state_values(base, base.pi())[0]
        v_mu = state_values(base, base.mu())[0]
        critic = (1.0 - critic_lag) * v_pi + critic_lag * v_mu + critic_noise * noise
        return base.replace(critic=critic)


def state_values(tree: TokenTree, policy: Tensor) -> tuple[Tensor, Tensor]:
    """Exact ``V^policy(s)`` and ``Q^policy(s, a)`` by backward induction over depth.

    ``Q(s, a) = r(s, a) + γ V(s·a)`` (``V = 0`` after the last token) and
    ``V(s) = Σ_a policy(a|s) Q(s, a)`` (Bellman expectation equation; Sutton & Barto eq. 3.14).

    Args:
        tree: the token tree.
        policy: ``(N, V)`` float64 action probabilities per prefix (e.g. ``tree.pi()``).

    Returns:
        ``(V, Q)``: ``(N,)`` and ``(N, V)`` float64.

    Raises:
        ValueError: if ``policy`` does not have shape ``(N, V)``.
    """
    V, H = tree.vocab, tree.horizon
    if tuple(policy.shape) != (tree.n_nodes, V):
        raise ValueError(f"policy must have shape {(tree.n_nodes, V)}, got {tuple(policy.shape)}")
    off = _offsets(V, H)
    values = policy.new_zeros(tree.n_nodes)
    q = policy.new_zeros(tree.n_nodes, V)
    v_next = policy.new_zeros(V ** H)  # values after the last token
    for h in range(H - 1, -1, -1):
        rows = slice(off[h], off[h + 1])
        q_h = tree.rewards[rows] + tree.gamma * v_next.reshape(V ** h, V)
        v_h = (policy[rows] * q_h).sum(-1)
        q = torch.cat([q[: rows.start], q_h, q[rows.stop:]])
        values = torch.cat([values[: rows.start], v_h, values[rows.stop:]])
        v_next = v_h
    return values, q


@dataclass(frozen=True)
class Trajectories:
    """All ``K = V^H`` trajectories of a tree, as ``(K, H)`` tensors.

    Attributes:
        tokens: ``(K, H)`` int64 token ``y_t``.
        nodes: ``(K, H)`` int64 index of the prefix node ``s_t``.
        keys: ``(K, H)`` int64 flat index ``s_t · V + y_t`` of the (state, action) pair.
    """

    tokens: Tensor
    nodes: Tensor
    keys: Tensor


def enumerate_trajectories(vocab: int, horizon: int) -> Trajectories:
    """Every token sequence of length ``H`` in lexicographic order (trajectory k ↔ base-V digits of k).

    Args:
        vocab, horizon: ``V ≥ 2``, ``H ≥ 1``.

    Returns:
        :class:`Trajectories`.
    """
    k = torch.arange(vocab ** horizon, dtype=torch.int64)
    off = _offsets(vocab, horizon)
    tokens = torch.stack([(k // vocab ** (horizon - 1 - t)) % vocab for t in range(horizon)], 1)
    nodes = torch.stack([off[t] + k // vocab ** (horizon - t) for t in range(horizon)], 1)
    return Trajectories(tokens, nodes, nodes * vocab + tokens)


def policy_objective(tree: TokenTree, theta: Tensor) -> Tensor:
    """Exact expected discounted return ``J(θ) = E_{y∼π_θ}[Σ_t γ^t r(s_t, y_t)]`` (differentiable).

    Args:
        tree: the token tree (its rewards and γ are used; its logits are not).
        theta: ``(N, V)`` float64 policy logits (may require grad).

    Returns:
        0-d float64 tensor.
    """
    traj = enumerate_trajectories(tree.vocab, tree.horizon)
    logp = torch.log_softmax(theta, -1).reshape(-1)[traj.keys]
    disc = tree.gamma ** torch.arange(tree.horizon, dtype=torch.float64)
    ret = (tree.rewards.reshape(-1)[traj.keys] * disc).sum(1)
    return (logp.sum(1).exp() * ret).sum()
