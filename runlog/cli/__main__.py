import sys

from runlog.cli import main

sys.exit(main())
