"""``python -m dcp_datastates``: the ``dcp-datastates`` command line."""

import sys

from .cli import main

sys.exit(main())
