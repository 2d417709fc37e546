"""Vectorised scans over the action tokens of a ``(B, T)`` batch.

The advantage channel runs a recursion over *action tokens only*: observation
tokens (``loss_mask == 0``) between two action tokens are skipped, not
discounted per token (spec, "Setting"). These helpers do that without
compacting the batch and without a Python loop over tokens:

* :func:`action_block_bounds` — first/last action token of every turn.
* :func:`fold_observation_rewards` — reward on observation tokens moved onto the
  preceding action token (spec, "Setting", **(choice)**).
* :func:`td_residuals` — ``δ_t = r_t + γ V_{next action} − V_t``.
* :func:`reverse_action_scan` — ``G_t = x_t + c · G_{next action}``, blocked so
  the work is one ``cumsum`` and a few dense passes.

Every pass over the ``(B, T)`` tensors costs about as much as the ``cumsum``
floor, so these functions are written to make as few as possible; work that
only concerns turn boundaries is done on the ``K`` boundary positions.
"""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor

#: Tokens per block in :func:`reverse_action_scan` (capped further for small ``c``).
DEFAULT_BLOCK = 256
#: Block length of the matmul used when ``c < 1``.
MATMUL_BLOCK = 64


def action_block_bounds(mask: Tensor) -> tuple[Tensor, Tensor]:
    """Flat indices of the first and last action token of every turn (action block).

    A turn's last token is an action token followed by a non-action token or the row
    end; its first token is an action token preceded by a non-action token or the row
    start. One ``nonzero`` over the ``(B, T − 1)`` transitions finds both.

    Args:
        mask: ``(B, T)`` bool, True on action tokens.

    Returns:
        ``(starts, ends)``: sorted ``(K,)`` int64 flat indices ``b * T + t``.
    """
    B, T = mask.shape
    row = torch.arange(B, device=mask.device) * T
    chg = (mask[:, 1:] != mask[:, :-1]).nonzero()  # change between t and t + 1
    flat = chg[:, 0] * T + chg[:, 1]
    is_end = mask.reshape(-1)[flat]
    ends = torch.cat([flat[is_end], (row + T - 1)[mask[:, -1]]])
    starts = torch.cat([flat[~is_end] + 1, row[mask[:, 0]]])
    return starts.sort().values, ends.sort().values


def fold_observation_rewards(rewards: Tensor, mask: Tensor, ends: Tensor,
                             mode: str = "fold") -> Tensor:
    """Reward of each turn's last action token after folding observation rewards onto it.

    Reward on an observation token moves onto the preceding action token (spec
    "Setting", **(choice)**). The preceding action token of any observation token
    is the last token of a turn, so only those ``K`` positions change:
    ``out[k] = rewards[ends[k]] + Σ rewards[p]`` over the observation tokens ``p``
    after turn ``k`` (up to the next turn or the row end), accumulated left to right.

    Args:
        rewards: ``(B, T)`` float reward per token.
        mask: ``(B, T)`` bool action-token mask.
        ends: ``(K,)`` sorted flat indices of turn ends (:func:`action_block_bounds`).
        mode: ``"fold"`` (default) or ``"error"``: refuse any reward on an observation token.

    Returns:
        ``(K,)`` tensor with ``rewards.dtype``.

    Raises:
        ValueError: in ``"error"`` mode, for any non-zero reward on an observation token;
            in ``"fold"`` mode, for one with no action token before it in its row (it
            cannot be attributed, and dropping it would silently lose reward); for an
            unknown ``mode``.
    """
    if mode not in ("fold", "error"):
        raise ValueError(f"obs_reward must be 'fold' or 'error', got {mode!r}")
    flat_r = rewards.reshape(-1)
    out = flat_r[ends]
    nz = flat_r.nonzero().squeeze(1)  # rewards are sparse: this is the only dense pass
    pos = nz[~mask.reshape(-1)[nz]]
    if pos.numel() == 0:
        return out
    T = rewards.shape[1]

    def where_(p: int) -> str:
        return f"rewards[{p // T}, {p % T}] = {flat_r[p].item()!r}"

    if mode == "error":
        raise ValueError(f"{where_(int(pos[0]))} is on an observation token and obs_reward='error'")
    k = torch.searchsorted(ends, pos, right=True) - 1
    owner = ends[k.clamp(min=0)]
    ok = (k >= 0) & (torch.div(owner, T, rounding_mode="floor") == torch.div(pos, T, rounding_mode="floor"))
    if not bool(ok.all()):
        raise ValueError(f"{where_(int(pos[~ok][0]))} is on an observation token with no preceding "
                         "action token in its row; it cannot be attributed")
    return out.index_add_(0, k, flat_r[pos])


