"""`python -m ninfer.train corpus | run | eval`: `ninfer train` without the server's imports."""

import sys

from .cli import main

sys.exit(main())
