"""Input validation shared by every function in :mod:`copc`.

Checks are cheap (shape/dtype only); value checks (NaN, ±inf) are done lazily
on the outputs by :func:`raise_if_not_finite`, which then names the offending
input, so the fast path pays for one reduction per output, not a pass per input.
"""

from __future__ import annotations

import torch

from ._scalars import check_number, check_unit_interval  # noqa: F401 - re-exported (defined without torch)

Tensor = torch.Tensor


def as_bool_mask(loss_mask: Tensor, shape: torch.Size | None = None) -> Tensor:
    """Return ``loss_mask`` as a ``torch.bool`` tensor of the same shape.

    Args:
        loss_mask: ``(B, T)`` bool, integer or floating tensor; 1/True marks an action
            token (sampled by the policy), 0/False an observation or padding token.
        shape: if given, the shape ``loss_mask`` must have.

    Returns:
        ``(B, T)`` bool tensor (the input itself when it is already bool).

    Raises:
        ValueError: if ``loss_mask`` is not 2-D, has the wrong shape, or holds values
            other than 0 and 1.
        TypeError: if ``loss_mask`` is not a tensor.
    """
    if not isinstance(loss_mask, torch.Tensor):
        raise TypeError(f"loss_mask must be a torch.Tensor, got {type(loss_mask).__name__}")
    if loss_mask.dim() != 2:
        raise ValueError(f"loss_mask must be 2-D (B, T), got shape {tuple(loss_mask.shape)}")
    if shape is not None and loss_mask.shape != shape:
        raise ValueError(
            f"loss_mask has shape {tuple(loss_mask.shape)}, expected {tuple(shape)}"
        )
    if loss_mask.dtype == torch.bool:
        return loss_mask
    m = loss_mask != 0
    if bool(((loss_mask != 1) & m).any()):
        bad = loss_mask[(loss_mask != 1) & m][0].item()
        raise ValueError(f"loss_mask must contain only 0 and 1, found {bad!r}")
    return m


def check_2d_float(name: str, x: Tensor, shape: torch.Size | None = None) -> None:
    """Check that ``x`` is a 2-D floating tensor (of ``shape`` when given).

    Raises:
        TypeError: if ``x`` is not a tensor or not floating point.
        ValueError: if ``x`` is not 2-D or its shape differs from ``shape``.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D (B, T), got shape {tuple(x.shape)}")
    if shape is not None and x.shape != shape:
        raise ValueError(
            f"{name} has shape {tuple(x.shape)}, but loss_mask has shape {tuple(shape)}"
        )


def check_1d(name: str, x: Tensor, batch: int, *, floating: bool = True) -> None:
    """Check that ``x`` is a ``(B,)`` tensor with ``B == batch``.

    Raises:
        TypeError: if ``x`` is not a tensor or (when ``floating``) not floating point.
        ValueError: if ``x`` is not 1-D of length ``batch``.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if floating and not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if x.dim() != 1 or x.shape[0] != batch:
        raise ValueError(f"{name} must have shape ({batch},), got {tuple(x.shape)}")


def first_bad(name: str, x: Tensor, where: Tensor) -> str | None:
    """Describe the first NaN/±inf entry of ``x`` inside ``where``, or return None.

    Args:
        name: the argument's name used in the message.
        x: ``(B, T)`` tensor.
        where: ``(B, T)`` bool tensor restricting the search (e.g. action tokens).
    """
    bad = ~torch.isfinite(x) & where
    if not bool(bad.any()):
        return None
    b, t = (int(i) for i in bad.nonzero()[0])
    return f"{name}[{b}, {t}] = {x[b, t].item()!r}"


def raise_if_not_finite(outputs: tuple[Tensor, ...], inputs: dict[str, Tensor | tuple[Tensor, Tensor]],
                        where: Tensor, context: str) -> None:
    """Raise ``ValueError`` when any output is non-finite, naming the input that caused it.

    The fast path is one ``sum`` per output. Only on failure are the inputs
    scanned (restricted to ``where``) to build a precise message.

    Args:
        outputs: tensors that must be finite.
        inputs: name → ``(B, T)`` input tensor (scanned at ``where``), or ``(tensor, region)``
            with its own bool region (e.g. all positions for rewards, which are folded);
            1-D tensors (e.g. bootstrap values) are scanned whole.
        where: ``(B, T)`` bool tensor of positions whose inputs matter.
        context: the calling function's name, for the message.

    Raises:
        ValueError: if any output contains NaN or ±inf.
    """
    if all(bool(torch.isfinite(o.sum())) for o in outputs):
        return
    reasons = []
    for n, x in inputs.items():
        t, region = x if isinstance(x, tuple) else (x, where)
        if t.dim() == 1:
            bad = (~torch.isfinite(t)).nonzero()
            if bad.numel():
                reasons.append(f"{n}[{int(bad[0])}] = {t[int(bad[0])].item()!r}")
            continue
        if (r := first_bad(n, t, region)) is not None:
            reasons.append(r)
    detail = "; ".join(reasons) if reasons else "inputs are finite but the result overflowed"
    raise ValueError(f"{context}: non-finite result; offending input(s): {detail}")