def td_residuals(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float,
                 bootstrap: Tensor | None, starts: Tensor, ends: Tensor,
                 obs_reward: str = "fold", obs_discount: str = "skip") -> Tensor:
    """TD residuals ``δ_t = r_t + γ V_{n(t)} − V_t`` at action tokens (spec "Setting").

    ``n(t)`` is the next action token of the row (observation tokens skipped, not
    discounted); after the last action token V is ``bootstrap[b]`` (0 when None);
    ``r`` is the reward after :func:`fold_observation_rewards`. Entries at
    non-action positions are unspecified (may be garbage).

    Args:
        rewards: ``(B, T)`` float reward per token.
        values: ``(B, T)`` float V(s_t); read at action tokens only.
        mask: ``(B, T)`` bool action-token mask.
        gamma: γ ∈ [0, 1].
        bootstrap: optional ``(B,)`` value after the last action token.
        starts, ends: from :func:`action_block_bounds`.
        obs_reward: see :func:`fold_observation_rewards`.
        obs_discount: ``"skip"`` (default): observation tokens between two action tokens are
            not discounted; ``"per_token"``: ``γ`` applies per token, so the next action
            token ``d`` tokens later is discounted by ``γ^d`` (spec "Setting", (choice)).

    Returns:
        ``(B, T)`` contiguous tensor with ``values.dtype``.

    Raises:
        ValueError: as :func:`fold_observation_rewards`.
    """
    T = values.shape[1]
    r = rewards if rewards.dtype == values.dtype else rewards.to(values.dtype)
    delta = torch.sub(r, values).contiguous()
    # interior action tokens: the next token is the next action token
    delta[:, :-1].add_(values[:, 1:], alpha=gamma)
    if ends.numel() == 0:
        return delta
    # turn ends: next action token is the next turn's first token, else the bootstrap value
    j = torch.searchsorted(starts, ends, right=True)
    row = torch.div(ends, T, rounding_mode="floor")
    nxt = starts[j.clamp(max=max(starts.numel() - 1, 0))]
    has_next = (j < starts.numel()) & (torch.div(nxt, T, rounding_mode="floor") == row)
    flat_v = values.reshape(-1)
    after = torch.zeros_like(flat_v[ends]) if bootstrap is None else bootstrap.to(values.dtype)[row]
    v_next = torch.where(has_next, flat_v[nxt], after)
    r_end = fold_observation_rewards(r, mask, ends, obs_reward)
    disc = gamma
    if obs_discount == "per_token":
        dist = torch.where(has_next, nxt - ends, torch.ones_like(ends)).to(values.dtype)
        disc = torch.pow(torch.tensor(gamma, dtype=values.dtype), dist)
    delta.view(-1)[ends] = r_end + disc * v_next - flat_v[ends]
    return delta


def _block_size(c: float, dtype: torch.dtype, block: int) -> int:
    """Largest block for which ``c ** -block`` stays well inside ``dtype``'s range."""
    if c >= 1.0:
        return block
    # keep c**L >= 10**-safe so rescaling by c**-L neither overflows nor hits subnormals
    safe = 25.0 if dtype in (torch.float32, torch.bfloat16, torch.float16) else 250.0
    return max(1, min(block, int(safe / -math.log10(c))))


