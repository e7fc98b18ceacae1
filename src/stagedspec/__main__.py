import sys

from stagedspec.cli import main

sys.exit(main())
