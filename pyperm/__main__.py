import sys

from pyperm.cli import main

sys.exit(main())
