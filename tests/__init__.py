"""A package, so `tests.conftest` is this folder even where a dependency ships a top-level `tests` (draccus does)."""
