"""``python -m sdp_jax.train.launch``: :func:`sdp_jax.train.launch.launcher.main`."""

import sys

from sdp_jax.train.launch.launcher import main

sys.exit(main())
