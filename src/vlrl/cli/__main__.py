"""`python -m vlrl.cli` (and `torchrun -m vlrl.cli`): the `vlrl` command."""

from vlrl.cli import main

if __name__ == "__main__":
    main()
