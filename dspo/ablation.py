"""`python -m dspo.ablation` as documented before the package was split into folders: the ablation report (also the
dspo-report command), now `dspo.sweeps.report`."""

from dspo.sweeps.report import main

if __name__ == "__main__":
    main()
