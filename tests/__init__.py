"""medusa's tests, a regular package: a dependency's top-level `tests` package (draccus's) must not shadow it."""
