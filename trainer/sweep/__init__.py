"""``copc sweep``: grids of training runs (Figure-1-style heatmaps), see :mod:`trainer.sweep.command`."""
