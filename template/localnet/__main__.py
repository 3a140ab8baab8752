"""``python -m template.localnet``: runs :func:`template.localnet.network.main` and exits with its status (0 checks
passed; 1 checks failed, a child died or the run timed out; 2 bad options; 130 interrupted)."""

import sys

from template.localnet.network import main

if __name__ == "__main__":
    sys.exit(main())
