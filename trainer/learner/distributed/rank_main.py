"""Entry point of a spawned learner rank: ``python -m trainer.learner.distributed.rank_main FD``.

Started by :class:`~trainer.learner.distributed.launch.SpawnGroup` with one end of a socket pair
as file descriptor ``FD`` and the driver's multiprocessing authkey in ``COPC_RANK_AUTHKEY`` (so
tensors can be passed through shared memory); runs :func:`~.worker.spawn_main`.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from multiprocessing.connection import Connection

import torch.multiprocessing  # noqa: F401 - registers the shared-memory tensor pickling

from trainer.learner.distributed.worker import spawn_main

if __name__ == "__main__":
    multiprocessing.current_process().authkey = bytes.fromhex(os.environ["COPC_RANK_AUTHKEY"])
    spawn_main(Connection(int(sys.argv[1])))
