"""``python -m dspark_cache.nemo -c recipe.yaml``: NeMo's train_dspark recipe reading dspark caches."""

from dspark_cache.nemo.recipe import main

if __name__ == "__main__":
    main()
