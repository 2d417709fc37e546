"""What a run writes: checkpoints (``checkpoint.py``), metric logs and the summary (``metrics_log.py``),
plots (``plots.py``), the console report (``report.py``) and the progress bar (``progress.py``).

Leaves of the trainer: they import nothing of ``trainer/`` beyond each other, so every layer may
write its outputs through them.
"""
