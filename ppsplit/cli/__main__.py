import sys

from ppsplit.cli.commands import main

sys.exit(main())
