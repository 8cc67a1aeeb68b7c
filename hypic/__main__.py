"""python -m hypic up | generate | info | health (the `hypic` command)."""

import sys

from hypic.cli import main

sys.exit(main())
