"""`python -m dspo.gpu_check` as documented before the package was split into folders: the GPU check, now
`dspo.training.gpu_check`."""

import sys

from dspo.training.gpu_check import main

if __name__ == "__main__":
    sys.exit(main())
