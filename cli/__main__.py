import sys

from xronos.cli.main import main

sys.exit(main())
