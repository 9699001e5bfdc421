import sys

from vembed.cli import main

sys.exit(main())
