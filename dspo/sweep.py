"""`python -m dspo.sweep` as documented before the package was split into folders: a sweep's job states (also the dspo-
sweep command), now `dspo.sweeps.status`."""

from dspo.sweeps.status import main

if __name__ == "__main__":
    raise SystemExit(main())
