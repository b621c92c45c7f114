"""`python -m jaxformer ...` and the `jaxformer` script: the command line (jaxformer.cli), started through
jaxformer.launch (malloc settings that need a fresh process) before anything heavy is imported."""
import sys

from jaxformer.launch import hugepage_malloc


def main() -> int:
    hugepage_malloc()
    from jaxformer.cli import main as cli
    return cli()


if __name__ == "__main__":
    sys.exit(main())
