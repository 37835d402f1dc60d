"""`python -m pagoda.bench ...`: the same as `pagoda bench ...`."""

import sys

from pagoda.bench.offline import main

sys.exit(main())