def reverse_action_scan(x: Tensor, mask: Tensor, c: float, *, block: int = DEFAULT_BLOCK) -> Tensor:
    """Discounted reverse cumulative sums over action tokens, observation tokens skipped.

    ``G_t = x_t + c · G_{n(t)}`` over action tokens (``n(t)`` the next action token,
    ``G`` after the last one = 0); spec "Advantage channel", ``G_t``. Returns
    ``G_next``, where ``G_next[p]`` is ``G`` at the first action token after position
    ``p`` (0 if none); ``G_t = x_t + c · G_next[t]`` at action tokens.

    Implementation: blocks of ``L`` tokens, chained right to left through their carries
    ``H`` (a loop over ``T / L`` blocks, never over tokens). ``c == 1``: inside block
    ``i``, ``G_next[p] = H_i − cumsum(x)_p`` (one ``cumsum`` and one pass; a prefix never
    spans more than a block, which keeps float32 cancellation small; at a block's last
    token this is ``H_{i+1}``, so no boundary case). ``0 < c < 1``: with ``Ex`` the count
    of earlier action tokens in the block, ``S = U · (c^{Ex} x)`` with ``U``
    upper-triangular ones (a matmul, since total − prefix would cancel catastrophically
    for decaying weights) and ``G = c^{−Ex} (S + c^{n_block} H_next)``.

    Args:
        x: ``(B, T)`` float; must be 0 at non-action positions.
        mask: ``(B, T)`` bool action-token mask (only read when ``0 < c < 1``); pass all-True
            to discount per token position instead (``obs_discount="per_token"``).
        c: discount per action token, ``γλ``, in ``[0, 1]``.
        block: maximum block length in tokens.

    Returns:
        ``G_next``, ``(B, T)`` with the dtype of ``x`` (a new tensor, possibly a view of a
        padded buffer).

    Raises:
        ValueError: if ``c`` is outside ``[0, 1]``.
    """
    if not 0.0 <= c <= 1.0:
        raise ValueError(f"discount c = gamma * lam must be in [0, 1], got {c!r}")
    B, T = x.shape
    if c == 1.0:
        L = min(block, T)
        nb = -(-T // L)
        pad = nb * L - T
        xb = (torch.nn.functional.pad(x, (0, pad)) if pad else x).view(B, nb, L)
        cs = xb.cumsum(2)
        H = cs[:, :, -1].flip(1).cumsum(1).flip(1)  # G at the start of each block
        return torch.sub(H.unsqueeze(2), cs, out=cs).view(B, nb * L)[:, :T]  # in place
    if c == 0.0:
        g = x.clone()
    else:
        L = min(_block_size(c, x.dtype, min(block, MATMUL_BLOCK)), T)
        nb = -(-T // L)
        pad = nb * L - T
        xb = (torch.nn.functional.pad(x, (0, pad)) if pad else x).view(B, nb, L)
        mb = (torch.nn.functional.pad(mask, (0, pad)) if pad else mask).view(B, nb, L)
        ex = mb.cumsum(2, dtype=x.dtype)
        decay = torch.pow(c, ex[:, :, -1])  # c^{action tokens in the block}
        w = ex.sub_(mb.to(x.dtype)).mul_(math.log(c)).exp_()  # c^{Ex}
        upper = torch.ones(L, L, dtype=x.dtype, device=x.device).tril_()  # [j, k] = 1 if j >= k
        s = (xb * w) @ upper
        H = torch.zeros(B, nb + 1, dtype=x.dtype, device=x.device)
        for i in range(nb - 1, -1, -1):  # loop over blocks, not tokens
            H[:, i] = s[:, i, 0] + decay[:, i] * H[:, i + 1]
        g = s.add_((decay * H[:, 1:]).unsqueeze(2)).div_(w).view(B, nb * L)[:, :T]
    g_next = torch.zeros_like(g)
    g_next[:, :-1] = g[:, 1:]
    return g_next
