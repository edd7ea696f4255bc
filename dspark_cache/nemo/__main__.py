"""``python -m dspark_cache.nemo -c recipe.yaml``: NeMo's train_dspark recipe reading dspark caches."""

import sys

from dspark_cache.nemo.recipe import install, main

if __name__ == "__main__":
    try:
        install()  # fails fast, in one line, where NeMo's recipe is missing or another version
    except (ImportError, RuntimeError) as exc:
        print(f"dspark_cache.nemo: {exc}", file=sys.stderr)
        sys.exit(1)
    main()
