"""``python -m redis_layer_signals`` is ``rls``."""

from .cli import main

if __name__ == "__main__":
    main()
