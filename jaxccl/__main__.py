import sys

from jaxccl.cli import main

sys.exit(main())
