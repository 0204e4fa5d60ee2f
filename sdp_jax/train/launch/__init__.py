"""Several processes: the launcher (``python -m sdp_jax.train.launch``), ``jax.distributed`` set-up,
and the processes' watch of one another.

The public face of the wing; ``sdp_jax.train.launch.initialize`` as before. Its members, from the
top:

* :mod:`sdp_jax.train.launch.launcher`: starts a command as several JAX processes on this machine,
  forwards signals, restarts the survivors with ``--elastic``, and ``initialize``;
* :mod:`sdp_jax.train.launch.peers`: the processes' watch of one another (a peer that ended,
  was lost or hung ends the others with one line), and the signals a process holds until its
  watch has started.
"""

from sdp_jax.train.launch.launcher import (HUNG_AFTER, PROG, UNTOLD_AFTER,
                                           check_processes_per_worker, coordinator_args,
                                           free_port, initialize, main, multi_process_env, parser,
                                           process_env, run)

__all__ = ["PROG", "HUNG_AFTER", "UNTOLD_AFTER", "free_port", "process_env", "run", "check_processes_per_worker",
           "multi_process_env", "coordinator_args", "initialize", "parser", "main"]
