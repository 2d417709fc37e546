"""``copc view``: a run's or an evaluation's episodes in one self-contained HTML page.

* :mod:`.samples` — the per-step training samples a run writes (``samples/step_N.jsonl``), size-capped;
* :mod:`.load` — the episodes of a run directory (samples, held-out eval records) or of a
  ``copc eval --out`` directory (``results.jsonl``), as plain dicts;
* :mod:`.page` — the HTML page (inline CSS and JS, no network);
* :mod:`.cli` — ``copc view DIR [--out FILE.html] [--serve]``.
"""
