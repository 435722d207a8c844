import sys

from asyncconn.cli import main

sys.exit(main())
