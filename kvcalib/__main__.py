"""`python -m kvcalib` is the `kvcalib` console script."""

from kvcalib.cli import main

if __name__ == "__main__":
    main()
