"""`python -m jaxformer ...` and the `jaxformer` script: the command line (jaxformer.cli), started through
jaxformer.platforms.launch (malloc settings that need a fresh process) before anything heavy is imported."""
import sys

from jaxformer.platforms.launch import hugepage_malloc
from jaxformer.signals import hold_from_start


def main() -> int:
    hold_from_start()                    # Ctrl-C while Python loads JAX: acted on once the command can stop
    hugepage_malloc()
    from jaxformer.cli import main as cli
    return cli()


if __name__ == "__main__":
    sys.exit(main())
