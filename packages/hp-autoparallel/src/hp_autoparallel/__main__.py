"""``python -m hp_autoparallel ...``: the ``hp-plan`` command (also ``calibrate``)."""

import sys

from .cli import main

sys.exit(main())
