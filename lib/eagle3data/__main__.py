import sys

from eagle3data.cli import main

sys.exit(main())
