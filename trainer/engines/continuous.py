"""Continuous batching of generation requests over a ``transformers`` causal LM.

:class:`ContinuousBatcher` keeps the running sequences packed in the slots ``[0, R)`` of a
:class:`~trainer.engines.kv_slots.SlotKVCache` and advances them together:

* :meth:`ContinuousBatcher.admit` prefills new requests and adds them to the running batch:
  they are sorted by prompt length and grouped so that a group's padded size stays within
  ``prefill_tokens``; a group is one left-padded forward pass (position ids
  ``cumsum(mask) − 1``, as the learner's) that writes each row's prompt into columns
  ``[0, len)`` of its slot and keeps only the last position's logits. Its first token is
  sampled at once.
* :meth:`ContinuousBatcher.step` decodes one token for every running row: row ``i`` feeds its
  last token at position ``n_i`` (the tokens it has cached), writes column ``n_i`` and attends
  to its columns ``[0, n_i]`` (a per-row mask over ``max n + 1`` columns).
* :meth:`ContinuousBatcher.pop_finished` removes finished rows (EOS unless ``ignore_eos``, a
  stop string, ``max_new_tokens`` or the model's context) and moves the last running rows
  into the freed slots, so the next step decodes exactly the running rows. A finished row's
  slot is *parked* (:mod:`trainer.engines.prefix_reuse`): a later prompt that starts with its
  tokens — the next turn of the same episode, or the same system prompt — copies (or takes
  over) that KV and prefills only the rest, with position ids and columns continuing from the
  reused prefix. Long prompts are prefilled in chunks, so no mask exceeds
  :data:`MASK_ELEMENTS`.

Requests therefore join as soon as a slot is free and leave the step they finish, instead of
waiting for a whole batch. Sampling and behavior log-probs are
:func:`~trainer.engines.sampling.sample_next` (the raw-logits convention of
:mod:`trainer.logprobs`); stop strings are :class:`~trainer.engines.stop_strings.StopStringMatcher`.
The batcher is synchronous and single-threaded (the engine's worker thread drives it) and
knows nothing of policy versions beyond the one each row was admitted with.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .base import EngineError, SamplingParams
from .kv_slots import SlotKVCache, WritePlan
from .prefix_reuse import Parked, ParkedPrefixes, common_prefix
from .sampling import sample_next
from .stop_strings import StopStringMatcher

Tensor = torch.Tensor
#: ``f(prompt_ids, new_ids, logits (V,)) -> logits (V,)`` — sampling-only logits hook.
LogitsProcessor = Callable[[list[int], list[int], Tensor], Tensor]
#: Attention implementations that take the batcher's 4-D additive masks.
SUPPORTED_ATTENTION = ("sdpa", "eager")
#: Most elements of one prefill pass's ``(rows, queries, keys)`` mask (a long prompt is chunked).
MASK_ELEMENTS = 1 << 24


@dataclass
class Row:
    """One request in the batch.

    Attributes:
        handle: the caller's object for this request (returned with the row when it finishes).
        prompt: prompt token ids.
        params: its :class:`SamplingParams`.
        version: policy version of the weights it is decoded with (set at admission).
        new_ids / logprobs: generated ids and their behavior log-probs (aligned).
        finish: ``"eos"`` / ``"stop"`` / ``"length"`` once finished, else None.
    """

    handle: Any
    prompt: list[int]
    params: SamplingParams
    version: int
    new_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None
    generator: torch.Generator | None = None
    matcher: StopStringMatcher | None = None
    prompt_t: Tensor | None = None  # prompt as an int64 tensor (prefix matching)

    @property
    def cached(self) -> int:
        """Tokens in the KV cache: the prompt and every generated token but the last."""
        return len(self.prompt) + len(self.new_ids) - 1


@dataclass
class BatchStats:
    """Counters of a batcher's work (for tests, benchmarks and logs).

    Attributes:
        admitted: requests prefilled. joined_running: those admitted while other rows were
            being decoded (continuous batching at work). prefills / steps: prefill and decode
            forward passes. max_rows: most rows in one decode step. decoded_tokens: rows
            summed over decode steps. prefilled_tokens / reused_tokens: prompt tokens computed
            by prefill / taken from parked KV instead.
    """

    admitted: int = 0
    joined_running: int = 0
    prefills: int = 0
    steps: int = 0
    max_rows: int = 0
    decoded_tokens: int = 0
    prefilled_tokens: int = 0
    reused_tokens: int = 0


def prefill_groups(suffixes: list[int], windows: list[int], budget: int) -> list[list[int]]:
    """Indices of the requests grouped into prefill passes.

    Sorted by ``suffixes`` (tokens to compute); a group's ``len × max suffix`` stays within
    ``budget`` and its mask ``len × max suffix × max window`` within :data:`MASK_ELEMENTS`
    (a request over either is a group of its own, chunked by the batcher).
    """
    order = sorted(range(len(suffixes)), key=lambda i: suffixes[i])
    groups: list[list[int]] = []
    for i in order:  # ascending: the newest member has the group's longest suffix
        if groups:
            n, w = len(groups[-1]) + 1, max(windows[j] for j in (*groups[-1], i))
            if n * suffixes[i] <= budget and n * suffixes[i] * w <= MASK_ELEMENTS:
                groups[-1].append(i)
                continue
        groups.append([i])
    return groups


class ContinuousBatcher:
    """Runs requests through one model with continuous batching (see the module docstring).

    Args:
        model: causal LM in eval mode, on ``device``, attention ``sdpa`` or ``eager``,
            full attention in every layer.
        tokenizer: decodes stop strings; its EOS / pad ids end and pad rows.
        max_rows: most rows decoded together.
        device: torch device of the model.
        prefill_tokens: most padded prompt tokens in one prefill forward pass.
        logits_processor: optional sampling-only hook (log-probs stay raw).
        reuse_prefix: park finished rows and reuse their KV for prompts sharing a prefix.
        park_slots: cache slots beyond ``max_rows`` for parked rows (with ``reuse_prefix``).

    Raises:
        EngineError: for another attention implementation or sliding-window layers.
    """

    def __init__(self, model: torch.nn.Module, tokenizer, max_rows: int, device: str = "cpu",
                 prefill_tokens: int = 8192, logits_processor: LogitsProcessor | None = None,
                 reuse_prefix: bool = True, park_slots: int = 8) -> None:
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        attn = getattr(model.config, "_attn_implementation", None)
        if attn not in SUPPORTED_ATTENTION:
            raise EngineError(f"embedded engine: attn_implementation={attn!r} is not supported "
                              f"(use one of {', '.join(SUPPORTED_ATTENTION)})")
        _check_full_attention(cfg)
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.max_rows = max_rows
        self.prefill_tokens = prefill_tokens
        self.logits_processor = logits_processor
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        self.max_len = int(getattr(cfg, "max_position_embeddings", 1 << 30))
        self._dtype = next(model.parameters()).dtype
        self.cache = SlotKVCache(cfg.num_hidden_layers, max_rows + (park_slots if reuse_prefix else 0))
        self.rows: list[Row] = []
        self.parked = ParkedPrefixes() if reuse_prefix else None
        self.stats = BatchStats()

    def free_slots(self) -> int:
        """Rows that can be admitted now."""
        return self.max_rows - len(self.rows)

    def new_row(self, handle: Any, prompt: list[int], params: SamplingParams, version: int) -> Row:
        """A :class:`Row` with its seeded generator and stop-string matcher."""
        gen = (torch.Generator(device=self.device).manual_seed(params.seed)
               if params.seed is not None else None)
        matcher = StopStringMatcher(self.tokenizer, params.stop, prompt) if params.stop else None
        return Row(handle, prompt, params, version, generator=gen, matcher=matcher,
                   prompt_t=torch.tensor(prompt, dtype=torch.long))

    @torch.no_grad()
    def admit(self, rows: list[Row]) -> None:
        """Prefill ``rows`` (at most :meth:`free_slots`) and sample their first tokens."""
        if len(rows) > self.free_slots():
            raise ValueError(f"admit: {len(rows)} rows but {self.free_slots()} free slots")
        running = any(r.finish is None for r in self.rows)
        self.stats.admitted += len(rows)
        self.stats.joined_running += len(rows) if running else 0
        if self.parked is not None and rows:
            self.parked.retain_version(rows[-1].version)
        while rows:
            now, reuse, rows = self._reuse_plan(rows)
            suffixes = [len(r.prompt) - k for r, (_, k) in zip(now, reuse, strict=True)]
            for group in prefill_groups(suffixes, [len(r.prompt) for r in now], self.prefill_tokens):
                self._prefill([now[i] for i in group], [reuse[i] for i in group])

    def _reuse_plan(self, rows: list[Row]) -> tuple[list[Row], list[tuple[Parked | None, int]], list[Row]]:
        """``(rows to prefill now, their reused (source, length), rows to prefill after them)``.

        Sources are parked entries and the prompts of running rows. A row with no source that
        shares a prefix with another such row waits for the next round, where that row (then
        running) is its source: 32 prompts with one system prompt compute it once.
        """
        if self.parked is None:
            return rows, [(None, 0)] * len(rows), []
        running = [Parked(i, r.prompt_t, r.version, -1) for i, r in enumerate(self.rows)]
        now, reuse, later, leaders = [], [], [], []
        for r in rows:
            e, k = self.parked.match(r.prompt_t, r.version, running)
            if e is None:
                if any(common_prefix(r.prompt_t, x.prompt_t) >= self.parked.min_tokens for x in leaders):
                    later.append(r)
                    continue
                leaders.append(r)
            now.append(r)
            reuse.append((e, k))
        return now, reuse, later

    def _prefill(self, group: list[Row], reuse: list[tuple[Parked | None, int]]) -> None:
        """Place ``group`` in the next slots (reusing parked prefixes), prefill, sample."""
        a, n = len(self.rows), len(group)
        self.cache.reserve(max(a + n, self.cache.slots), max(len(r.prompt) for r in group) + 1)
        order, reuse = self._place(a, group, reuse)
        group = [group[i] for i in order]
        starts = [k for _, k in reuse]
        self.rows.extend(group)
        self.stats.reused_tokens += sum(starts)
        ends = [len(r.prompt) for r in group]
        chunk = max(1, MASK_ELEMENTS // max(ends)) if n == 1 else max(ends)
        while True:  # one pass, or several chunks of one long prompt
            stops = [min(e, s + chunk) for s, e in zip(starts, ends, strict=True)]
            logits = self._prefill_pass(a, group, starts, stops)
            if stops == ends:
                break
            starts = stops
        self._sample(group, logits)

    def _place(self, a: int, group: list[Row], reuse: list[tuple[Parked | None, int]]
               ) -> tuple[list[int], list[tuple[Parked | None, int]]]:
        """Give the rows the slots ``[a, a + n)`` with their reused prefix in columns ``[0, k)``.

        A row that extends a parked entry lying in that range takes its slot over (no copy);
        other parked entries in the range move to a free slot above it (or, with none free, the
        least recently used entry is given up); then matched prefixes are copied. Returns the
        order of ``group`` by slot and the reuse (entry, length) of each row in that order.
        """
        n = len(group)
        target: list[int | None] = [None] * n
        for i, (e, k) in enumerate(reuse):  # running rows' prompts are sources below ``a``: no take-over
            if e is not None and k == len(e.tokens) and a <= e.slot < a + n and e.slot not in target:
                target[i] = e.slot
        rest = iter(s for s in range(a, a + n) if s not in target)
        target = [t if t is not None else next(rest) for t in target]
        if self.parked is not None:
            for slot in range(a, a + n):
                e = self.parked.entries.get(slot)
                if e is None:
                    continue
                if any(r is e and t == slot for (r, _), t in zip(reuse, target, strict=True)):
                    self.parked.pop(slot)  # taken over in place
                elif not self._relocate(e, lo=a + n, keep={r.slot for r, _ in reuse if r is not None}):
                    reuse = [(None, 0) if r is e else (r, k) for r, k in reuse]
        for (e, k), t in zip(reuse, target, strict=True):
            if e is not None and e.slot != t:
                self.cache.move(e.slot, t, k)
        order = sorted(range(n), key=lambda i: target[i])
        return order, [reuse[i] for i in order]

    def _relocate(self, e: Parked, lo: int, keep: set[int]) -> bool:
        """Move parked ``e`` to a free slot ``>= lo``, giving up the least recently used entry
        there (not one in ``keep``) if none is free; False (and ``e`` given up) when there is
        no room at all."""
        slot = self._free_slot(lo)
        if slot is None:
            old = self.parked.least_recent(exclude=set(range(lo)) | keep)
            if old is None:
                self.parked.pop(e.slot)
                return False
            slot = old.slot
            self.parked.pop(slot)
        self.cache.move(e.slot, slot, len(e.tokens))
        self.parked.move(e.slot, slot)
        return True

    def _free_slot(self, lo: int, busy: set[int] = frozenset()) -> int | None:
        """The first slot ``>= lo`` that is neither parked nor in ``busy`` (growing the cache's
        slots when it is beyond them), or None."""
        slot = next((s for s in range(lo, self.cache.max_slots)
                     if s not in self.parked.entries and s not in busy), None)
        if slot is not None and slot >= self.cache.slots:
            self.cache.reserve(slot + 1, self.cache.capacity)
        return slot

    def _prefill_pass(self, a: int, group: list[Row], starts: list[int], stops: list[int]) -> Tensor:
        """Feed prompt tokens ``[start, stop)`` of each row (slot ``a + i``): one forward pass.

        The input is left-padded; token ``j`` of row ``i`` goes to column and position
        ``start_i + j`` and attends to the row's columns up to itself (reused ones included);
        padding writes the cache's last column and sees column 0 (finite, never read after).
        Returns the ``(n, V)`` logits of each row's last fed token.
        """
        n = len(group)
        st, sp = torch.tensor(starts), torch.tensor(stops)
        Lq, W = int((sp - st).max()), int(sp.max())
        ids = torch.full((n, Lq), self.pad_id, dtype=torch.long)
        for i, r in enumerate(group):
            ids[i, Lq - (stops[i] - starts[i]):] = torch.tensor(r.prompt[starts[i]:stops[i]])
        j = torch.arange(Lq)
        qcol = st[:, None] + j[None, :] - (Lq - (sp - st))[:, None]  # (n, Lq) column of each input
        valid = j[None, :] >= (Lq - (sp - st))[:, None]
        mask = torch.arange(W)[None, None, :] <= qcol[:, :, None]  # (n, Lq, W): causal, own columns
        mask[:, :, 0] = True  # padding queries see column 0 (finite) instead of nothing
        plan = WritePlan(slice(a, a + n), torch.arange(a, a + n)[:, None],
                         torch.where(valid, qcol, self.cache.capacity - 1), W)
        logits = self._forward(ids, mask[:, None], torch.where(valid, qcol, 0), plan, logits_to_keep=1)
        self.stats.prefills += 1
        self.stats.prefilled_tokens += int((sp - st).sum())
        return logits

    @torch.no_grad()
    def step(self) -> None:
        """Decode one token for every unfinished row (finished rows must be popped first)."""
        rows = self.rows
        if not rows:
            return
        if any(r.finish is not None for r in rows):
            raise ValueError("step: pop_finished() first")
        B = len(rows)
        n = torch.tensor([r.cached for r in rows])
        W = int(n.max()) + 1
        self.cache.reserve(B, W)
        ids = torch.tensor([r.new_ids[-1] for r in rows])[:, None]
        plan = WritePlan(slice(0, B), torch.arange(B)[:, None], n[:, None], W)
        mask = (torch.arange(W)[None, :] <= n[:, None])[:, None, None, :]
        logits = self._forward(ids, mask, n[:, None], plan)
        self.stats.steps += 1
        self.stats.decoded_tokens += B
        self.stats.max_rows = max(self.stats.max_rows, B)
        self._sample(rows, logits)

    def _forward(self, ids: Tensor, mask: Tensor, pos: Tensor, plan: WritePlan, **kw) -> Tensor:
        """Last-position logits ``(R, V)`` of one forward pass through the slot cache."""
        dev = self.device
        # additive (0 / dtype min) for both kernels: eager adds it; CPU sdpa is ~30 % faster with it
        mask = torch.zeros(mask.shape, dtype=self._dtype).masked_fill_(~mask, torch.finfo(self._dtype).min)
        self.cache.plan = WritePlan(plan.rows, plan.slot_idx.to(dev), plan.cols.to(dev), plan.window)
        try:
            out = self.model(input_ids=ids.to(dev), attention_mask=mask.to(dev), position_ids=pos.to(dev),
                             cache=self.cache, use_cache=True, **kw)
        finally:
            self.cache.plan = None
        return out.logits[:, -1]

    def _sample(self, rows: list[Row], logits: Tensor) -> None:
        proc = None
        if self.logits_processor is not None:
            proc = torch.stack([self.logits_processor(r.prompt, r.new_ids, logits[i])
                                for i, r in enumerate(rows)])
        tok, logp = sample_next(logits, [r.params for r in rows], [r.generator for r in rows], proc)
        for r, t, lp in zip(rows, tok.tolist(), logp.tolist(), strict=True):  # one device->host copy
            r.new_ids.append(t)
            r.logprobs.append(lp)
            if t == self.eos_id and not r.params.ignore_eos:
                r.finish = "eos"
            elif r.matcher is not None and r.matcher.push(t) is not None:
                r.finish = "stop"
            elif len(r.new_ids) >= r.params.max_new_tokens or len(r.prompt) + len(r.new_ids) >= self.max_len:
                r.finish = "length"

    def pop_finished(self) -> list[Row]:
        """Remove and return the finished rows; the last running rows move into their slots.

        With prefix reuse each finished row is parked: in place when its slot is above the
        running rows, else copied to a free slot first.
        """
        done = [i for i, r in enumerate(self.rows) if r.finish is not None]
        if not done:
            return []
        finished = [self.rows[i] for i in done]
        keep = len(self.rows) - len(done)
        movers = [i for i in range(keep, len(self.rows)) if self.rows[i].finish is None]
        if self.parked is not None:
            for i in done:
                if i >= keep:
                    self._park(i, i)
        busy = set(movers)
        for h, m in zip((i for i in done if i < keep), movers, strict=True):
            if self.parked is not None:
                slot = self._free_slot(keep, busy)
                if slot is None and (old := self.parked.least_recent()) is not None:
                    slot = self.parked.pop(old.slot).slot
                if slot is not None:
                    self._park(h, slot)
            self.cache.move(m, h, self.rows[m].cached)
            self.rows[h] = self.rows[m]
            busy.discard(m)
        del self.rows[keep:]
        return finished

    def _park(self, i: int, slot: int) -> None:
        """Park finished row ``i`` in ``slot`` (copying its KV there when ``slot != i``)."""
        r = self.rows[i]
        if r.cached < self.parked.min_tokens:
            return
        if slot != i:
            self.cache.move(i, slot, r.cached)
        self.parked.add(slot, (r.prompt + r.new_ids)[: r.cached], r.version)

    def release(self) -> None:
        """Forget parked rows and free the cache's buffers (no row may be running)."""
        if self.rows:
            raise ValueError(f"release: {len(self.rows)} rows are running")
        if self.parked is not None:
            self.parked.entries.clear()
        self.cache.release()

    def abort_all(self) -> list[Row]:
        """Remove and return every row, and forget parked KV (after a failed forward pass the
        cache is not trusted)."""
        rows, self.rows = self.rows, []
        if self.parked is not None:
            self.parked.entries.clear()
        return rows


def _check_full_attention(cfg: Any) -> None:
    """Raise :class:`EngineError` if the model has sliding-window (or other non-full) attention."""
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        odd = sorted(set(types) - {"full_attention"})
        if odd:
            raise EngineError(f"embedded engine: layer_types {odd} are not supported (full attention only)")
    elif getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        raise EngineError(f"embedded engine: sliding_window={cfg.sliding_window} is not supported "
                          "(full attention only)")
