"""``python -m capture_proxy.cli``: the ``capture-proxy`` command (``cli.main``)."""

import sys

from capture_proxy.cli import main

sys.exit(main())
