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
  the work is one ``cumsum`` (``c = 1``) or one small matmul (``c < 1``) and a few
  dense passes.
* :func:`linear_reverse_scan` — ``G_p = x_p + a_p G_{p+1}`` for any decays ``a``
  (the block carries), in a few vectorised ops.

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
#: Block length of the matmul used when ``0 < c < 1`` (capped further for small ``c``).
MATMUL_BLOCK = 16
#: Group length of the rescaled level of :func:`linear_reverse_scan` (the block carries).
CARRY_BLOCK = 32
#: Inputs of these dtypes are scanned in float32 and the result cast back: float16 cannot hold
#: the rescaling factors ``c^{-L}`` (max 65504) nor a small ``c`` (subnormal below 6e-5).
HALF_DTYPES = (torch.float16, torch.bfloat16)


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
            cannot be attributed, and dropping it would silently lose reward), the message
            naming the position ``rewards[b, t]`` and, when row ``b`` has no action token at
            all, saying so; for an unknown ``mode``. ``ends`` may be empty (no action token in
            the batch): then every non-zero reward raises.
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
    if ends.numel() == 0:
        ok = torch.zeros_like(pos, dtype=torch.bool)
    else:
        row_of = torch.div(ends[k.clamp(min=0)], T, rounding_mode="floor")
        ok = (k >= 0) & (row_of == torch.div(pos, T, rounding_mode="floor"))
    if not bool(ok.all()):
        p = int(pos[~ok][0])
        if not bool(mask[p // T].any()):
            raise ValueError(f"{where_(p)} is in row {p // T}, which has no action token; it cannot be "
                             "attributed")
        raise ValueError(f"{where_(p)} is on an observation token with no preceding "
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
        ValueError: as :func:`fold_observation_rewards` (also when the batch has no action
            token at all: a reward anywhere in it raises, naming its row).
    """
    T = values.shape[1]
    r = rewards if rewards.dtype == values.dtype else rewards.to(values.dtype)
    delta = torch.sub(r, values).contiguous()
    # interior action tokens: the next token is the next action token
    delta[:, :-1].add_(values[:, 1:], alpha=gamma)
    if ends.numel() == 0:  # no action token: nothing to compute, but a reward must not vanish
        fold_observation_rewards(r, mask, ends, obs_reward)
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
    """Largest block for which ``c ** -block`` stays well inside ``dtype``'s range.

    ``c^L ≥ 10^{-25}`` (float32) or ``10^{-250}`` (float64; half dtypes never get here: they
    are scanned in float32, see :data:`HALF_DTYPES`), so the in-block
    weights ``c^{n}`` (``n ≤ L``) neither underflow to subnormals nor overflow when divided
    by (``c`` in ``(0, 1]``).
    """
    if c >= 1.0:
        return block
    safe = 25.0 if dtype == torch.float32 else 250.0  # half dtypes are scanned in float32
    return max(1, min(block, int(safe / -math.log10(c))))


def _pad_blocks(t: Tensor, L: int, value: float = 0.0) -> Tensor:
    """``(B, T)`` → ``(B, ⌈T/L⌉, L)``, padded on the right with ``value`` (a view when ``L | T``)."""
    B, T = t.shape
    pad = -T % L
    return (torch.nn.functional.pad(t, (0, pad), value=value) if pad else t).reshape(B, (T + pad) // L, L)


def _doubling_scan(x: Tensor, a: Tensor) -> Tensor:
    """:func:`linear_reverse_scan` by Hillis–Steele recursive doubling, ``⌈log2 N⌉`` steps.

    After the step with stride ``s``, ``G_p`` holds the sum over ``[p, p + 2s)`` and
    ``a_p`` the product of the decays over that span. Zero-padded ping-pong buffers
    (beyond ``N``, ``x = a = 0``: nothing flows back) make each step two fused ops.
    """
    B, N = x.shape
    width = N + (1 << max(N - 1, 0).bit_length() >> 1)  # N + the largest stride
    g, g_new, d, d_new = x.new_zeros(4, B, width).unbind(0)
    g[:, :N] = x
    d[:, :N] = a
    s = 1
    while s < N:
        torch.addcmul(g[:, :N], d[:, :N], g[:, s:s + N], out=g_new[:, :N])
        g, g_new = g_new, g
        if 2 * s < N:
            torch.mul(d[:, :N], d[:, s:s + N], out=d_new[:, :N])
            d, d_new = d_new, d
        s *= 2
    return g[:, :N]


def linear_reverse_scan(x: Tensor, a: Tensor, *, a_min: float = 0.0, block: int = CARRY_BLOCK) -> Tensor:
    """``G_p = x_p + a_p · G_{p+1}`` along dim 1 with ``G_N = 0``: a first-order linear recurrence.

    With a lower bound ``a_min > 0`` on the decays, groups of ``L`` elements (``a_min^L``
    kept inside the dtype's range, :func:`_block_size`) are solved at once: with
    ``e_j = Π_{q<j} a_q`` inside the group, ``G_j = (Σ_{k≥j} x_k e_k + e_L H_next) / e_j``
    (a matmul with a triangular matrix: each suffix summed directly, no cancellation),
    and the ``N / L`` group carries ``H`` recurse with ``a_min^L``. Short rows, and any
    row without such a bound, use recursive doubling (``⌈log2 N⌉`` vectorised steps, no
    rescaling and so no range limit: decay products that underflow only drop terms below
    the smallest normal number). Either way a handful of vectorised ops, never a loop over
    ``N``. Used on the ``(B, T / L)`` block carries of :func:`reverse_action_scan`.
    Sources: first-order linear recurrences as scans (Blelloch 1990, "Prefix sums and
    their applications", §1.4); doubling (Hillis & Steele 1986); the rescaling is the
    block form ``G_j = e_j^{-1} Σ_{k≥j} e_k x_k`` of the recurrence.

    Args:
        x: ``(B, N)`` float.
        a: ``(B, N)`` float decay per step (``a_p`` multiplies ``G_{p+1}``), same dtype and
            device as ``x``; not modified.
        a_min: a lower bound on ``a`` (0: none known, or a decay may be 0).
        block: maximum group length.

    Returns:
        ``G``, ``(B, N)`` with the dtype of ``x`` (possibly a view of a larger buffer);
        float16/bfloat16 inputs are scanned in float32 and rounded once.

    Raises:
        ValueError: if ``x`` is not 2-D or ``a`` has another shape.
    """
    if x.dim() != 2 or a.shape != x.shape:
        raise ValueError(f"x and a must be (B, N) of one shape, got {tuple(x.shape)} and {tuple(a.shape)}")
    if x.dtype in HALF_DTYPES:  # rescaling by a_min^{-L} needs float32's range
        return linear_reverse_scan(x.float(), a.float(), a_min=a_min, block=block).to(x.dtype)
    B, N = x.shape
    L = _block_size(a_min, x.dtype, block) if a_min > 0.0 else 1
    if L < 2 or x.shape[1] <= 2 * block:  # short rows: the doubling's few small ops are cheaper
        return _doubling_scan(x, a)
    xb = _pad_blocks(x, L)
    ab = _pad_blocks(a, L, value=1.0)
    e = torch.empty_like(ab)  # Π_{q<j} a_q within the group
    e[:, :, 0] = 1.0
    e[:, :, 1:] = ab[:, :, :-1]
    e.cumprod_(2)
    upper = torch.ones(L, L, dtype=x.dtype, device=x.device).tril_()  # [k, j] = 1 for k >= j
    g = (xb * e) @ upper
    span = e[:, :, -1] * ab[:, :, -1]  # Π a over the group
    H = linear_reverse_scan(g[:, :, 0], span, a_min=a_min ** L, block=block)
    g[:, :-1].add_(torch.mul(span[:, :-1], H[:, 1:]).unsqueeze(2))
    return g.div_(e).view(B, xb.shape[1] * L)[:, :N]


def _decayed_scan(x: Tensor, mask: Tensor, c: float, L: int) -> Tensor:
    """``G_next`` of :func:`reverse_action_scan` for ``0 < c < 1``, blocks of ``L ≥ 2`` tokens.

    With ``n_j`` the count of action tokens at or before ``j`` in its block and
    ``w_j = c^{n_j}`` (a ``cumprod`` of ``c^{mask}``), ``G_next[j] = (Σ_{k>j} x_k w_k / c +
    c^{n_L} H_next) / w_j`` where ``H_next`` is ``G`` at the next block's first token. The
    in-block sum is one matmul with a strictly triangular matrix (each ``G_next`` summed
    directly, never as a difference of prefix sums, so decaying weights do not cancel).
    The block carries ``H_i = Σ_k x_k w_k / c + c^{n_L} H_{i+1}`` are a reverse scan over
    the ``T / L`` blocks (:func:`linear_reverse_scan`), run in float64 with ``c^{n_L}``
    from the unrounded ``c``, so that ``c`` rounded to float32 does not compound over
    the row (``(1 + ε)^T``); only the ``≤ L``-step in-block powers use the rounded ``c``.
    """
    B, T = x.shape
    dtype, dev = x.dtype, x.device
    xb = _pad_blocks(x, L)
    act = _pad_blocks(mask, L).view(torch.uint8).to(dtype)
    n_block = (act @ torch.ones(L, 1, dtype=dtype, device=dev)).squeeze(2).to(torch.int32)
    c_d = float(torch.tensor(c, dtype=dtype))  # c as the dtype holds it
    # c^{mask}, exactly c_d or 1 (never 1 + (c − 1) rounded), then its cumprod c^{n_j}
    if c_d >= 0.5:  # c_d − 1 is exact (Sterbenz), so 1 + (c_d − 1) · mask is too
        w = act.mul_(c_d - 1.0).add_(1.0).cumprod_(2)
    else:
        w = torch.rsub(act, 1.0).add_(act, alpha=c_d).cumprod_(2)
    xw = xb.mul(w)
    # [k, j] = 1 / c for k > j: (xw @ lower)[j] = Σ_{k>j} x_k c^{n_k − 1}
    g = xw @ torch.full((L, L), 1.0 / c_d, dtype=dtype, device=dev).tril_(-1)
    wide = torch.float64 if dev.type != "mps" else dtype  # MPS has no float64
    total = torch.add(g[:, :, 0], xw[:, :, 0], alpha=1.0 / c_d).to(wide)  # G at block start − carry
    powers = torch.tensor([c ** k for k in range(L + 1)], dtype=wide, device=dev)
    decay = powers.index_select(0, n_block.view(-1)).view(n_block.shape)  # c^{actions in the block}
    H = linear_reverse_scan(total, decay, a_min=c ** L)
    g[:, :-1].add_(torch.mul(decay[:, :-1], H[:, 1:]).to(dtype).unsqueeze(2))  # c^{n_L} H_next
    return g.div_(w).view(B, xb.shape[1] * L)[:, :T]


def reverse_action_scan(x: Tensor, mask: Tensor, c: float, *, block: int = DEFAULT_BLOCK) -> Tensor:
    """Discounted reverse cumulative sums over action tokens, observation tokens skipped.

    ``G_t = x_t + c · G_{n(t)}`` over action tokens (``n(t)`` the next action token,
    ``G`` after the last one = 0); spec "Advantage channel", ``G_t``. Returns
    ``G_next``, where ``G_next[p]`` is ``G`` at the first action token after position
    ``p`` (0 if none); ``G_t = x_t + c · G_next[t]`` at action tokens. At ``c == 0``
    ``G_next`` only ever enters multiplied by ``c``, so the scan is skipped and
    ``G_next[p] = x_{p+1}`` (which is ``G`` of the next token, not of the next action token).

    Implementation: blocks of ``L`` tokens, chained right to left through their carries
    ``H`` (vectorised over blocks, never a loop over tokens or blocks). ``c == 1``: inside
    block ``i``, ``G_next[p] = H_i − cumsum(x)_p`` (one ``cumsum`` and one pass; a prefix
    never spans more than a block, which keeps float32 cancellation small; at a block's
    last token this is ``H_{i+1}``, so no boundary case) and ``H`` is a reverse ``cumsum``
    of the block sums. ``0 < c < 1``: with ``n`` the count of action tokens so far in the
    block, a matmul with a triangular matrix sums ``c^{n} x`` after each token, rescaled
    by ``c^{−n}`` (blocks of at most ``MATMUL_BLOCK`` tokens, fewer when ``c^{−L}`` would
    leave the dtype's range, see :func:`_block_size`); the carries
    ``H_i = S_i + c^{n_i} H_{i+1}`` are solved in float64 by :func:`linear_reverse_scan`
    (the same rescaled matmul over groups of blocks, then doubling over the few groups).
    About 25 vectorised ops whatever ``T``, each over the ``(B, T)`` tensor or much less.
    ``c`` so small that ``L = 1`` (``c < 10^{-25}`` in float32, ``10^{-250}`` in float64):
    recursive doubling over tokens (``⌈log2 T⌉`` steps over ``(B, T)``: correct, slower).

    Args:
        x: ``(B, T)`` float; must be 0 at non-action positions.
        mask: ``(B, T)`` bool action-token mask (only read when ``0 < c < 1``); pass all-True
            to discount per token position instead (``obs_discount="per_token"``).
        c: discount per action token, ``γλ``, in ``[0, 1]``.
        block: maximum block length in tokens.

    Returns:
        ``G_next``, ``(B, T)`` with the dtype of ``x`` (a new tensor, possibly a view of a
        padded buffer); float16/bfloat16 inputs are scanned in float32 and rounded once.

    Raises:
        ValueError: if ``c`` is outside ``[0, 1]`` or ``block < 1``.
    """
    if not 0.0 <= c <= 1.0:
        raise ValueError(f"discount c = gamma * lam must be in [0, 1], got {c!r}")
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block!r}")
    if x.dim() != 2 or mask.shape != x.shape:
        raise ValueError(f"x and mask must be (B, T) of one shape, got {tuple(x.shape)} and "
                         f"{tuple(mask.shape)}")
    if mask.dtype != torch.bool:
        mask = mask != 0
    if x.dtype in HALF_DTYPES:  # c^{-L} and the rounded c leave float16's range / precision
        return reverse_action_scan(x.float(), mask, c, block=block).to(x.dtype)
    B, T = x.shape
    if T == 0:
        return x.clone()
    if c == 1.0:
        L = min(block, T)
        xb = _pad_blocks(x, L)
        cs = xb.cumsum(2)
        H = cs[:, :, -1].flip(1).cumsum(1).flip(1)  # G at the start of each block
        return torch.sub(H.unsqueeze(2), cs, out=cs).view(B, xb.shape[1] * L)[:, :T]  # in place
    if c == 0.0:
        g = x
    else:
        L = min(_block_size(c, x.dtype, min(block, MATMUL_BLOCK)), T)
        if L >= 2:
            return _decayed_scan(x, mask, c, L)
        # one token per block: G_p = x_p + c^{mask_p} G_{p+1} (c^0 = 1 skips observations)
        one = torch.ones((), dtype=x.dtype, device=x.device)
        g = linear_reverse_scan(x, torch.where(mask, one * c, one))
    g_next = torch.zeros_like(g)
    g_next[:, :-1] = g[:, 1:]
    return g_next
